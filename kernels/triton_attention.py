"""Paged attention over the block-major KV cache, as Triton kernels.

Tiling
------
One program handles one *q-block* of one KV head: ``BLOCK_Q`` consecutive new tokens of
one sequence times the ``G = num_heads // num_kv_heads`` query heads that share the KV
head, packed into the rows of one ``BLOCK_M``-row tile (row ``m`` is token ``m // G``,
head ``m % G``; ``BLOCK_Q = BLOCK_M // G``). Packing the GQA group into the rows loads
each K/V tile once for every head that reads it, and lets a decode (one token) still
fill a 16-row ``tl.dot``.

The program walks its sequence's context in tiles of ``TILE_N`` tokens. A tile may span
several cache blocks: each token's block id is read from the block table, so tiles are
not tied to the block size and any block size works. Tiles that lie wholly at or before
the block's first query position are visible to every row and take a mask-free loop;
the remaining tiles (the causal diagonal and the sequence end) are masked. Scores go
through an online softmax in fp32, in base 2 with ``scale * log2(e)`` folded in.

Grid: ``(q-blocks, kv heads, splits)``. Sequence ``i``'s q-blocks are numbered from
``query_start_loc[i] // BLOCK_Q + i``, which never collides with sequence ``i - 1``'s;
a program finds its sequence by binary search over ``query_start_loc``. The grid
therefore depends only on ``T`` and ``B``, never on the lengths, and a few programs
find no work and return at once.

Split-K (flash decoding): when ``(q-block, kv head)`` programs are too few to fill the
GPU and contexts are long, the tiles of each q-block are divided among ``num_splits``
programs. Each writes its unnormalised partial output with its running max and sum to
fp32 scratch, and ``_merge_splits_kernel`` combines them per (token, head).

Output rows past ``query_start_loc[B]`` (padding tokens) are not written.

8-bit cache (``kernels/fp8_kv.py``, a constexpr branch ``QUANT``; the plain path compiles
as before; ``INT8`` picks the code type): K and V tiles are loaded as codes, e4m3 (``uint8``
bitcast to ``float8e4nv``) or int8, and widened in registers, exactly
(``triton_kv_write.widen_codes``), to fp16 for bf16 and fp16 queries (e4m3: one
conversion instruction a pair, where bf16 takes a detour through fp32; int8: by bits;
the query is converted to fp16 once) and to fp32 for fp32 ones. int8 codes are of rows
rotated by a Hadamard matrix (``kernels/kv_rotation.py``): ``paged_attention`` hands the
kernel rotated queries (``triton_hadamard.rotate_heads``, one launch) and the kernel
rotates its output back (at the merge when split). Each token's float32
scale is loaded beside them, from the scales after its slot's codes. The scales are applied outside the dots, where they are per-column factors:
a key's scale multiplies its column of ``q @ k`` (folded into ``qk_scale``), a value's
scale its column of ``p`` before ``p @ v``, divided by the tile's largest value scale so
that ``p`` stays in [0, 1] (fp16's range; the largest multiplies the tile's product).
Mathematically this is attention over the dequantized cache; the rounding differs from
dequantize-then-attend only in where the half-precision roundings fall (fp16's are finer
than bf16's: measured on an NVIDIA H200 against attention over the dequantized cache in
float32, mean error 3.4e-5 against 5.3e-5 with bf16 dots). Nothing dequantized is ever
written to memory.

8-bit loads are vectorised only as far as Triton can prove the codes aligned: a head's codes
start ``kv_head * HEAD_DIM`` (a constexpr) into its slot, Triton marks integer arguments
divisible by 16 as such, and ``SLOT_ALIGN`` tells it the slots' common power of two when
that is below 16 (it learns nothing from a stride of 264). Compiled for sm_90 (PTX, 8 kv
heads, head_dim 128): the key tiles load as 16-byte copies; the value tiles as 8-byte ones,
bounded by the swizzle of their shared-memory buffer (``vec = 8``), not by alignment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.fp8_kv import SCALE_BYTES, is_int8_cache, is_quantized_cache, stores_rotated_rows
from kernels.kv_rotation import rotation_scale
from kernels.triton_hadamard import hadamard_rows, log_block, rotate_heads
from kernels.triton_kv_write import fp8_scale_index, fp8_scale_view, widen_codes

LOG2_E = 1.4426950408889634

# NOTE: split-K aims for this many programs per multiprocessor, with at least
# MIN_TOKENS_PER_SPLIT context tokens each and at most MAX_SPLITS splits: the best
# counts measured on an NVIDIA H200 (docs/kernels.md): 32 splits for one 4k-128k
# decode, 16 for four 128k decodes.
SPLIT_TARGET_WAVES = 4
MIN_TOKENS_PER_SPLIT = 128
MAX_SPLITS = 32


@dataclass(frozen=True)
class AttentionConfig:
    """Tile shape and launch parameters of the paged attention kernel."""

    block_m: int  # query rows per program (tokens x heads of one GQA group)
    tile_n: int  # context tokens per inner-loop step
    num_warps: int
    num_stages: int


# NOTE: picked by measurement on an NVIDIA H200, bf16, head_dim 128 (docs/kernels.md).
DECODE_CONFIG = AttentionConfig(block_m=16, tile_n=64, num_warps=4, num_stages=2)
PREFILL_CONFIG = AttentionConfig(block_m=64, tile_n=64, num_warps=4, num_stages=2)
# NOTE: an 8-bit tile of 128 tokens is as many bytes as a bf16 one of 64. Measured on an
# NVIDIA H200 (BENCHMARKS.md, FP8 KV cache): against 64-token tiles, decode 1.15-1.55x
# faster (batch 64 at 8k: 800 -> 520 us), chunks 1.1-1.3x. int8 caches take the same.
FP8_DECODE_CONFIG = AttentionConfig(block_m=16, tile_n=128, num_warps=4, num_stages=2)
# NOTE: a large decode batch is many more programs than the GPU holds at once: two warps on
# 64-token tiles keep more of them resident. Measured on an NVIDIA H100 (BENCHMARKS.md, FP8
# KV cache): batch 256 over 576 to 4,096 tokens 1.07-1.25x faster (19 programs per
# multiprocessor); batch 64 (5 per multiprocessor) 0.68-0.90x, so only from 16. int8
# caches take it too (not measured apart).
FP8_MANY_DECODES_CONFIG = AttentionConfig(block_m=16, tile_n=64, num_warps=2, num_stages=2)
FP8_MANY_DECODES_PROGRAMS_PER_SM = 16
# NOTE: one stage: 8-bit tiles are widened in registers after their loads, and a second
# stage's buffers cost more than the overlap they buy. Measured on an NVIDIA H100
# (BENCHMARKS.md, FP8 KV cache): chunks of 20 to 2,000 tokens over 8k to 128k tokens and
# mixed batches 1.2-1.5x faster (a 20-token question on 128k: 396 -> 320 us).
FP8_PREFILL_CONFIG = AttentionConfig(block_m=64, tile_n=128, num_warps=4, num_stages=1)
# NOTE: fp32 dots run on FMA units, not tensor cores; small tiles keep them out of
# spills. fp32 serves as the test oracle's precision, not for speed.
FP32_CONFIG = AttentionConfig(block_m=16, tile_n=32, num_warps=4, num_stages=1)


def default_config(
    max_query_len: int,
    group: int,
    dtype: torch.dtype,
    quantized: bool = False,
    decode_programs_per_sm: float = 0.0,
) -> AttentionConfig:
    """Small tiles when every sequence fits a 16-row tile (decodes), big ones otherwise;
    over an 8-bit cache (fp8 or int8), twice the context tokens per step, except for
    decode batches of ``FP8_MANY_DECODES_PROGRAMS_PER_SM`` programs per multiprocessor."""
    if dtype == torch.float32:
        return FP32_CONFIG
    if max_query_len * group <= DECODE_CONFIG.block_m:
        if not quantized:
            return DECODE_CONFIG
        many = decode_programs_per_sm >= FP8_MANY_DECODES_PROGRAMS_PER_SM
        return FP8_MANY_DECODES_CONFIG if many else FP8_DECODE_CONFIG
    return FP8_PREFILL_CONFIG if quantized else PREFILL_CONFIG


def choose_num_splits(num_programs: int, max_seq_len: int, num_sms: int) -> int:
    """How many programs share one q-block's context (1 = no split-K).

    Splits only when ``num_programs`` (q-blocks times kv heads) is under
    ``SPLIT_TARGET_WAVES`` programs per multiprocessor (few programs leave SMs idle; a
    wave and a bit leaves the last wave mostly idle), and never below
    ``MIN_TOKENS_PER_SPLIT`` context tokens per split.
    """
    if num_programs >= SPLIT_TARGET_WAVES * num_sms:
        return 1
    wanted = -(-SPLIT_TARGET_WAVES * num_sms // num_programs)
    useful = max(1, max_seq_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, useful, MAX_SPLITS))


@triton.jit
def _find_seq(query_start_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """Index of the last sequence whose first q-block number is <= ``q_block``."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    kv_ptr,
    scale_ptr,
    table_ptr,
    tile,
    kv_end,
    kv_head,
    head_off,
    stride_kv_block,
    stride_kv_kind,
    stride_kv_slot,
    offs_d,
    d_valid,
    qk_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SLOT_ALIGN: tl.constexpr,
    TILE_N: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr,
    QUANT_HALF: tl.constexpr,
    INT8: tl.constexpr,
):
    """One online-softmax step of a q-block over context tokens ``[tile * TILE_N, +TILE_N)``."""
    offs_n = tile * TILE_N + tl.arange(0, TILE_N)
    n_valid = offs_n < kv_end
    if MASKED:
        blocks = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=n_valid, other=0)
    else:
        blocks = tl.load(table_ptr + offs_n // BLOCK_SIZE)
    # NOTE: int64 offsets: a whole cache can exceed 2**31 elements.
    slots = blocks.to(tl.int64) * stride_kv_block + (offs_n % BLOCK_SIZE) * stride_kv_slot
    slots = tl.multiple_of(slots, SLOT_ALIGN)  # NOTE: true: the wrapper's gcd of the strides
    kv_rows = slots + head_off
    if MASKED:
        k_mask = n_valid[None, :] & d_valid[:, None]
        v_mask = n_valid[:, None] & d_valid[None, :]
    else:
        k_mask = d_valid[:, None]
        v_mask = d_valid[None, :]
    k = tl.load(kv_ptr + kv_rows[None, :] + offs_d[:, None], mask=k_mask, other=0.0)  # [D, N]
    v = tl.load(
        kv_ptr + stride_kv_kind + kv_rows[:, None] + offs_d[None, :], mask=v_mask, other=0.0
    )

    if QUANT:
        k_scales = scale_ptr + fp8_scale_index(slots, kv_head, NUM_KV_HEADS, HEAD_DIM)
        v_scales = scale_ptr + fp8_scale_index(
            slots + stride_kv_kind, kv_head, NUM_KV_HEADS, HEAD_DIM
        )
        # NOTE: masked tokens get scale 0: their scores are masked and their p is 0 anyway.
        if MASKED:
            k_scale = tl.load(k_scales, mask=n_valid, other=0.0)
            v_scale = tl.load(v_scales, mask=n_valid, other=0.0)
        else:
            k_scale = tl.load(k_scales)
            v_scale = tl.load(v_scales)
        # NOTE: QUANT_HALF: q arrives in fp16; e4m3 and int8 codes widen to it exactly.
        # The value codes stay 8-bit until their dot.
        k = widen_codes(k, tl.float16 if QUANT_HALF else q.dtype, INT8)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION)
        qk = qk * (k_scale * qk_scale)[None, :]  # [M, N]
    else:
        qk = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale  # [M, N]
    if MASKED:
        visible = n_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # NOTE: a masked row may see no key in this tile (above the diagonal, or a padding
    # row): subtract 0 instead of -inf there so exp2 yields 0, not NaN; m_new stays -inf.
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new) if MASKED else m_new
    p = tl.exp2(qk - m_sub[:, None])
    alpha = tl.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    if QUANT_HALF:
        # NOTE: each value's scale over the tile's largest keeps p in [0, 1], where fp16 is
        # finer than bf16; the largest multiplies the tile's product (0 scales: masked).
        v_top = tl.maximum(tl.max(v_scale, 0), 1e-30)
        p = (p * (v_scale / v_top)[None, :]).to(tl.float16)
        # NOTE: v is not reassigned here: compiled, the code after this return is still
        # generated, and it must see the codes (a second widening of fp16 fails to build).
        v_half = widen_codes(v, tl.float16, INT8)
        pv = tl.dot(p, v_half, input_precision=DOT_PRECISION) * v_top
        return acc * alpha[:, None] + pv, m_new, l_i
    if QUANT:
        p = p * v_scale[None, :]
        v = widen_codes(v, q.dtype, INT8)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# NOTE: integers that change from step to step are not specialised (Triton would compile
