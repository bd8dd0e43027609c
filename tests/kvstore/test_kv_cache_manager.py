"""The KV cache manager's prefix lookups through the tier stack: a run of tier hits comes back
in one call, stops at the first miss, leaves the block pool intact, and streams a document in
under a per-step budget."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from kvstore import disk_reader, kv_cache_manager
from kvstore.kv_cache_manager import KVAllocation, KVCacheManager
from kvstore.tier import salt_fingerprint
from tests.kvstore.tier_blocks import bit_equal
from tests.kvstore.tiered_cache import BS, SALT, TieredCache, chain


@pytest.fixture
def tokens() -> list[int]:
    return list(range(10 * BS + 2))  # 10 full blocks and a partial one


def load_all(rig: TieredCache, tokens: list[int]) -> tuple[KVAllocation, int, int]:
    """match_prefix until it makes no progress: (allocation, computed tokens, calls)."""
    alloc = rig.alloc(tokens)
    computed, calls = 0, 0
    while True:
        calls += 1
        rig.manager.begin_step()
        now = rig.manager.match_prefix(alloc, tokens, computed)
        if now == computed:
            return alloc, computed, calls
        computed = now


def test_match_prefix_loads_a_cpu_run_in_one_call_bit_exactly(tokens: list[int]) -> None:
    rig = TieredCache(16, cpu_slots=16)
    kv = rig.compute(tokens)
    rig.evict_to_tiers()
    assert rig.pool.num_cached == 0
    alloc, computed, calls = load_all(rig, tokens)
    assert computed == 10 * BS and calls == 2  # the second call finds nothing more
    assert rig.stack.traffic.loaded_from_cpu == 10
    for index, block in enumerate(alloc.block_table):
        assert bit_equal(rig.cache[block], kv[index])
        assert rig.pool.lookup(rig.manager._identity(alloc, tokens, index)) == block
    rig.pool.check_invariants([alloc.block_table])
    rig.manager.free(alloc)
    assert rig.pool.num_free == rig.pool.num_blocks


@pytest.mark.parametrize("fault", ["cpu-discard", "disk-corrupt", "disk-truncate"])
def test_a_miss_in_the_middle_stops_the_run_and_leaks_nothing(
    tmp_path: Path, tokens: list[int], fault: str
) -> None:
    on_disk = fault.startswith("disk")
    rig = TieredCache(16, cpu_slots=0 if on_disk else 16, disk_dir=tmp_path if on_disk else None)
    kv = rig.compute(tokens)
    rig.evict_to_tiers()
    identity = chain(tokens)[6]
    if fault == "cpu-discard":
        assert rig.tier("cpu").discard(identity)
    else:
        path = tmp_path / salt_fingerprint(SALT) / (identity.block_hash.hex() + ".kv")
        data = bytearray(path.read_bytes())
        if fault == "disk-corrupt":
            data[-5] ^= 0x40  # one bit of the payload
        else:
            data = data[: len(data) - 100]
        path.write_bytes(bytes(data))
    free_before = rig.pool.num_free
    alloc, computed, _ = load_all(rig, tokens)
    assert computed == 6 * BS  # blocks 0-5 loaded, block 6 is to be computed
    assert all(bit_equal(rig.cache[b], kv[i]) for i, b in enumerate(alloc.block_table))
    assert rig.pool.num_free == free_before - 6  # the blocks for 6-9 went back
    rig.pool.check_invariants([alloc.block_table])
    if on_disk:
        disk = rig.tier("disk")
        assert not disk.contains(identity)  # rejected and removed
        counters = disk.metrics()
        assert counters.corrupt_records == 1 and counters.hits >= 6
    rig.manager.free(alloc)
    assert rig.pool.num_free == rig.pool.num_blocks
    rig.stack.close()


def test_demotions_caused_by_the_batch_allocation_cut_the_run_cleanly(tokens: list[int]) -> None:
    """Allocating the run's device blocks demotes other cached blocks into a full CPU tier,
    which evicts the run's own least recently used blocks: the batch misses there."""
    rig = TieredCache(16, cpu_slots=10)
    kv = rig.compute(tokens)
    rig.evict_to_tiers()  # the CPU tier is now full of the document
    rig.compute([100_000 + t for t in tokens])  # another document, cached on the device
    alloc, computed, _ = load_all(rig, tokens)
    assert 0 < computed < 10 * BS
    assert rig.stack.traffic.loaded_from_cpu == computed // BS
    assert rig.stack.traffic.discarded_loads == 0  # the demotions took the run's tail
    assert rig.tier("cpu").metrics().misses == 10 - computed // BS
    assert all(bit_equal(rig.cache[b], kv[i]) for i, b in enumerate(alloc.block_table))
    rig.pool.check_invariants([alloc.block_table])
    rig.manager.free(alloc)
    assert rig.pool.num_free == rig.pool.num_blocks


