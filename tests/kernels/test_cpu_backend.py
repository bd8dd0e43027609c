"""The CPU backend (native kernels and their pure-torch fallback) against the reference backend.

Random batches mix decodes, prefill chunks over cached context and fresh prompts, over
fragmented block tables; GQA ratios, head sizes, block sizes and chunk splits vary. The
oracle is the reference backend in float32 on the same (bf16-rounded, for bf16) inputs.
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels import cpu_native
from kernels.cpu_backend import CpuBackend
from kernels.interface import AttentionMetadata
from kernels.reference import ReferenceBackend

NUM_LAYERS = 2
LAYER = 1
# bf16 outputs are rounded once (2^-8 relative); float32 differs only in summation order.
TOLERANCE = {torch.float32: 3e-5, torch.bfloat16: 2e-2}
NATIVE = cpu_native.load() is not None
MODES = [pytest.param(True, id="native"), pytest.param(False, id="torch")]


def make_meta(
    query_lens: list[int], seq_lens: list[int], block_size: int, num_blocks: int, rng: random.Random
) -> AttentionMetadata:
    """Metadata over distinct, shuffled blocks; every slot of a sequence is its own."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    slots: list[int] = []
    for query_len, seq_len in zip(query_lens, seq_lens, strict=True):
        blocks = [free.pop() for _ in range(-(-seq_len // block_size))]
        tables.append(blocks)
        for pos in range(seq_len - query_len, seq_len):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    width = max(len(t) for t in tables)
    table = torch.zeros(len(tables), width, dtype=torch.int32)
    for row, blocks in enumerate(tables):
        table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=table,
        query_lens_host=list(query_lens),
        seq_lens_host=list(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def run_both(
    native: bool,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    query_lens: list[int],
    seq_lens: list[int],
    seed: int,
) -> None:
    if native and not NATIVE:
        pytest.skip("no C compiler: the native kernels are not built")
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    meta = make_meta(query_lens, seq_lens, block_size, num_blocks, rng)
    shape = (num_blocks, NUM_LAYERS, 2, block_size, kv_heads, head_dim)
    cache = torch.randn(shape, generator=generator).to(dtype)
    tokens = sum(query_lens)
    # q and k as strided views of one qkv-like tensor, as the model hands them over.
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=generator).to(dtype)
    query, key, value = qkv.split([heads, kv_heads, kv_heads], dim=1)
    scale = head_dim**-0.5

    backend = CpuBackend(native=native)
    assert backend.is_native == native
    got_cache = cache.clone()
    out = backend.forward(query, key, value, got_cache[:, LAYER], meta, scale)

    want_cache = cache.float()
    want = ReferenceBackend().forward(
        query.float(), key.float(), value.float(), want_cache[:, LAYER], meta, scale
    )
    assert out.dtype == dtype and out.shape == query.shape
    assert torch.equal(got_cache.float(), want_cache), "K/V stored in other slots or values"
    error = (out.float() - want).abs().max().item()
    assert error < TOLERANCE[dtype], f"max abs error {error:.2e}"


@pytest.mark.parametrize("native", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(9, 3, 64), (8, 2, 128), (4, 4, 64), (16, 2, 64), (7, 1, 32), (6, 2, 96)],
)
def test_mixed_batch_matches_reference(
    native: bool, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    # decodes, a chunk over context, a fresh prompt, a one-token chunk over context
    query_lens = [1, 37, 23, 1, 2, 80]
    seq_lens = [50, 300, 23, 17, 130, 80]
    run_both(native, dtype, heads, kv_heads, head_dim, 16, query_lens, seq_lens, seed=heads)


@pytest.mark.parametrize("native", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 4, 32, 128])
def test_block_sizes(native: bool, dtype: torch.dtype, block_size: int) -> None:
    run_both(native, dtype, 9, 3, 64, block_size, [1, 70, 5], [200, 260, 5], seed=block_size)


@pytest.mark.parametrize("native", MODES)
@pytest.mark.parametrize("seed", range(6))
def test_random_batches(native: bool, seed: int) -> None:
    rng = random.Random(100 + seed)
    heads_per_kv = rng.choice([1, 2, 3, 4, 8])
    kv_heads = rng.choice([1, 2, 3])
    dtype = rng.choice([torch.float32, torch.bfloat16])
    query_lens, seq_lens = [], []
    for _ in range(rng.randint(1, 6)):
        kind = rng.choice(["decode", "chunk", "fresh"])
        context = 0 if kind == "fresh" else rng.randint(1, 700)
        new = 1 if kind == "decode" else rng.randint(1, 150)
        query_lens.append(new)
        seq_lens.append(context + new)
    block_size = rng.choice([8, 16, 32])
    run_both(
        native, dtype, heads_per_kv * kv_heads, kv_heads, 64, block_size, query_lens, seq_lens, seed
    )


@pytest.mark.parametrize("native", MODES)
def test_chunk_splits_give_one_result(native: bool) -> None:
    """A prompt prefilled in one pass or in chunks of any size attends the same."""
    if native and not NATIVE:
        pytest.skip("no C compiler: the native kernels are not built")
    heads, kv_heads, head_dim, block_size, length = 9, 3, 64, 16, 300
    generator = torch.Generator().manual_seed(7)
    qkv = torch.randn(length, heads + 2 * kv_heads, head_dim, generator=generator)
    results = []
    for chunk in (length, 128, 100, 33):
        cache = torch.zeros(length // block_size + 2, NUM_LAYERS, 2, block_size, kv_heads, head_dim)
        table = list(range(length // block_size + 1))
        pieces = []
        backend = CpuBackend(native=native)
        for start in range(0, length, chunk):
            end = min(start + chunk, length)
            query, key, value = qkv[start:end].split([heads, kv_heads, kv_heads], dim=1)
            meta = AttentionMetadata(
                slot_mapping=torch.arange(start, end, dtype=torch.int64),
                query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
                seq_lens=torch.tensor([end], dtype=torch.int32),
                block_tables=torch.tensor([table], dtype=torch.int32),
                query_lens_host=[end - start],
                seq_lens_host=[end],
                max_query_len=end - start,
                max_seq_len=end,
            )
            pieces.append(backend.forward(query, key, value, cache[:, LAYER], meta, head_dim**-0.5))
        results.append(torch.cat(pieces))
    for other in results[1:]:
        assert (other - results[0]).abs().max().item() < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("native", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_contexts_up_to_16k(native: bool, dtype: torch.dtype) -> None:
    """A 16k decode alone (split over threads), next to a chunk over 12k of context."""
    run_both(native, dtype, 9, 3, 64, 16, [1, 256, 1], [16384, 12544, 900], seed=16)


@pytest.mark.parametrize("native", MODES)
def test_single_long_decode(native: bool) -> None:
    """One decode over 4k keys: the kernel splits it into parts merged by log-sum-exp."""
    run_both(native, torch.float32, 9, 3, 64, 16, [1], [4100], seed=4)
