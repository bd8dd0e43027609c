"""The CPU paged attention against a plain dense attention built token by token from the cache."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.cpu_decode_attention import (
    MIN_CONTEXT_FOR_PRODUCTS,
    block_diagonal_queries,
    decode_attention,
    decode_attention_by_products,
    use_products,
)
from kernels.cpu_paged_attention import GatherWorkspace, plan_decode, prefill_attention
from kernels.interface import AttentionMetadata
from kernels.reference import ReferenceBackend

BLOCK_SIZE = 4
NUM_BLOCKS = 40
NUM_LAYERS = 2
LAYER = 1
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def make_cache(
    kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int, num_blocks: int = NUM_BLOCKS
) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = (num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, kv_heads, head_dim)
    return torch.randn(shape, generator=generator).to(dtype)


def make_table(num_blocks: int, layout: str, seed: int, pool: int = NUM_BLOCKS) -> torch.Tensor:
    """``contiguous``: consecutive ids from 3; ``fragmented``: distinct ids of ``pool`` in random order."""
    if layout == "contiguous":
        return torch.arange(3, 3 + num_blocks, dtype=torch.int32)
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(pool, generator=generator)[:num_blocks].to(torch.int32)


def dense_attention(
    query: torch.Tensor, kv_layer: torch.Tensor, table: torch.Tensor, seq_len: int, scale: float
) -> torch.Tensor:
    """float64 softmax attention of ``query`` (the last tokens) over the context, read slot by slot."""
    query_len, heads, _ = query.shape
    kv_heads = kv_layer.shape[3]
    keys = torch.stack(
        [kv_layer[int(table[t // BLOCK_SIZE]), 0, t % BLOCK_SIZE] for t in range(seq_len)]
    ).double()
    values = torch.stack(
        [kv_layer[int(table[t // BLOCK_SIZE]), 1, t % BLOCK_SIZE] for t in range(seq_len)]
    ).double()
    out = torch.empty(query.shape, dtype=torch.float64)
    for t in range(query_len):
        position = seq_len - query_len + t
        for head in range(heads):
            kv_head = head // (heads // kv_heads)
            scores = keys[: position + 1, kv_head] @ query[t, head].double() * scale
            out[t, head] = torch.softmax(scores, dim=0) @ values[: position + 1, kv_head]
    return out


def assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    error = (out.double() - expected).abs().max().item()
    assert error < TOLERANCE[dtype], f"max abs error {error:.2e} (tolerance {TOLERANCE[dtype]:.0e})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "fragmented"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (4, 4), (9, 3)])
def test_decode_matches_dense(dtype: torch.dtype, layout: str, heads: int, kv_heads: int) -> None:
    head_dim = 16
    cache = make_cache(kv_heads, head_dim, dtype, seed=1)
    seq_lens = [13, 1, 29, 16]  # a partial last block, one token, several blocks, exactly full
    tables = torch.zeros(len(seq_lens), 8, dtype=torch.int32)  # rows padded with block 0
    for row, seq_len in enumerate(seq_lens):
        num = math.ceil(seq_len / BLOCK_SIZE)
        tables[row, :num] = make_table(num, layout, seed=10 + row)
    query = torch.randn(len(seq_lens), heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    out = decode_attention(query, cache[:, LAYER], tables, seq_lens, scale, GatherWorkspace())
    assert out.shape == query.shape and out.dtype == dtype
    for row, seq_len in enumerate(seq_lens):
        expected = dense_attention(
            query[row : row + 1], cache[:, LAYER], tables[row], seq_len, scale
        )
        assert_close(out[row : row + 1], expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "fragmented"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (4, 4), (9, 3)])
def test_decode_by_products_matches_dense(
    dtype: torch.dtype, layout: str, heads: int, kv_heads: int
) -> None:
    """The product formulation on its own, at sizes where the dispatcher would not pick it."""
    head_dim = 16
    cache = make_cache(kv_heads, head_dim, dtype, seed=11)
    seq_lens = [13, 1, 29, 16]
    tables = torch.zeros(len(seq_lens), 8, dtype=torch.int32)  # rows padded with block 0
    for row, seq_len in enumerate(seq_lens):
        num = math.ceil(seq_len / BLOCK_SIZE)
        tables[row, :num] = make_table(num, layout, seed=20 + row)
    query = torch.randn(len(seq_lens), heads, head_dim).to(dtype)
    grouped = query.view(len(seq_lens), kv_heads, heads // kv_heads, head_dim)
    plan = plan_decode(tables, seq_lens, BLOCK_SIZE, dtype)
    scale = head_dim**-0.5
    out = decode_attention_by_products(grouped, cache[:, LAYER], plan, scale, GatherWorkspace())
    assert out.shape == grouped.shape and out.dtype == dtype
    out = out.reshape(query.shape)
    for row, seq_len in enumerate(seq_lens):
        expected = dense_attention(
            query[row : row + 1], cache[:, LAYER], tables[row], seq_len, scale
        )
        assert_close(out[row : row + 1], expected, dtype)


def test_block_diagonal_queries_place_each_head_in_its_columns() -> None:
    query = torch.randn(2, 3, 2, 4)  # [n, kv_heads, group, dim]
    spread = block_diagonal_queries(query).view(2, 3, 2, 3, 4)
    for head in range(3):
        for other in range(3):
            expected = query[:, head] if head == other else torch.zeros(2, 2, 4)
            assert torch.equal(spread[:, head, :, other], expected)


def test_long_bf16_decode_dispatches_to_products_and_matches_dense() -> None:
    """A bf16 decode over a long context takes the products; short or float32 ones do not."""
    heads, kv_heads, head_dim = 9, 3, 16
    pool = 540
    cache = make_cache(kv_heads, head_dim, torch.bfloat16, seed=12, num_blocks=pool)
    seq_lens = [2100, MIN_CONTEXT_FOR_PRODUCTS + 1]
    tables = torch.zeros(2, pool, dtype=torch.int32)
    for row, seq_len in enumerate(seq_lens):
        num = math.ceil(seq_len / BLOCK_SIZE)
        tables[row, :num] = make_table(num, "fragmented", seed=30 + row, pool=pool)
    query = torch.randn(2, heads, head_dim).to(torch.bfloat16)
    grouped = query.view(2, kv_heads, heads // kv_heads, head_dim)
    plan = plan_decode(tables, seq_lens, BLOCK_SIZE, torch.bfloat16)
    assert use_products(grouped, plan)
    assert not use_products(grouped.float(), plan)
    assert not use_products(grouped, plan_decode(tables, [20, 9], BLOCK_SIZE, torch.bfloat16))
    scale = head_dim**-0.5
    out = decode_attention(query, cache[:, LAYER], tables, seq_lens, scale, GatherWorkspace())
    for row, seq_len in enumerate(seq_lens):
        expected = dense_attention(
            query[row : row + 1], cache[:, LAYER], tables[row], seq_len, scale
        )
        assert_close(out[row : row + 1], expected, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "fragmented"])
@pytest.mark.parametrize(("query_len", "seq_len"), [(5, 23), (3, 3), (8, 9), (1, 17)])
def test_prefill_over_cached_context_matches_dense(
    dtype: torch.dtype, layout: str, query_len: int, seq_len: int
) -> None:
    heads, kv_heads, head_dim = 6, 2, 16
    cache = make_cache(kv_heads, head_dim, dtype, seed=2)
    table = make_table(math.ceil(seq_len / BLOCK_SIZE), layout, seed=3)
    query = torch.randn(query_len, heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    out = prefill_attention(query, cache[:, LAYER], table, seq_len, scale, GatherWorkspace())
    assert out.shape == query.shape
    assert_close(out, dense_attention(query, cache[:, LAYER], table, seq_len, scale), dtype)


def test_workspace_reuse_across_calls_of_different_sizes() -> None:
    """One workspace serves a long, a short, then a longer context: each result is still exact."""
    heads, kv_heads, head_dim = 4, 2, 8
    cache = make_cache(kv_heads, head_dim, torch.float32, seed=4)
    workspace = GatherWorkspace()
    scale = head_dim**-0.5
    for seq_len in (30, 5, 70, 30):
        table = make_table(math.ceil(seq_len / BLOCK_SIZE), "fragmented", seed=seq_len)
        query = torch.randn(1, heads, head_dim)
        out = decode_attention(query, cache[:, LAYER], table[None], [seq_len], scale, workspace)
        assert_close(
            out, dense_attention(query, cache[:, LAYER], table, seq_len, scale), torch.float32
        )


def test_workspace_grows_and_keeps_its_buffer() -> None:
    workspace = GatherWorkspace()
    first = workspace.take((4, 8), torch.float32, torch.device("cpu"))
    smaller = workspace.take((2, 8), torch.float32, torch.device("cpu"))
    assert smaller.data_ptr() == first.data_ptr(), "a smaller request reuses the buffer"
    larger = workspace.take((64, 8), torch.float32, torch.device("cpu"))
    assert larger.shape == (64, 8)
    other = workspace.take((2, 8), torch.bfloat16, torch.device("cpu"))
    assert other.dtype == torch.bfloat16 and larger.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_mixed_batch_writes_kv_and_attends(dtype: torch.dtype) -> None:
    """Prefill chunks (with and without cached context) and decodes in one forward pass."""
    heads, kv_heads, head_dim = 6, 2, 16
    cache = make_cache(kv_heads, head_dim, dtype, seed=5)
    kv_layer = cache[:, LAYER]
    # (tokens already cached, new tokens) per sequence
    seqs = [(0, 7), (12, 1), (9, 6), (21, 1), (0, 1)]
    tables = torch.zeros(len(seqs), 8, dtype=torch.int32)
    free = iter(torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(6)).tolist())
    slots: list[int] = []
    for row, (cached, new) in enumerate(seqs):
        for block in range(math.ceil((cached + new) / BLOCK_SIZE)):
            tables[row, block] = next(free)
        slots += [
            int(tables[row, t // BLOCK_SIZE]) * BLOCK_SIZE + t % BLOCK_SIZE
            for t in range(cached, cached + new)
        ]
    total = sum(new for _, new in seqs)
    query = torch.randn(total, heads, head_dim).to(dtype)
    key = torch.randn(total, kv_heads, head_dim).to(dtype)
    value = torch.randn(total, kv_heads, head_dim).to(dtype)
    query_lens = [new for _, new in seqs]
    seq_lens = [cached + new for cached, new in seqs]
    starts = [0]
    for length in query_lens:
        starts.append(starts[-1] + length)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        query_lens_host=query_lens,
        seq_lens_host=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    scale = head_dim**-0.5
    out = ReferenceBackend().forward(query, key, value, kv_layer, meta, scale)
    for row, slot in enumerate(slots):
        block, offset = divmod(slot, BLOCK_SIZE)
        assert torch.equal(kv_layer[block, 0, offset], key[row])
        assert torch.equal(kv_layer[block, 1, offset], value[row])
    for row in range(len(seqs)):
        chunk = slice(starts[row], starts[row + 1])
        expected = dense_attention(query[chunk], kv_layer, tables[row], seq_lens[row], scale)
        assert_close(out[chunk], expected, dtype)


def test_backend_plan_is_per_forward_pass() -> None:
    """One backend, two layers of one step, then a new step: every layer's KV and output are right."""
    heads, kv_heads, head_dim = 4, 2, 8
    cache = make_cache(kv_heads, head_dim, torch.float32, seed=7)
    backend = ReferenceBackend()
    scale = head_dim**-0.5
    table = make_table(4, "fragmented", seed=8)
    for seq_len in (10, 11):  # a decode step at position 9, then the next one at 10
        slot = int(table[(seq_len - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (seq_len - 1) % BLOCK_SIZE
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([slot]),
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
            seq_lens=torch.tensor([seq_len], dtype=torch.int32),
            block_tables=table[None],
            query_lens_host=[1],
            seq_lens_host=[seq_len],
            max_query_len=1,
            max_seq_len=seq_len,
        )
        for layer in range(NUM_LAYERS):
            query = torch.randn(1, heads, head_dim)
            key, value = torch.randn(1, kv_heads, head_dim), torch.randn(1, kv_heads, head_dim)
            out = backend.forward(query, key, value, cache[:, layer], meta, scale)
            block, offset = divmod(slot, BLOCK_SIZE)
            assert torch.equal(cache[block, layer, 0, offset], key[0])
            assert torch.equal(cache[block, layer, 1, offset], value[0])
            expected = dense_attention(query, cache[:, layer], table, seq_len, scale)
            assert_close(out, expected, torch.float32)