def test_room_made_for_a_cpu_run_never_evicts_the_run() -> None:
    """An idle document is the CPU tier's oldest: the demotions that make device room for
    its load must evict other blocks, not the document itself."""
    rig = TieredCache(64, cpu_slots=64)
    document = [10_000 + t for t in range(20 * BS)]
    kv = rig.compute(document)
    rig.evict_to_tiers()
    rig.compute([20_000 + t for t in range(44 * BS)])  # newer traffic fills the CPU tier
    rig.evict_to_tiers()
    rig.compute([30_000 + t for t in range(60 * BS)])  # cached on the device, to demote
    alloc, computed, _ = load_all(rig, [*document, 7, 7, 7])
    assert computed == 20 * BS and rig.stack.traffic.loaded_from_cpu == 20
    assert all(bit_equal(rig.cache[b], kv[i]) for i, b in enumerate(alloc.block_table))
    rig.pool.check_invariants([alloc.block_table])


def test_load_budget_bounds_blocks_per_call() -> None:
    rig = TieredCache(48, cpu_slots=48)
    long_tokens = list(range(40 * BS + 1))
    rig.compute(long_tokens)
    calls_by_budget = {}
    for budget_blocks in (1, 4, 16, 64):
        rig.evict_to_tiers()
        rig.manager.max_load_bytes_per_step = budget_blocks * rig.stack.block_nbytes
        assert rig.manager.max_loads_per_step == budget_blocks
        alloc, computed, calls = load_all(rig, long_tokens)
        assert computed == 40 * BS
        calls_by_budget[budget_blocks] = calls - 1  # the last call finds nothing
        rig.manager.free(alloc)
    assert calls_by_budget == {1: 40, 4: 10, 16: 3, 64: 1}
    rig.manager.max_load_bytes_per_step = 1  # below one block: still one block per call
    assert rig.manager.max_loads_per_step == 1
    with pytest.raises(ValueError, match="max_load_bytes_per_step must be >= 1"):
        KVCacheManager(rig.pool, BS, True, tiers=rig.stack, max_load_bytes_per_step=0)


def test_a_step_loads_its_budget_in_batches_within_one_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Loads are queued a batch at a time (so the first copies start early), and one call
    still takes the whole budget, batch after batch, in the chain's order."""
    monkeypatch.setattr(kv_cache_manager, "LOAD_BATCH_BLOCKS", 3)
    rig = TieredCache(48, cpu_slots=48)
    long_tokens = list(range(20 * BS + 1))
    kv = rig.compute(long_tokens)
    rig.evict_to_tiers()
    rig.manager.max_load_bytes_per_step = 16 * rig.stack.block_nbytes
    batches: list[int] = []
    load_many = rig.stack.load_many

    def recorded(identities, blocks, served=None):  # type: ignore[no-untyped-def]
        batches.append(len(identities))
        return load_many(identities, blocks, served)

    monkeypatch.setattr(rig.stack, "load_many", recorded)
    alloc = rig.alloc(long_tokens)
    rig.manager.begin_step()
    assert rig.manager.match_prefix(alloc, long_tokens, 0) == 16 * BS
    assert batches == [3, 3, 3, 3, 3, 1]
    for index, block in enumerate(alloc.block_table):
        assert bit_equal(rig.cache[block], kv[index])
    rig.manager.begin_step()
    assert rig.manager.match_prefix(alloc, long_tokens, 16 * BS) == 20 * BS
    rig.pool.check_invariants([alloc.block_table])
    rig.manager.free(alloc)
    assert rig.pool.num_free == rig.pool.num_blocks


