"""The host-memory tier: exact copies, LRU eviction into a callback, identity checks."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
import xxhash

from kvstore.cpu_tier import CpuTier
from kvstore.tier import BlockLike, block_nbytes
from tests.kvstore.tier_blocks import SHAPE, bit_equal, make_meta, random_block


def make_tier(num_slots: int, dtype: torch.dtype = torch.float32, **kwargs: object) -> CpuTier:
    return CpuTier(SHAPE, dtype, num_slots * block_nbytes(SHAPE, dtype), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    tier = make_tier(4, dtype)
    blocks = [random_block(dtype, seed) for seed in range(3)]
    for index, block in enumerate(blocks):
        assert tier.put(make_meta(index), block)
    block[...] = 0  # the tier holds copies, not references
    for index in range(3):
        dest = torch.full(SHAPE, 7.0, dtype=dtype)
        assert tier.load_into(make_meta(index), dest)
        assert bit_equal(dest, random_block(dtype, index))
    got = tier.get(make_meta(1))
    assert got is not None and bit_equal(got, blocks[1])
    stats = tier.metrics()
    assert (stats.hits, stats.misses, stats.num_blocks) == (4, 0, 3)
    assert stats.bytes_read == 4 * block_nbytes(SHAPE, dtype)
    assert stats.used_bytes == 3 * block_nbytes(SHAPE, dtype)
    assert stats.capacity_bytes == 4 * block_nbytes(SHAPE, dtype)
    assert stats.load_count == 4 and stats.store_count == 3 and stats.load_seconds_total > 0


def test_lru_eviction_hands_blocks_to_the_callback() -> None:
    evicted: list[tuple[BlockLike, torch.Tensor]] = []
    tier = make_tier(3, on_evict=lambda meta, block: evicted.append((meta, block.clone())))
    for index in range(3):
        tier.put(make_meta(index), random_block(torch.float32, index))
    assert tier.load_into(make_meta(0), torch.empty(SHAPE))  # 0 becomes most recent
    assert tier.put(make_meta(1), random_block(torch.float32, 1))  # re-put touches 1
    tier.put(make_meta(3), random_block(torch.float32, 3))
    tier.put(make_meta(4), random_block(torch.float32, 4))
    assert [meta for meta, _ in evicted] == [make_meta(2), make_meta(0)]
    assert bit_equal(evicted[0][1], random_block(torch.float32, 2))
    assert bit_equal(evicted[1][1], random_block(torch.float32, 0))
    assert [meta.block_hash for meta in tier.lru_metas()] == [
        make_meta(i).block_hash for i in (1, 3, 4)
    ]
    assert not tier.contains(make_meta(0)) and tier.contains(make_meta(4))
    assert not tier.load_into(make_meta(2), torch.empty(SHAPE))
    stats = tier.metrics()
    assert (stats.evictions, stats.num_blocks, stats.misses) == (2, 3, 1)


def test_failing_callback_does_not_break_puts(caplog: pytest.LogCaptureFixture) -> None:
    def explode(meta: BlockLike, block: torch.Tensor) -> None:
        raise RuntimeError("consumer is broken")

    tier = make_tier(1, on_evict=explode)
    tier.put(make_meta(0), random_block(torch.float32, 0))
    assert tier.put(make_meta(1), random_block(torch.float32, 1))
    assert tier.contains(make_meta(1)) and "eviction callback failed" in caplog.text


def test_same_hash_other_tokens_is_never_served() -> None:
    tier = make_tier(2)
    tier.put(make_meta(0), random_block(torch.float32, 0))
    collision = dataclasses.replace(make_meta(0), token_ids=(9, 9, 9, 9))
    dest = torch.zeros(SHAPE)
    assert not tier.load_into(collision, dest)
    assert torch.count_nonzero(dest) == 0
    other_tenant = dataclasses.replace(make_meta(0), salt=xxhash.xxh3_128_digest(b"tenant-2"))
    assert not tier.contains(other_tenant) and not tier.load_into(other_tenant, dest)
    stats = tier.metrics()
    assert (stats.mismatched_records, stats.misses, stats.hits) == (1, 2, 0)


def test_discard_frees_the_slot() -> None:
    tier = make_tier(1)
    tier.put(make_meta(0), random_block(torch.float32, 0))
    assert tier.discard(make_meta(0)) and not tier.discard(make_meta(0))
    evicted: list[BlockLike] = []
    tier.on_evict = lambda meta, block: evicted.append(meta)
    tier.put(make_meta(1), random_block(torch.float32, 1))
    assert evicted == [] and len(tier) == 1


def test_batched_load_into_a_preallocated_tensor() -> None:
    tier = make_tier(4, torch.bfloat16)
    for index in range(3):
        tier.put(make_meta(index), random_block(torch.bfloat16, index))
    metas = [make_meta(2), make_meta(7), make_meta(0)]
    dest = torch.zeros((3, *SHAPE), dtype=torch.bfloat16)
    assert tier.load_many_into(metas, dest) == [True, False, True]
    assert bit_equal(dest[0], random_block(torch.bfloat16, 2))
    assert bit_equal(dest[2], random_block(torch.bfloat16, 0))
    with pytest.raises(ValueError, match="3 blocks to load but 2 destinations"):
        tier.load_many_into(metas, dest[:2])


def test_batch_merges_consecutive_rows_and_slots_bit_exactly() -> None:
    tier = make_tier(8)
    metas = [make_meta(index) for index in range(8)]
    for index in reversed(range(8)):  # slots go out from the top down: meta i in slot i
        assert tier.put(metas[index], random_block(torch.float32, index))
    cache = torch.full((12, *SHAPE), 7.0)
    rows = [4, 5, 6, 0, 1, 9, 10, 11]  # runs: slots 0-2 -> rows 4-6, 3-4 -> 0-1, 5-7 -> 9-11
    tier.discard(metas[4])
    found = tier.load_rows_into(metas, cache, rows)
    assert found == [True] * 4 + [False] + [True] * 3
    for index, row in enumerate(rows):
        if found[index]:
            assert bit_equal(cache[row], random_block(torch.float32, index))
    stats = tier.metrics()
    assert (stats.hits, stats.misses, stats.load_count, stats.load_copies) == (7, 1, 7, 3)
    assert stats.bytes_read == 7 * block_nbytes(SHAPE, torch.float32)
    with pytest.raises(ValueError, match="8 blocks to load but 2 destination rows"):
        tier.load_rows_into(metas, cache, rows[:2])
    with pytest.raises(ValueError, match="must hold blocks of"):
        tier.load_rows_into(metas[:1], torch.zeros((2, 3)), [0])


def test_batch_into_separate_destinations() -> None:
    tier = make_tier(4)
    metas = [make_meta(index) for index in range(3)]
    for index, meta in enumerate(metas):
        tier.put(meta, random_block(torch.float32, index))
    dests = [torch.zeros(SHAPE) for _ in range(3)]
    assert tier.load_many_into(list(reversed(metas)), dests) == [True, True, True]
    assert all(bit_equal(dests[i], random_block(torch.float32, 2 - i)) for i in range(3))


def test_bad_arguments_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="smaller than one block"):
        CpuTier(SHAPE, torch.float32, block_nbytes(SHAPE, torch.float32) - 1)
    with pytest.raises(ValueError, match="positive dims"):
        CpuTier((2, 0, 4), torch.float32, 1 << 20)
    tier = make_tier(2)
    with pytest.raises(ValueError, match=r"dtype torch\.float32"):
        tier.put(make_meta(0), random_block(torch.bfloat16, 0))
    with pytest.raises(ValueError, match=r"shape \(2, 2, 4, 2, 8\)"):
        tier.load_into(make_meta(0), torch.empty((2, 2, 4, 2, 4)))


def test_non_contiguous_source_and_destination() -> None:
    tier = make_tier(2)
    source = (
        random_block(torch.float32, 5).permute(4, 3, 2, 1, 0).contiguous().permute(4, 3, 2, 1, 0)
    )
    assert not source.is_contiguous()
    tier.put(make_meta(0), source)
    dest = torch.zeros(tuple(reversed(SHAPE))).permute(4, 3, 2, 1, 0)
    assert tier.load_into(make_meta(0), dest)
    assert torch.equal(dest, random_block(torch.float32, 5))


def test_concurrent_puts_and_loads_stay_consistent() -> None:
    tier = make_tier(8)
    errors: list[str] = []

    def worker(offset: int) -> None:
        dest = torch.empty(SHAPE)
        for step in range(150):
            index = (offset + step) % 24
            tier.put(make_meta(index), random_block(torch.float32, index))
            if tier.load_into(make_meta(index), dest) and not bit_equal(
                dest, random_block(torch.float32, index)
            ):
                errors.append(f"block {index} came back different")

    threads = [threading.Thread(target=worker, args=(offset,)) for offset in (0, 7, 13)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    stats = tier.metrics()
    assert stats.num_blocks == 8 and len(tier.lru_metas()) == 8


def test_closed_tier_misses_and_drops() -> None:
    tier = make_tier(2)
    tier.put(make_meta(0), random_block(torch.float32, 0))
    tier.close()
    assert not tier.put(make_meta(1), random_block(torch.float32, 1))
    assert not tier.load_into(make_meta(0), torch.empty(SHAPE))
    assert tier.metrics().disabled


@pytest.mark.gpu
def test_pinned_storage_and_cuda_round_trip() -> None:
    tier = make_tier(2, torch.bfloat16)
    assert tier._storage.is_pinned()
    block = random_block(torch.bfloat16, 1).cuda()
    tier.put(make_meta(0), block)
    dest = torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda")
    assert tier.load_into(make_meta(0), dest)
    assert torch.equal(dest.cpu().view(torch.uint8), block.cpu().view(torch.uint8))


@pytest.mark.gpu
def test_async_batch_to_the_gpu_is_complete_before_slots_are_reused() -> None:
    """Big enough that copies are still in flight when the loop ends; every slot is then
    overwritten at once, which must not reach the loaded blocks."""
    shape = (8, 2, 16, 8, 128)  # 1 MiB in bfloat16
    tier = CpuTier(shape, torch.bfloat16, 64 * block_nbytes(shape, torch.bfloat16))
    assert tier._storage.is_pinned()
    metas = [make_meta(index) for index in range(64)]
    blocks = torch.randn((64, *shape), generator=torch.Generator().manual_seed(5)).bfloat16()
    for meta, block in zip(metas, blocks, strict=True):
        tier.put(meta, block)
    cache = torch.zeros((80, *shape), dtype=torch.bfloat16, device="cuda")
    rows = [79 - i for i in range(32)] + list(range(32))  # unmerged, then merged runs
    assert tier.load_rows_into(metas, cache, rows) == [True] * 64
    for meta in metas:  # refill every slot with other bytes
        tier.discard(meta)
        tier.put(meta, torch.zeros(shape, dtype=torch.bfloat16))
    loaded = cache[rows].cpu()
    assert torch.equal(loaded.view(torch.uint8), blocks.view(torch.uint8))
