"""The GPU attention backend: Triton KV write, then Triton paged attention.

The scheduler puts decodes first and prefill chunks last. Over an 8-bit cache the batch's
leading decodes take one paged-attention launch and its other Triton chunks a second, so
that the decodes keep the decode tile shapes in a step that also prefills: in one launch
they would take the prefill tiles (64 query rows, of which a decode fills its GQA
group's), and there widening the codes and the tensor-core work, not the bytes, bound
them (on an NVIDIA H100, the 256 x (512, 128) throughput over FP8 weights and KV rose
from 1.35-1.39x bf16's to 1.39-1.43x, BENCHMARKS.md). Over a plain cache one launch stays:
its decodes are bound by bytes, and two launches were 3% slower for a 2,048-token chunk
with 63 decodes at 8k (docs/kernels.md).

Long prefill chunks go to PyTorch's fused attention (SDPA). A chunk qualifies when it
belongs to the batch's *suffix* of long chunks (so the Triton launches keep contiguous
runs of rows and sequences) and has at least

- ``sdpa_min_tokens`` new tokens when it is a whole prompt (no cached context): causal
  SDPA on its own new q/k/v, exact as it stands; flash there is about twice as fast as
  the Triton kernel;
- ``sdpa_min_chunk_tokens`` when it follows cached context: the context is gathered
  from the paged cache into contiguous K/V; in half precision two fused passes (over the
  context, and causally over the chunk; cuDNN's kernels, flash where missing) are merged
  by log-sum-exp (one Triton kernel, ``attention_merge``), in float32 one SDPA call
  with a bottom-right causal mask.

An 8-bit cache (``kernels/fp8_kv.py``: e4m3 or int8 codes, the same layout) is written
and read by the same kernels (quantized slots in the KV write, codes and scales
dequantized in registers in paged attention). A chunk after cached context stays in the
Triton launch, which reads the 8-bit cache in place, unless it has
``sdpa_min_fp8_chunk_tokens`` new tokens (2,048 by default, as over a plain cache): then
its context is gathered and dequantized into a working copy (``gather_fp8_context``, as a
plain cache's context is gathered into one) for the two fused passes, which run as fast
as over a bf16 cache. Whatever goes to SDPA attends over its own new K/V round-tripped
through the 8-bit format (bit-identical to what the KV write stored), so its output is
the one the paged path would give and outputs do not depend on chunking or on prefix
hits.

On the GPU whole prompts and chunks are padded at their end to one of a few lengths
(``attention_bucket``) whose cuDNN execution plans ``warm_up`` builds at start-up.

Measurements on an NVIDIA H200 are in BENCHMARKS.md.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention.bias import causal_lower_right

from kernels.attention_merge import merge_attention_states
from kernels.fp8_kv import is_quantized_cache
from kernels.interface import AttentionBackend, AttentionMetadata
from kernels.triton_attention import paged_attention
from kernels.triton_kv_write import gather_fp8_context, write_kv_triton

logger = logging.getLogger(__name__)

# NOTE: measured on an NVIDIA H200, bf16, 32/8 heads, head_dim 128 (docs/kernels.md):
# SDPA wins from 512-token prompts up; over cached context it lost at a 512-token
# chunk and won by 7-12% at 2k-8k chunks.
DEFAULT_SDPA_MIN_TOKENS = 512
DEFAULT_SDPA_MIN_CHUNK_TOKENS = 2048
# NOTE: over an FP8 cache a chunk's context is first gathered and dequantized
# (``gather_fp8_context``), then read by SDPA as a plain cache's gathered context is.
# Measured on an NVIDIA H200 (BENCHMARKS.md): a 2,048-token chunk after 65,536 cached
# tokens took 3.77 ms so (bf16 cache: 3.76 ms), 20.5 ms in the Triton kernel reading
# FP8 in place; a 512-token chunk after 4,096 took 0.89 ms so, 0.35 ms in Triton.
DEFAULT_SDPA_MIN_FP8_CHUNK_TOKENS: int | None = 2048


class TritonBackend(AttentionBackend):
    """Mixed prefill + decode batches in one Triton launch; long chunks through SDPA."""

    name = "triton"
    supports_cuda_graphs = True
    supports_quantized_kv = True

    def __init__(
        self,
        sdpa_min_tokens: int | None = DEFAULT_SDPA_MIN_TOKENS,
        sdpa_min_chunk_tokens: int | None = DEFAULT_SDPA_MIN_CHUNK_TOKENS,
        sdpa_min_fp8_chunk_tokens: int | None = DEFAULT_SDPA_MIN_FP8_CHUNK_TOKENS,
    ) -> None:
        """Shortest whole prompt / chunk over cached context (plain cache / 8-bit cache)
        sent to SDPA; None: never."""
        self.sdpa_min_tokens = sdpa_min_tokens
        self.sdpa_min_chunk_tokens = sdpa_min_chunk_tokens
        self.sdpa_min_fp8_chunk_tokens = sdpa_min_fp8_chunk_tokens

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv_triton(key, value, kv_layer, meta.slot_mapping)
        fp8 = is_quantized_cache(kv_layer)  # either 8-bit format
        first_long = self._first_long_chunk(meta, fp8)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        starts = [0]
        for query_len in meta.query_lens_host:
            starts.append(starts[-1] + query_len)
        num_decodes = _leading_decodes(meta.query_lens_host[:first_long]) if fp8 else 0
        for begin, end in ((0, num_decodes), (num_decodes, first_long)):
            if begin < end:
                _paged_run(query, kv_layer, meta, starts, begin, end, scale, out)
        for seq in range(first_long, meta.num_seqs):
            begin, end = starts[seq], starts[seq + 1]
            seq_len = meta.seq_lens_host[seq]
            context = seq_len - (end - begin)
            seq_key, seq_value = key[begin:end], value[begin:end]
            if fp8:
                # NOTE: the new K/V as the cache holds them (see the module's note): the whole
                # sequence read back in one gather (a torch round trip of the new rows took
                # 40 ms of a 32k-token prompt's 1 s on an NVIDIA H200).
                all_key, all_value = _gather_context(
                    kv_layer, meta.block_tables[seq], seq_len, query.dtype
                )
                seq_key, seq_value = all_key[context:], all_value[context:]
            if context == 0:
                attended = _causal_sdpa(query[begin:end], seq_key, seq_value, scale)
                if meta.num_seqs == 1:
                    return attended  # the whole batch is this prompt: no copy into out
                out[begin:end] = attended
            elif query.dtype != torch.float32:
                if fp8:
                    context_key, context_value = all_key[:context], all_value[:context]
                else:
                    context_key, context_value = _gather_context(
                        kv_layer, meta.block_tables[seq], context, query.dtype
                    )
                _chunk_after_context(
                    query[begin:end], context_key, context_value, seq_key, seq_value,
                    scale, out=out[begin:end],
                )  # fmt: skip
            else:
                if not fp8:
                    all_key, all_value = _gather_context(
                        kv_layer, meta.block_tables[seq], seq_len, query.dtype
                    )
                out[begin:end] = _causal_sdpa(query[begin:end], all_key, all_value, scale)
        return out

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_layer: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        write_kv_triton(key, value, kv_layer, slot_mapping)

    @torch.inference_mode()
    def warm_up(
        self,
        query_shape: tuple[int, int, int],
        num_kv_heads: int,
        max_context_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """Build cuDNN's plans (in this thread) for every padded prompt length and a long
        prompt's chunks.

        Runs fused attention once on zeros of each shape: the whole-prompt buckets from
        ``sdpa_min_tokens`` up to a full step, then a full step's chunk after each whole
        number of chunks of context (how a long document prefills). Other chunk shapes
        (after a cached prefix of any length, or sharing a step with decodes) still build
        their plan on first use. Running out of memory here only ends the warm-up.
        """
        if device.type != "cuda" or dtype == torch.float32:
            return
        max_tokens, num_heads, head_dim = query_shape
        longest = min(max_tokens, max_context_len)

        def zeros(length: int, heads: int) -> torch.Tensor:
            return torch.zeros(length, heads, head_dim, dtype=dtype, device=device)

        try:
            if self.sdpa_min_tokens is not None and longest >= self.sdpa_min_tokens:
                lengths = range(self.sdpa_min_tokens, longest + 1, 64)
                for length in sorted({attention_bucket(n) for n in [*lengths, longest]}):
                    kv = zeros(length, num_kv_heads)
                    _causal_sdpa(zeros(length, num_heads), kv, kv, 1.0)
            if self.sdpa_min_chunk_tokens is not None and longest >= self.sdpa_min_chunk_tokens:
                query, kv, out = (
                    zeros(longest, num_heads),
                    zeros(longest, num_kv_heads),
                    zeros(longest, num_heads),
                )
                # NOTE: prefixes of one buffer have the strides of a gathered context
                context_kv = zeros(max_context_len - longest, num_kv_heads)
                for context in range(longest, max_context_len - longest + 1, longest):
                    _chunk_after_context(
                        query, context_kv[:context], context_kv[:context], kv, kv, 1.0, out
                    )
        except torch.OutOfMemoryError:
            logger.warning(
                "attention warm-up stopped: out of device memory (plans build on first use)"
            )
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()

    def _first_long_chunk(self, meta: AttentionMetadata, fp8: bool) -> int:
        """Index of the first sequence of the trailing run of chunks that go to SDPA."""
        first = meta.num_seqs
        while first > 0 and self._use_sdpa(
            meta.query_lens_host[first - 1], meta.seq_lens_host[first - 1], fp8
        ):
            first -= 1
        return first

    def _use_sdpa(self, query_len: int, seq_len: int, fp8: bool) -> bool:
        if query_len == seq_len:
            limit = self.sdpa_min_tokens
        elif fp8:
            limit = self.sdpa_min_fp8_chunk_tokens
        else:
            limit = self.sdpa_min_chunk_tokens
        return limit is not None and query_len >= limit


def _leading_decodes(query_lens: list[int]) -> int:
    """How many sequences at the batch's head decode one token (the scheduler puts them first)."""
    count = 0
    while count < len(query_lens) and query_lens[count] == 1:
        count += 1
    return count


