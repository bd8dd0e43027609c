"""Triton attention, KV write and block copies against the pure-torch reference.

Without CUDA the kernels run under ``TRITON_INTERPRET=1`` on small shapes; on a GPU the
same tests run on the device, plus larger shapes up to a 128k-token context in bf16.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch


def _fix_interpreter_scalar_index() -> None:
    """Let the interpreter run loops with run-time bounds under numpy >= 2.4.

    triton 3.6's interpreter holds scalars as shape-(1,) arrays and turns them into loop
    bounds with ``int(array)``, which numpy 2.4 rejects (triton-lang/triton#9171, fixed
    upstream after 3.6). Re-registers ``__index__`` with a 0-d conversion.
    """
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor
    if getattr(patch_tensor, "scalar_index_fixed", False):
        return

    def patched(tensor: type, scope: interpreter._LangPatchScope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(())))

    patched.scalar_index_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter_scalar_index()

from kernels.block_copy import block_runs, gather_blocks, scatter_blocks  # noqa: E402
from kernels.interface import AttentionMetadata  # noqa: E402
from kernels.reference import ReferenceBackend  # noqa: E402
from kernels.triton_attention import AttentionConfig, choose_num_splits, paged_attention  # noqa: E402
from kernels.triton_backend import TritonBackend  # noqa: E402
from kernels.triton_kv_write import write_kv_triton  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
NUM_LAYERS = 2
LAYER = 1  # NOTE: the last layer, so the layer view is not contiguous and has an offset


class Batch:
    """A random mixed batch over a random block assignment in a two-layer cache.

    ``seqs`` holds ``(cached_context_len, query_len)`` per sequence; cached positions hold
    random K/V already (the whole cache starts random), new tokens come in query/key/value.
    """

    def __init__(
        self,
        seqs: list[tuple[int, int]],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        seq_lens = [ctx + q for ctx, q in seqs]
        blocks_per_seq = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(blocks_per_seq) + 3
        ids = list(range(num_blocks))
        rng.shuffle(ids)
        max_blocks = max(blocks_per_seq) + 1
        tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
        slots: list[int] = []
        for i, (n, (ctx, q)) in enumerate(zip(blocks_per_seq, seqs, strict=True)):
            row = [ids.pop() for _ in range(n)]
            tables[i, :n] = torch.tensor(row, dtype=torch.int32)
            slots += [
                row[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + q)
            ]
        num_tokens = sum(q for _, q in seqs)
        self.cache = torch.randn(
            num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim, generator=gen
        ).to(DEVICE, dtype)
        # NOTE: q/k/v as views of one fused projection output, as a model produces them.
        qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
        qkv = qkv.to(DEVICE, dtype)
        self.query = qkv[:, :num_heads]
        self.key = qkv[:, num_heads : num_heads + num_kv_heads]
        self.value = qkv[:, num_heads + num_kv_heads :]
        query_lens = [q for _, q in seqs]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        self.meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            block_tables=tables.to(DEVICE),
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        self.scale = 1.0 / math.sqrt(head_dim)

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Output and cache of the reference backend, computed in float32."""
        cache = self.cache.float()
        out = ReferenceBackend().forward(
            self.query.float(),
            self.key.float(),
            self.value.float(),
            cache[:, LAYER],
            self.meta,
            self.scale,
        )
        return out, cache

    def layer(self) -> torch.Tensor:
        return self.cache[:, LAYER]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


# (seqs, num_heads, num_kv_heads, head_dim, block_size)
SMALL_CASES = [
    ([(0, 5), (20, 1), (33, 7), (7, 1)], 4, 2, 32, 16),  # mixed; GQA 2
    ([(40, 1), (0, 1), (70, 3), (15, 18)], 6, 2, 64, 32),  # GQA 3 (not a power of two)
    ([(0, 19)], 4, 4, 16, 16),  # one whole prompt, MHA
    ([(47, 1), (16, 1), (100, 1)], 8, 2, 32, 16),  # pure decode, GQA 4
    ([(5, 40), (64, 1)], 4, 1, 128, 16),  # MQA, head_dim 128, chunk across tiles
    ([(20, 1), (7, 1), (33, 7), (0, 5)], 4, 2, 32, 16),  # the scheduler's order: decodes first
]
LARGE_CASES = [
    ([(0, 1000), (3000, 1), (1500, 517), (17, 1), (4095, 1)], 32, 8, 128, 16),
    ([(0, 333), (2100, 700), (5000, 1), (900, 1)], 16, 4, 64, 32),
    ([(0, 1)] + [(1000 + 37 * i, 1) for i in range(63)], 32, 8, 128, 16),
    ([(2000, 64), (9000, 1)], 28, 4, 128, 64),  # GQA 7, block size 64
    ([(300, 9)], 8, 8, 96, 16),  # head_dim not a power of two
    ([(3000, 1), (17, 1), (4095, 1), (1500, 517), (0, 1000)], 32, 8, 128, 16),  # decodes first
]
CASES = LARGE_CASES if CUDA else SMALL_CASES