# a variant per "== 1" / "divisible by 16" case, each about a second, mid-serving).
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "stride_table"])
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    kv_ptr,
    scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    qk_scale,
    num_seqs,
    num_splits,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_kv_block,
    stride_kv_kind,
    stride_kv_slot,
    stride_kv_head,
    stride_table,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SLOT_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr,
    QUANT_HALF: tl.constexpr,
    INT8: tl.constexpr,
    LOG_BLOCK: tl.constexpr,
    ROTATION_SCALE: tl.constexpr,
):
    """Attention of one q-block and one kv head over (one split of) its paged context."""
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq(query_start_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = offs_d < HEAD_DIM
    q_tok = q_block_local * BLOCK_Q + offs_m // GROUP  # token index within the sequence
    head = kv_head * GROUP + offs_m % GROUP
    row_valid = (offs_m < BLOCK_Q * GROUP) & (q_tok < query_len)
    q_pos = context_len + q_tok  # bottom-right aligned causal position
    rows = (q_start + q_tok).to(tl.int64)

    q = tl.load(
        q_ptr + rows[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if QUANT_HALF:
        # NOTE: exact for magnitudes in fp16's normal range (6.1e-5 to 65,504): queries stay
        # far below its top, and an element below its bottom weighs nothing in the dot.
        q = q.to(tl.float16)

    first_pos = context_len + q_block_local * BLOCK_Q
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    full_tiles = (first_pos + 1) // TILE_N  # tiles every row of the block sees in full
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table
    # NOTE: an 8-bit slot holds its heads' codes first, head after head (fp8_kv.py).
    head_off = kv_head * HEAD_DIM if QUANT else kv_head * stride_kv_head
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    for tile in range(tile_begin, tl.minimum(tile_end, full_tiles)):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_pos, kv_ptr, scale_ptr, table_ptr, tile, kv_end, kv_head,
            head_off, stride_kv_block, stride_kv_kind, stride_kv_slot, offs_d, d_valid,
            qk_scale, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, SLOT_ALIGN, TILE_N, False,
            DOT_PRECISION, QUANT, QUANT_HALF, INT8,
        )  # fmt: skip
    for tile in range(tl.maximum(tile_begin, full_tiles), tile_end):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_pos, kv_ptr, scale_ptr, table_ptr, tile, kv_end, kv_head,
            head_off, stride_kv_block, stride_kv_kind, stride_kv_slot, offs_d, d_valid,
            qk_scale, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, SLOT_ALIGN, TILE_N, True,
            DOT_PRECISION, QUANT, QUANT_HALF, INT8,
        )  # fmt: skip

    if SPLIT:
        # NOTE: every split stores, even an empty one (max -inf, sum 0), so the merge
        # never reads unwritten scratch for a real token.
        part = (rows * NUM_HEADS + head) * num_splits + split
        tl.store(part_max_ptr + part, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part, l_i, mask=row_valid)
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
            acc,
            mask=row_valid[:, None] & d_valid[None, :],
        )
    else:
        out = acc / l_i[:, None]
        if INT8:  # sum(p v H) H = sum(p v): back from H's basis (split partials: at the merge)
            out = hadamard_rows(out, BLOCK_M, HEAD_DIM_PAD, LOG_BLOCK) * ROTATION_SCALE
        tl.store(
            out_ptr
            + rows[:, None] * stride_o_tok
            + head[:, None] * stride_o_head
            + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & d_valid[None, :],
        )


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    num_splits,
    stride_o_tok,
    stride_o_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    INT8: tl.constexpr,
    LOG_BLOCK: tl.constexpr,
    ROTATION_SCALE: tl.constexpr,
):
    """Combine the split-K partials of one (token, head): rescale each to the global max."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_valid = offs_s < num_splits
    d_valid = offs_d < HEAD_DIM
    part = (tok * NUM_HEADS + head) * num_splits + offs_s
    maxes = tl.load(part_max_ptr + part, mask=s_valid, other=float("-inf"))
    sums = tl.load(part_sum_ptr + part, mask=s_valid, other=0.0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    weight = tl.exp2(maxes - tl.max(maxes, 0))  # empty splits: exp2(-inf) = 0
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(sums * weight, 0)
    if INT8:  # the partials are sums in H's basis (see the attention kernel)
        row = hadamard_rows(tl.reshape(out, (1, HEAD_DIM_PAD)), 1, HEAD_DIM_PAD, LOG_BLOCK)
        out = tl.reshape(row, (HEAD_DIM_PAD,)) * ROTATION_SCALE
    tl.store(
        out_ptr + tok * stride_o_tok + head * stride_o_head + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_valid,
    )


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # NOTE: the CPU interpreter: small, so tests exercise split-K too


def _q_blocks(
    config: AttentionConfig, group: int, num_tokens: int, num_seqs: int
) -> tuple[int, int]:
    """Rows per q-block (a whole GQA group at least) and the grid's q-block count."""
    block_m = max(config.block_m, triton.next_power_of_2(group))
    return block_m, num_tokens // (block_m // group) + num_seqs