def test_a_document_loaded_again_is_copied_in_runs(tokens: list[int]) -> None:
    """A freed sequence's blocks return to the free list tail first; a load takes them in
    ascending order, so a document in consecutive slots comes back in a copy or two (the
    block its last, partial block held splits the rows), not one per block, however often
    it went down and up."""
    rig = TieredCache(11, cpu_slots=16)  # the pool holds the document and no more
    kv = rig.compute(tokens)
    for _ in range(3):
        rig.evict_to_tiers()
        before = rig.tier("cpu").metrics()
        alloc, computed, _ = load_all(rig, tokens)
        after = rig.tier("cpu").metrics()
        assert computed == 10 * BS and after.load_count - before.load_count == 10
        assert after.load_copies - before.load_copies <= 2
        for index, block in enumerate(alloc.block_table):
            assert bit_equal(rig.cache[block], kv[index])
        rig.manager.free(alloc)
    rig.pool.check_invariants()


def test_the_load_budget_is_shared_by_every_sequence_of_a_step() -> None:
    rig = TieredCache(48, cpu_slots=48)
    first, second = list(range(10 * BS + 1)), list(range(500, 500 + 10 * BS + 1))
    rig.compute(first)
    rig.compute(second)
    rig.evict_to_tiers()
    rig.manager.max_load_bytes_per_step = 4 * rig.stack.block_nbytes
    one, two = rig.alloc(first), rig.alloc(second)
    rig.manager.begin_step()
    assert rig.manager.match_prefix(one, first, 0) == 4 * BS
    assert rig.manager.match_prefix(two, second, 0) == 0  # the step's budget is spent
    rig.manager.begin_step()
    assert rig.manager.match_prefix(two, second, 0) == 4 * BS
    rig.pool.check_invariants([one.block_table, two.block_table])
    rig.manager.free(one)
    rig.manager.free(two)
    assert rig.pool.num_free == rig.pool.num_blocks


def test_a_load_that_raises_gives_its_device_blocks_back(
    tokens: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy fault (a device error, not a miss) fails the lookup; the blocks allocated for
    the run are in no block table, so they go back to the pool."""
    rig = TieredCache(16, cpu_slots=16)
    rig.compute(tokens)
    rig.evict_to_tiers()
    cpu = rig.tier("cpu")

    def fault(*args: object, **kwargs: object) -> list[bool]:
        raise RuntimeError("copy fault")

    monkeypatch.setattr(cpu, "load_rows_into", fault)
    monkeypatch.setattr(cpu, "load_many_into", fault)
    alloc = rig.alloc(tokens)
    rig.manager.begin_step()
    with pytest.raises(RuntimeError, match="copy fault"):
        rig.manager.match_prefix(alloc, tokens, 0)
    rig.manager.free(alloc)
    rig.pool.check_invariants()
    assert rig.pool.num_free == rig.pool.num_blocks


def test_a_load_that_cannot_progress_is_computed_instead_that_step(
    tmp_path: Path, tokens: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No free block to load into (pins hold the rest), or a read that fails: waiting for
    the load would wait for good, so the sequence computes that block this step."""
    rig = TieredCache(16, cpu_slots=0, disk_dir=tmp_path)
    rig.compute(tokens)
    rig.evict_to_tiers()
    held = rig.alloc([])
    assert rig.manager.allocate(held, (rig.pool.num_free - 3) * BS)  # 3 blocks stay free
    alloc = rig.alloc(tokens)
    rig.manager.begin_step()
    assert rig.manager.match_prefix(alloc, tokens, 0) == 3 * BS  # as many as fit
    assert not rig.manager.has_more_to_load(alloc, tokens, 3 * BS)
    rig.manager.free(held)
    rig.manager.begin_step()  # a later step, with room: it loads again
    assert rig.manager.has_more_to_load(alloc, tokens, 3 * BS)

    def unreadable(*args: object, **kwargs: object) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(disk_reader.os, "open", unreadable)
    assert rig.manager.match_prefix(alloc, tokens, 3 * BS) == 3 * BS  # the read failed
    assert not rig.manager.has_more_to_load(alloc, tokens, 3 * BS)
    rig.manager.free(alloc)
    rig.pool.check_invariants()