@pytest.mark.parametrize("case", range(len(CASES)))
def test_backend_matches_reference_fp32(case: int) -> None:
    seqs, heads, kv_heads, head_dim, block_size = CASES[case]
    batch = Batch(seqs, heads, kv_heads, head_dim, block_size, seed=case)
    ref_out, ref_cache = batch.reference()
    out = TritonBackend(sdpa_min_tokens=None, sdpa_min_chunk_tokens=None).forward(
        batch.query, batch.key, batch.value, batch.layer(), batch.meta, batch.scale
    )
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    assert torch.equal(batch.cache, ref_cache), "KV write differs from the reference"


@pytest.mark.slow
@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_split_k_matches_reference(num_splits: int) -> None:
    seqs = (
        [(3000, 1), (700, 1), (1, 1), (1200, 130)] if CUDA else [(90, 1), (30, 1), (1, 1), (41, 20)]
    )
    batch = Batch(seqs, 8, 2, 64, 16, seed=num_splits)
    ref_out, _ = batch.reference()
    write_kv_triton(batch.key, batch.value, batch.layer(), batch.meta.slot_mapping)
    out = paged_attention(
        batch.query, batch.layer(), batch.meta.block_tables, batch.meta.seq_lens,
        batch.meta.query_start_loc, scale=batch.scale, max_query_len=batch.meta.max_query_len,
        max_seq_len=batch.meta.max_seq_len, num_splits=num_splits,
    )  # fmt: skip
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "config",
    [AttentionConfig(16, 16, 4, 1), AttentionConfig(32, 32, 4, 2), AttentionConfig(64, 16, 4, 2)],
)
def test_tile_shapes_match_reference(config: AttentionConfig) -> None:
    """Tiles smaller and larger than blocks, and q-blocks that end mid-sequence."""
    seqs = [(31, 33), (16, 1), (0, 17), (50, 2)]
    batch = Batch(seqs, 4, 2, 32, 16, seed=config.block_m + config.tile_n)
    ref_out, _ = batch.reference()
    write_kv_triton(batch.key, batch.value, batch.layer(), batch.meta.slot_mapping)
    out = paged_attention(
        batch.query, batch.layer(), batch.meta.block_tables, batch.meta.seq_lens,
        batch.meta.query_start_loc, scale=batch.scale, max_query_len=batch.meta.max_query_len,
        max_seq_len=batch.meta.max_seq_len, config=config,
    )  # fmt: skip
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(
            torch.bfloat16,
            # NOTE: only on a GPU: the triton 3.6 interpreter dots bf16 bits as ints.
            marks=pytest.mark.gpu,
        ),
        torch.float16,
    ],
)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_half_precision_close_to_fp32_reference(dtype: torch.dtype, case: int) -> None:
    """bf16/fp16 take the tensor-core tile shapes (decode and prefill configs)."""
    seqs, heads, kv_heads, head_dim, block_size = CASES[case]
    batch = Batch(seqs, heads, kv_heads, head_dim, block_size, dtype=dtype, seed=11 + case)
    ref_out, _ = batch.reference()
    out = TritonBackend(sdpa_min_tokens=None, sdpa_min_chunk_tokens=None).forward(
        batch.query, batch.key, batch.value, batch.layer(), batch.meta, batch.scale
    )
    assert out.dtype == dtype
    assert not out.isnan().any()
    assert rel_error(out, ref_out) < 1e-2


@pytest.mark.parametrize(
    "seqs",
    [
        [(0, 37)],  # one whole prompt: SDPA on the new q/k/v
        [(20, 1), (5, 3), (30, 12), (0, 10)],  # Triton prefix, then a chunk over context + a prompt
        [(16, 9), (3, 20)],  # every sequence long: no Triton launch
        [(30, 12), (7, 1)],  # long chunk before a decode: all Triton
    ],
)
def test_long_chunk_sdpa_routing_matches_reference(seqs: list[tuple[int, int]]) -> None:
    batch = Batch(seqs, 8, 2, 64, 16, seed=len(seqs))
    ref_out, ref_cache = batch.reference()
    out = TritonBackend(sdpa_min_tokens=8, sdpa_min_chunk_tokens=8).forward(
        batch.query, batch.key, batch.value, batch.layer(), batch.meta, batch.scale
    )
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    assert torch.equal(batch.cache, ref_cache)


@pytest.mark.gpu  # flash attention through SDPA
def test_long_chunks_bf16_default_routing() -> None:
    seqs = [(3000, 1), (9000, 1), (700, 100), (12000, 2100), (0, 4000)]  # last two: SDPA
    batch = Batch(seqs, 32, 8, 128, 16, dtype=torch.bfloat16, seed=42)
    ref_out, _ = batch.reference()
    out = TritonBackend().forward(
        batch.query, batch.key, batch.value, batch.layer(), batch.meta, batch.scale
    )
    assert not out.isnan().any()
    assert rel_error(out, ref_out) < 1e-2