def paged_attention(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    num_splits: int | None = None,
    config: AttentionConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every new token over its sequence's paged context, in one launch.

    ``query`` is ``[T, num_heads, head_dim]`` (any token and head strides, unit stride on
    the last dim); ``kv_layer`` is ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``
    with any strides but a unit last one (a layer view of the engine's cache), or an 8-bit
    layer, ``uint8`` (e4m3) or ``int8`` with a last dim of ``head_dim + 4``
    (``kernels/fp8_kv.py``). The other
    tensors are those of ``AttentionMetadata``; ``max_query_len`` and ``max_seq_len``
    only pick tile shapes and the split count. ``num_splits`` forces the split-K degree.
    Returns ``out`` (allocated when None), ``[T, num_heads, head_dim]`` in ``query.dtype``.

    Results are exact for any lengths whatever the split count; only speed depends on
    it. A CUDA graph freezes the count chosen at capture, so capture decode graphs with
    ``max_seq_len`` set to the longest context they will serve.
    """
    num_tokens, num_heads, head_dim = query.shape
    if kv_layer.dim() != 5 or kv_layer.shape[1] != 2:
        raise ValueError(
            f"kv_layer must be [num_blocks, 2, block_size, kv_heads, head_dim], got {tuple(kv_layer.shape)}"
        )
    _, _, block_size, num_kv_heads, row_width = kv_layer.shape
    quantized = is_quantized_cache(kv_layer)
    kv_head_dim = row_width - SCALE_BYTES if quantized else row_width
    if kv_head_dim != head_dim:
        raise ValueError(f"query head_dim {head_dim} != kv cache head_dim {kv_head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if query.stride(-1) != 1 or kv_layer.stride(-1) != 1:
        raise ValueError("query and kv_layer need a unit stride on head_dim")
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if stores_rotated_rows(kv_layer):
        # NOTE: int8 rows are stored times H (kernels/kv_rotation.py): (q H) . (k H) = q . k,
        # so the kernel reads q H (in fp16, as it would convert q) and unrotates its output.
        query = rotate_heads(
            query, torch.float32 if query.dtype == torch.float32 else torch.float16
        )
    num_seqs = seq_lens.numel()
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    num_sms = _num_sms(query.device)
    if config is None:
        # NOTE: the decode configs share block_m, so a decode's program count is known first
        decode_programs = _q_blocks(DECODE_CONFIG, group, num_tokens, num_seqs)[1] * num_kv_heads
        config = default_config(
            max_query_len, group, query.dtype, quantized, decode_programs / num_sms
        )
    block_m, num_q_blocks = _q_blocks(config, group, num_tokens, num_seqs)
    block_q = block_m // group
    if num_splits is None:
        num_splits = choose_num_splits(num_q_blocks * num_kv_heads, max_seq_len, num_sms)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    split = num_splits > 1
    if split:
        part_acc = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        part_max = torch.empty(
            (num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused

    _paged_attention_kernel[(num_q_blocks, num_kv_heads, num_splits)](
        out, query, kv_layer, fp8_scale_view(kv_layer) if quantized else kv_layer, block_tables,
        seq_lens, query_start_loc,
        part_acc, part_max, part_sum,
        scale * LOG2_E, num_seqs, num_splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        block_tables.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, SLOT_ALIGN=math.gcd(16, kv_layer.stride(0), kv_layer.stride(2)),
        BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=config.tile_n,
        SPLIT=split,
        # NOTE: fp32 inputs get exact fp32 dots (the test oracle); tf32 would cost ~1e-3.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", QUANT=quantized,
        QUANT_HALF=quantized and query.dtype != torch.float32, INT8=is_int8_cache(kv_layer),
        LOG_BLOCK=log_block(head_dim), ROTATION_SCALE=rotation_scale(head_dim),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if split:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, part_acc, part_max, part_sum, num_splits, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)), INT8=is_int8_cache(kv_layer),
            LOG_BLOCK=log_block(head_dim), ROTATION_SCALE=rotation_scale(head_dim), num_warps=4,
        )  # fmt: skip
    return out
