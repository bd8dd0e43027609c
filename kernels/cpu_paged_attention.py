"""Paged attention in pure torch, shaped for CPUs: one gather per layer into a reused buffer.

A layer's KV cache is ``[num_blocks, 2, block_size, kv_heads, head_dim]`` (see
``kernels/interface.py``). Every call copies the sequence's blocks into a workspace that stays
allocated across layers and steps (one ``index_select`` for K and V together), then runs
the fused CPU flash-attention kernel (SDPA) over strided per-head views of that copy. bf16
decodes over long contexts take ``kernels/cpu_decode_attention.py`` instead.

NOTE: the workspace is the point. Advanced indexing (``kv[:, 0][table]``) into a fresh tensor
page-faults a new multi-MB allocation on every layer of every step and ran at ~3 GB/s on two
EPYC cores; ``index_select(out=...)`` into memory that stays mapped runs near copy speed.
Attending over block-strided views with no copy at all (batched matmuls per block, or SDPA
per block merged by log-sum-exp) was slower still: 16-token blocks make the matmuls tiny.

GQA without copies: the ``group`` query heads of kv head ``h`` become extra query rows of
that head, so K/V are never repeated. In prefill the rows are ``[kv_heads, tokens * group,
head_dim]`` (row ``t * group + g``); SDPA's CPU kernel needs 4-D inputs of equal head counts
to take its fused path (3-D inputs or ``enable_gqa`` fall back to a path that materialises
every score).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


class GatherWorkspace:
    """A grow-only scratch buffer per (dtype, device), reused by every layer and step.

    A view handed out is valid until the next ``take``: callers consume it before asking again.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def take(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        numel = 1
        for size in shape:
            numel *= size
        key = (dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            # NOTE: 25% headroom so a context growing by one block does not reallocate each step.
            buffer = torch.empty(numel + numel // 4, dtype=dtype, device=device)
            self._buffers[key] = buffer
        return buffer[:numel].view(shape)


def gather_context(
    kv_layer: torch.Tensor, blocks: torch.Tensor, workspace: GatherWorkspace
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``blocks`` (int64 ids), each ``[len(blocks) * block_size, kv_heads, head_dim]``.

    Both are views of one workspace buffer: valid until the workspace's next ``take``.
    """
    _, _, block_size, kv_heads, head_dim = kv_layer.shape
    num = blocks.numel()
    both = workspace.take((2, num, block_size, kv_heads, head_dim), kv_layer.dtype, kv_layer.device)
    # NOTE: token-major copies of whole [block_size, kv_heads, head_dim] slabs; a head-major
    # destination (index_select over a permuted view) measured 10x slower. On the CPU one
    # copy of each block's adjacent K and V slabs into the two planes (a strided ``out``)
    # beats one copy per plane: 153 vs 213 us per layer at 4k bf16 tokens on 2 EPYC cores.
    if kv_layer.device.type == "cpu":
        torch.index_select(kv_layer, 0, blocks, out=both.transpose(0, 1))
    else:
        torch.index_select(kv_layer[:, 0], 0, blocks, out=both[0])
        torch.index_select(kv_layer[:, 1], 0, blocks, out=both[1])
    flat = both.view(2, num * block_size, kv_heads, head_dim)
    return flat[0], flat[1]


def group_queries(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[tokens, heads, dim]`` -> ``[kv_heads, tokens * group, dim]`` (row ``t * group + g``)."""
    tokens, heads, dim = query.shape
    group = heads // kv_heads
    return (
        query.view(tokens, kv_heads, group, dim)
        .transpose(0, 1)
        .reshape(kv_heads, tokens * group, dim)
    )


def ungroup_output(out: torch.Tensor, tokens: int) -> torch.Tensor:
    """Inverse of :func:`group_queries`: ``[kv_heads, tokens * group, dim]`` -> ``[tokens, heads, dim]``."""
    kv_heads, rows, dim = out.shape
    group = rows // tokens
    return (
        out.view(kv_heads, tokens, group, dim)
        .transpose(0, 1)
        .reshape(tokens, kv_heads * group, dim)
    )


@dataclass(frozen=True)
class ContextPlan:
    """What one attention call reads, computed once per step and reused by every layer.

    ``blocks`` lists ``num_seqs`` block tables of ``blocks_per_seq`` ids each (int64, padded
    rows included); ``mask`` is None when no key needs hiding. ``seq_lens[i]`` is the number
    of keys sequence ``i`` attends (all of them for a decode, up to the last query's position).
    """

    blocks: torch.Tensor
    num_seqs: int
    blocks_per_seq: int
    context_len: int  # keys attended: the longest sequence's length
    mask: torch.Tensor | None  # additive, broadcastable to SDPA's [n, kv_heads, rows, context_len]
    seq_lens: tuple[int, ...]


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where attending is allowed, -inf elsewhere.

    NOTE: SDPA converts a boolean mask like this on every call; planned once, the 30 layers of
    a step share one conversion.
    """
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf")
    )


def plan_prefill(
    block_table: torch.Tensor,
    seq_len: int,
    query_len: int,
    group: int,
    block_size: int,
    dtype: torch.dtype,
) -> ContextPlan:
    """One sequence's last ``query_len`` tokens over its ``seq_len`` context (grouped rows).

    ``dtype`` is the query's: the mask is additive, in that dtype.
    """
    num_blocks = -(-seq_len // block_size)
    device = block_table.device
    # Row t * group + g is query token t, at position seq_len - query_len + t.
    query_pos = torch.arange(seq_len - query_len, seq_len, device=device).repeat_interleave(group)
    mask = _additive(torch.arange(seq_len, device=device)[None, :] <= query_pos[:, None], dtype)
    return ContextPlan(block_table[:num_blocks].long(), 1, num_blocks, seq_len, mask, (seq_len,))


def plan_decode(
    block_tables: torch.Tensor, seq_lens: list[int], block_size: int, dtype: torch.dtype
) -> ContextPlan:
    """One query per sequence over its whole context; all sequences padded to the longest."""
    max_len = max(seq_lens)
    num_blocks = -(-max_len // block_size)
    mask = None
    if min(seq_lens) != max_len:
        device = block_tables.device
        lens = torch.tensor(seq_lens, device=device)
        allowed = torch.arange(max_len, device=device)[None, :] < lens[:, None]
        mask = _additive(allowed, dtype)[:, None, None, :]
    blocks = block_tables[:, :num_blocks].reshape(-1).long()
    return ContextPlan(blocks, len(seq_lens), num_blocks, max_len, mask, tuple(seq_lens))


def attend(
    query: torch.Tensor,  # [n, kv_heads, rows, dim]: grouped query rows per sequence
    kv_layer: torch.Tensor,
    plan: ContextPlan,
    scale: float,
    workspace: GatherWorkspace,
) -> torch.Tensor:
    """SDPA of the grouped queries over the planned context: ``[n, kv_heads, rows, dim]``."""
    key, value = gather_context(kv_layer, plan.blocks, workspace)
    n, kv_heads, _, dim = query.shape
    span = plan.blocks_per_seq * kv_layer.shape[2]
    # [n, kv_heads, context_len, dim]: strided views of the gathered copy.
    key = key.view(n, span, kv_heads, dim)[:, : plan.context_len].transpose(1, 2)
    value = value.view(n, span, kv_heads, dim)[:, : plan.context_len].transpose(1, 2)
    return F.scaled_dot_product_attention(
        query, key.to(query.dtype), value.to(query.dtype), attn_mask=plan.mask, scale=scale
    )


def prefill_attention(
    query: torch.Tensor,  # [q, heads, dim]: the last q of seq_len context tokens
    kv_layer: torch.Tensor,
    block_table: torch.Tensor,  # [>= ceil(seq_len / block_size)] int
    seq_len: int,
    scale: float,
    workspace: GatherWorkspace,
    plan: ContextPlan | None = None,
) -> torch.Tensor:
    """Causal within the new tokens, full over the cached context before them. ``[q, heads, dim]``.

    ``plan`` (from :func:`plan_prefill`) saves re-planning when many layers share one step.
    """
    query_len, heads, _ = query.shape
    block_size, kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    if plan is None:
        plan = plan_prefill(
            block_table, seq_len, query_len, heads // kv_heads, block_size, query.dtype
        )
    out = attend(group_queries(query, kv_heads)[None], kv_layer, plan, scale, workspace)
    return ungroup_output(out[0], query_len)


def causal_self_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of a chunk with nothing cached before it, over its own new K/V."""
    q = query.transpose(0, 1)  # [H, q, D]
    group = q.shape[0] // key.shape[1]
    # NOTE: 4-D inputs and expanded K/V (not enable_gqa): anything else sends SDPA to its
    # unfused math path on the CPU, which materialises every score (6x slower at 4k).
    k = key.transpose(0, 1).to(q.dtype).repeat_interleave(group, dim=0)
    v = value.transpose(0, 1).to(q.dtype).repeat_interleave(group, dim=0)
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale)
    return out[0].transpose(0, 1)


def _flash(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's fused CPU flash kernel: ``([1, H, q, D] output, [1, H, q] float32 log-sum-exp)``."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, causal, scale=scale
    )
    return out, lse


def prefill_attention_split(
    query: torch.Tensor,  # [q, heads, dim]: the last q of context_len + q tokens
    key: torch.Tensor,  # [q, kv_heads, dim]: the chunk's own keys (also stored in the cache)
    value: torch.Tensor,
    kv_layer: torch.Tensor,
    block_table: torch.Tensor,  # [>= ceil(context_len / block_size)] int
    context_len: int,
    scale: float,
    workspace: GatherWorkspace,
) -> torch.Tensor:
    """A prefill chunk over cached context as two fused calls merged by log-sum-exp: ``[q, heads, dim]``.

    Causal over the chunk's own K/V (in hand, no copy), full over the ``context_len`` cached
    tokens before it (gathered into the workspace). No mask is built and the causal half
    skips the masked-out blocks, where one masked call over everything would compute them.
    """
    tokens, heads, _ = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    own_q = query.transpose(0, 1)[None]
    own_k = key.transpose(0, 1).to(query.dtype).repeat_interleave(group, dim=0)[None]
    own_v = value.transpose(0, 1).to(query.dtype).repeat_interleave(group, dim=0)[None]
    own, own_lse = _flash(own_q, own_k, own_v, True, scale)
    own = own[0].transpose(0, 1).float()  # [q, H, D]
    own_lse = own_lse[0].transpose(0, 1)  # [q, H]

    num_blocks = -(-context_len // kv_layer.shape[2])
    ctx_k, ctx_v = gather_context(kv_layer, block_table[:num_blocks].long(), workspace)
    ctx_k = ctx_k[:context_len].transpose(0, 1)[None].to(query.dtype)
    ctx_v = ctx_v[:context_len].transpose(0, 1)[None].to(query.dtype)
    ctx, ctx_lse = _flash(group_queries(query, kv_heads)[None], ctx_k, ctx_v, False, scale)
    ctx = ungroup_output(ctx[0], tokens).float()
    ctx_lse = ctx_lse[0].view(kv_heads, tokens, group).transpose(0, 1).reshape(tokens, heads)

    total = torch.logaddexp(own_lse, ctx_lse)
    merged = own * (own_lse - total).exp()[..., None] + ctx * (ctx_lse - total).exp()[..., None]
    return merged.to(query.dtype)