def test_kv_write_skips_negative_slots_and_other_layers() -> None:
    batch = Batch([(3, 5), (0, 2)], 4, 2, 32, 16, seed=3)
    before = batch.cache.clone()
    slots = batch.meta.slot_mapping.clone()
    slots[2] = -1
    write_kv_triton(batch.key, batch.value, batch.layer(), slots)
    block_size = batch.cache.shape[3]
    written = torch.zeros(batch.cache.shape[:4], dtype=torch.bool, device=DEVICE)
    for tok, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        assert torch.equal(batch.cache[block, LAYER, 0, offset], batch.key[tok])
        assert torch.equal(batch.cache[block, LAYER, 1, offset], batch.value[tok])
        written[block, LAYER, :, offset] = True
    assert torch.equal(batch.cache[~written], before[~written]), "wrote outside the given slots"


def test_invalid_shapes_are_rejected() -> None:
    batch = Batch([(3, 2)], 4, 2, 32, 16)
    meta = batch.meta
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(
            batch.query[..., :16], batch.layer(), meta.block_tables, meta.seq_lens,
            meta.query_start_loc, scale=1.0, max_query_len=2, max_seq_len=5,
        )  # fmt: skip
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(
            batch.query[:, :3], batch.layer(), meta.block_tables, meta.seq_lens,
            meta.query_start_loc, scale=1.0, max_query_len=2, max_seq_len=5,
        )  # fmt: skip
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_triton(batch.key, batch.value, batch.layer(), meta.slot_mapping[:1])


def test_choose_num_splits() -> None:
    assert choose_num_splits(num_programs=640, max_seq_len=131072, num_sms=132) == 1
    assert choose_num_splits(num_programs=8, max_seq_len=100, num_sms=132) == 1
    one_seq_128k = choose_num_splits(num_programs=8, max_seq_len=131072, num_sms=132)
    assert 8 * one_seq_128k >= 132
    assert choose_num_splits(num_programs=8, max_seq_len=1024, num_sms=132) == 8  # 128 tokens each
    assert choose_num_splits(num_programs=40, max_seq_len=131072, num_sms=132) == 14
    assert choose_num_splits(num_programs=160, max_seq_len=131072, num_sms=132) == 4


def test_block_runs() -> None:
    assert block_runs([]) == []
    assert block_runs([4, 5, 6, 9, 2, 3]) == [(0, 4, 3), (3, 9, 1), (4, 2, 2)]


@pytest.mark.parametrize("to_host", [False, True])
def test_block_gather_scatter_round_trip(to_host: bool) -> None:
    cache = torch.randn(12, NUM_LAYERS, 2, 4, 2, 8, device=DEVICE)
    ids = [7, 8, 9, 2, 11, 0]
    buffer_device = torch.device("cpu") if to_host else DEVICE
    buffer = torch.empty(len(ids) + 1, *cache.shape[1:], device=buffer_device)
    if to_host and CUDA:
        buffer = buffer.pin_memory()
    gather_blocks(cache, ids, buffer)
    if CUDA:
        torch.cuda.synchronize()
    for i, block in enumerate(ids):
        assert torch.equal(buffer[i].to(DEVICE), cache[block])

    target = torch.zeros_like(cache)
    scatter_blocks(buffer, target, ids)
    if CUDA:
        torch.cuda.synchronize()
    moved = torch.zeros(cache.shape[0], dtype=torch.bool)
    moved[ids] = True
    assert torch.equal(target[moved.to(DEVICE)], cache[moved.to(DEVICE)])
    assert not target[(~moved).to(DEVICE)].any(), "scatter touched blocks outside block_ids"


def test_block_copy_rejects_bad_input() -> None:
    cache = torch.randn(4, 1, 2, 4, 1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="out of range"):
        gather_blocks(cache, [1, 4], torch.empty(2, *cache.shape[1:], device=DEVICE))
    with pytest.raises(ValueError, match="holds 1 blocks"):
        gather_blocks(cache, [1, 2], torch.empty(1, *cache.shape[1:], device=DEVICE))
    with pytest.raises(ValueError, match="does not hold"):
        scatter_blocks(torch.empty(2, 1, 2, 4, 1, 4, device=DEVICE), cache, [0, 1])


@pytest.mark.gpu  # long contexts
@pytest.mark.parametrize("seqs", [[(131071, 1)], [(131072 - 300, 300), (65536, 1), (100, 1)]])
def test_128k_context_bf16(seqs: list[tuple[int, int]]) -> None:
    batch = Batch(seqs, 32, 8, 128, 16, dtype=torch.bfloat16, seed=128)
    ref_out, _ = batch.reference()
    out = TritonBackend().forward(
        batch.query, batch.key, batch.value, batch.layer(), batch.meta, batch.scale
    )
    assert not out.isnan().any()
    assert rel_error(out, ref_out) < 1e-2