def _paged_run(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    starts: list[int],
    begin: int,
    end: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Paged attention of sequences ``begin:end`` (their rows ``starts[begin]:starts[end]``)
    into ``out``, in one launch."""
    rows = slice(starts[begin], starts[end])
    query_start_loc = meta.query_start_loc[begin : end + 1]
    if starts[begin]:
        query_start_loc = query_start_loc - starts[begin]
    paged_attention(
        query[rows],
        kv_layer,
        meta.block_tables[begin:end],
        meta.seq_lens[begin:end],
        query_start_loc,
        scale=scale,
        max_query_len=max(meta.query_lens_host[begin:end]),
        max_seq_len=max(meta.seq_lens_host[begin:end]),
        out=out[rows],
    )


def _gather_context(
    kv_layer: torch.Tensor, block_table: torch.Tensor, seq_len: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a sequence's first ``seq_len`` tokens, each ``[seq_len, kv_heads, head_dim]``
    (an 8-bit cache's dequantized into ``dtype``)."""
    if is_quantized_cache(kv_layer):
        return gather_fp8_context(kv_layer, block_table, seq_len, dtype)
    _, _, block_size, num_kv_heads, head_dim = kv_layer.shape
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    # NOTE: K and V gathered apart, so each result is contiguous and flattens to tokens.
    key = kv_layer[:, 0][blocks].view(num_blocks * block_size, num_kv_heads, head_dim)
    value = kv_layer[:, 1][blocks].view(num_blocks * block_size, num_kv_heads, head_dim)
    return key[:seq_len], value[:seq_len]


def attention_bucket(length: int) -> int:
    """``length`` rounded up to a sixteenth of its power of two (at least 128 tokens).

    Fused attention on the GPU runs cuDNN, which builds an execution plan for every new
    shape (about 60 ms on an NVIDIA H200, more for odd lengths): a whole prompt or a chunk
    is padded at its end to one of these few lengths, whose plans ``TritonBackend.warm_up``
    builds at start-up. Padding at the end is exact for causal attention (no real query
    sees a later key). It adds under an eighth more tokens from 1,024 up (a quarter more
    causal attention work at worst), under a quarter from 512 up.
    """
    step = max(128, triton.next_power_of_2(length) // 16)
    return -(-length // step) * step


def pad_tokens(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """``tensor [T, H, D]`` as a contiguous ``[length, H, D]``, zero-padded at the end.

    The tensor itself when it already is one (the fused rotary's q and k at a bucket
    length); otherwise a copy. cuDNN keys its execution plans on strides as well as
    shapes, so every input reaches it contiguous; it also runs fastest that way (on an
    NVIDIA H200, 646 TFLOP/s for a contiguous 32k prompt against 590 for views of the
    qkv projection).
    """
    num_tokens = tensor.shape[0]
    if num_tokens == length and tensor.is_contiguous():
        return tensor
    padded = tensor.new_empty((length, *tensor.shape[1:]))
    padded[:num_tokens] = tensor
    padded[num_tokens:].zero_()  # NOTE: padded V rows meet zero weights; keep them finite
    return padded


def _attention_with_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention of ``[q, H, D]`` over ``[kv, H_kv, D]``: ``(out [H, q, D], lse [H, q])``.

    cuDNN's kernel first (on an NVIDIA H200 it took a 131072-token prefill from 16.1 s
    with flash to 11.3 s, notes in BENCHMARKS.md), flash where cuDNN attention is missing.
    Both take the grouped K/V heads as they are: copying each K/V head once per query
    head cost 5% of a chunk's attention over 114,688 cached tokens, for no faster kernel.
    """
    global _cudnn_failed
    q_len, heads, head_dim = query.shape
    q, k, v = (t.to(query.dtype).transpose(0, 1).unsqueeze(0) for t in (query, key, value))
    if not _cudnn_failed:
        try:
            result = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, 0.0, causal, False, scale=scale
            )
            return result[0].reshape(heads, q_len, head_dim), result[1].reshape(heads, q_len)
        except torch.OutOfMemoryError:
            raise  # no reason to give up on cuDNN for good
        except RuntimeError as exc:
            _cudnn_failed = True
            logger.warning("cuDNN attention unavailable (%s); chunks use flash attention", exc)
    result = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale
    )
    return result[0].reshape(heads, q_len, head_dim), result[1].reshape(heads, q_len)


_cudnn_failed = False


def _chunk_after_context(
    query: torch.Tensor,
    context_key: torch.Tensor,
    context_value: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """A chunk's ``[q, H, D]`` queries over all cached context and, causally, over themselves.

    Two fused passes (full over the context, causal over the chunk's own K/V) merged by
    their log-sum-exps into ``out``: the fused kernels cannot align a causal mask
    bottom-right, and the masked path SDPA would take instead is much slower on long
    contexts. The chunk is padded at its end to its ``attention_bucket`` (padded queries
    are dropped, padded keys come after every real query).

    NOTE: splitting a long context into segments that fit in L2 was slower on an NVIDIA
    H200 (569 against 604 TFLOP/s over 114,688 cached tokens in 16k segments).
    """
    q_len = query.shape[0]
    length = attention_bucket(q_len)
    query, key, value = (pad_tokens(t, length) for t in (query, key, value))
    out_context, lse_context = _attention_with_lse(query, context_key, context_value, False, scale)
    out_chunk, lse_chunk = _attention_with_lse(query, key, value, True, scale)
    merge_attention_states(
        out_context[:, :q_len],
        lse_context[:, :q_len],
        out_chunk[:, :q_len],
        lse_chunk[:, :q_len],
        out,
    )


def _causal_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """One sequence's ``[q_len, heads, D]`` queries over its last-aligned ``[kv_len, kv_heads, D]``.

    A whole prompt in half precision on the GPU (cuDNN's case) is padded at its end to
    its ``attention_bucket``; float32 keeps its exact shapes.
    """
    q_len, kv_len = query.shape[0], key.shape[0]
    mask = None if q_len == kv_len else causal_lower_right(q_len, kv_len)
    if mask is None and query.is_cuda and query.dtype != torch.float32:
        length = attention_bucket(q_len)
        query, key, value = (pad_tokens(t, length) for t in (query, key, value))
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0),
        key.to(query.dtype).transpose(0, 1).unsqueeze(0),
        value.to(query.dtype).transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out[0, :, :q_len].transpose(0, 1)
