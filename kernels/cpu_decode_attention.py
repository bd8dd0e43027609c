"""bfloat16 decode attention on the CPU as two oneDNN matrix products per sequence.

For one new token per sequence, SDPA's CPU flash kernel is slow in bf16: it has only
``kv_heads`` work items of ``group`` query rows each (3 of 3 rows for SmolLM2, on 2 threads)
and its small per-block products are compute-bound. Here each sequence instead runs

    scores = linear(block-diagonal scale * queries, K)   [kv_heads * group, seq_len]
    probs  = softmax(scores) in float32, cast back to bf16
    mixed  = probs @ V                                   [kv_heads * group, kv_heads * head_dim]

over its gathered K/V (token-major ``[seq_len, kv_heads * head_dim]``, see
``cpu_paged_attention.gather_context``), and keeps the diagonal ``[kv_head, kv_head]`` blocks
of ``mixed``. The block-diagonal query (query rows of kv head ``h`` hold their values in
columns of head ``h`` and zeros elsewhere) turns all heads into one product whose "weight"
is the plain gathered K: oneDNN's skinny-batch inner product, the same code path as a
decode linear layer. It does ``kv_heads`` times the useful multiply-adds but reads K once,
in one call spread over all threads.

When it wins (per layer, bf16, 30-layer cache so K/V come from memory, 2 EPYC cores, us):

| kv heads x group x head_dim, context, sequences | SDPA | products |
| --- | ---: | ---: |
| 3 x 3 x 64 (SmolLM2), 4,116, 1 | 648 | 500 |
| 3 x 3 x 64, 4,116, 4 | 2053 | 1717 |
| 3 x 3 x 64, 2,048, 1 | 348 | 327 |
| 3 x 3 x 64, 1,024, 1 | 196 | 230 |
| 3 x 3 x 64, 1,024, 8 | 858 | 2516 |
| 8 x 4 x 128 (Llama 3 8B), 2,048, 1 | 3919 | 3270 |

Each oneDNN call costs ~20 us however small, and one batched SDPA call spreads many
sequences over the threads well, so short contexts stay on SDPA.

Numerics: scores come out of the product in bf16 (as transformers' eager bf16 attention
computes them), the softmax runs in float32, probabilities are rounded to bf16 before the
value product (as SDPA's bf16 kernel does), and both products accumulate in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_paged_attention import (
    ContextPlan,
    GatherWorkspace,
    attend,
    gather_context,
    plan_decode,
)

# NOTE: measured crossover (table above): below ~2k keys the fixed cost of the per-sequence
# products loses to one batched SDPA call.
MIN_CONTEXT_FOR_PRODUCTS = 2048
# NOTE: the block-diagonal query multiplies by kv_heads times the useful work; measured a
# win up to 8 kv heads, beyond that the arithmetic, not reading K, would bound the scores.
MAX_KV_HEADS_FOR_PRODUCTS = 8


def use_products(query: torch.Tensor, plan: ContextPlan) -> bool:
    """Whether :func:`decode_attention_by_products` is the faster choice for this decode."""
    return (
        query.device.type == "cpu"
        and query.dtype == torch.bfloat16
        and query.shape[1] <= MAX_KV_HEADS_FOR_PRODUCTS
        and plan.context_len >= MIN_CONTEXT_FOR_PRODUCTS
    )


def block_diagonal_queries(query: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``[n, kv_heads, group, dim]`` -> ``[n, kv_heads * group, kv_heads * dim]``, zeros off the diagonal.

    The values are ``query * scale`` (multiplied in float32, rounded once to the query dtype).
    """
    n, kv_heads, group, dim = query.shape
    spread = query.new_zeros(n, kv_heads, group, kv_heads, dim)
    # diagonal(dim1=1, dim2=3) views [n, group, dim, kv_heads]: head h's rows in head h's columns.
    spread.diagonal(0, 1, 3).copy_((query.float() * scale).permute(0, 2, 3, 1))
    return spread.view(n, kv_heads * group, kv_heads * dim)


def decode_attention_by_products(
    query: torch.Tensor,  # [n, kv_heads, group, dim]: one token's query heads per sequence
    kv_layer: torch.Tensor,
    plan: ContextPlan,
    scale: float,
    workspace: GatherWorkspace,
) -> torch.Tensor:
    """Each sequence's query over its ``plan.seq_lens[i]`` keys: ``[n, kv_heads, group, dim]``.

    ``plan`` comes from ``plan_decode``; its padding and mask are not needed here, since every
    sequence is computed over exactly its own blocks.
    """
    _, kv_heads, group, dim = query.shape
    block_size = kv_layer.shape[2]
    width = kv_heads * dim
    # NOTE: the scale goes into the queries (one rounding, exact for power-of-two scales such
    # as 64**-0.5): the scores then need no pass of their own before the softmax.
    spread = block_diagonal_queries(query, scale)
    output = torch.empty_like(query)
    for seq, seq_len in enumerate(plan.seq_lens):
        first = seq * plan.blocks_per_seq
        blocks = plan.blocks[first : first + -(-seq_len // block_size)]
        key, value = gather_context(kv_layer, blocks, workspace)
        key = key[:seq_len].view(seq_len, width)
        value = value[:seq_len].view(seq_len, width)
        scores = F.linear(spread[seq], key.to(query.dtype))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        mixed = torch.mm(probs, value.to(query.dtype)).view(kv_heads, group, kv_heads, dim)
        # diagonal(dim1=0, dim2=2) views [group, dim, kv_heads].
        output[seq] = mixed.diagonal(0, 0, 2).permute(2, 0, 1)
    return output


def attend_decode(
    query: torch.Tensor,  # [n, kv_heads, group, dim]
    kv_layer: torch.Tensor,
    plan: ContextPlan,
    scale: float,
    workspace: GatherWorkspace,
) -> torch.Tensor:
    """Decode attention by products where :func:`use_products` says so, else one SDPA call."""
    if use_products(query, plan):
        return decode_attention_by_products(query, kv_layer, plan, scale, workspace)
    return attend(query, kv_layer, plan, scale, workspace)


def decode_attention(
    query: torch.Tensor,  # [n, heads, dim]: one new token per sequence
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,  # [n, >= max blocks] int
    seq_lens: list[int],
    scale: float,
    workspace: GatherWorkspace,
    plan: ContextPlan | None = None,
) -> torch.Tensor:
    """Each sequence's single query over its whole context. ``[n, heads, dim]``.

    ``plan`` (from ``plan_decode``) saves re-planning when many layers share one step.
    """
    if plan is None:
        plan = plan_decode(block_tables, seq_lens, kv_layer.shape[2], query.dtype)
    return attend_decode_heads(query, kv_layer, plan, scale, workspace)


def attend_decode_heads(
    query: torch.Tensor,  # [n, heads, dim]: one new token per sequence
    kv_layer: torch.Tensor,
    plan: ContextPlan,
    scale: float,
    workspace: GatherWorkspace,
) -> torch.Tensor:
    """:func:`attend_decode` of ``[n, heads, dim]`` queries planned by ``plan_decode``."""
    n, heads, dim = query.shape
    kv_heads = kv_layer.shape[3]
    # NOTE: one query token per sequence: a kv head's query heads are its "query rows".
    grouped = query.view(n, kv_heads, heads // kv_heads, dim)
    return attend_decode(grouped, kv_layer, plan, scale, workspace).reshape(n, heads, dim)
