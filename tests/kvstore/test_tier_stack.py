"""The tier stack's one policy: write-back on eviction, write-through with a backlog, loads
in batches served up to the first miss, and what the stack reports about its tiers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstore.block_pool import BlockPool
from kvstore.cpu_tier import CpuTier
from kvstore.disk_index import resolve_disk_dir
from kvstore.disk_tier import DiskTier
from kvstore.tier import BlockLike, KVTier, TierMetrics, block_nbytes, record_key
from kvstore.tier_stack import GIB, TierInfo, TierStack
from tests.kvstore.tier_blocks import bit_equal
from tests.kvstore.tiered_cache import SHAPE, TieredCache, chain

NBYTES = block_nbytes(SHAPE, torch.float32)


@pytest.fixture
def tokens() -> list[int]:
    return list(range(10 * 4 + 2))  # 10 full blocks and a partial one


def load_back(rig: TieredCache, tokens: list[int], count: int) -> tuple[list[int], int]:
    """Load the first ``count`` blocks of ``tokens`` into fresh device blocks."""
    blocks = rig.pool.allocate(count)
    return blocks, rig.stack.load_many(chain(tokens)[:count], blocks)


# ------------------------------------------------------------------------- write-back
def test_cpu_evictions_are_demoted_to_disk(tmp_path: Path, tokens: list[int]) -> None:
    rig = TieredCache(16, cpu_slots=3, disk_dir=tmp_path)
    kv = rig.compute(tokens[: 5 * 4])
    rig.evict_to_tiers()  # the device demotes the tail first: 4, 3, 2, then 1 and 0
    identities = chain(tokens)[:5]
    cpu, disk = rig.tier("cpu"), rig.tier("disk")
    assert [cpu.contains(identity) for identity in identities] == [True] * 3 + [False] * 2
    assert isinstance(disk, DiskTier)
    # NOTE: two writer threads: the two demoted records may land in either order.
    assert set(disk.lru_keys()) == {record_key(identities[3]), record_key(identities[4])}
    assert rig.stack.traffic.demoted == 5
    blocks, loaded = load_back(rig, tokens, 5)
    assert loaded == 5
    assert all(bit_equal(rig.cache[block], kv[i]) for i, block in enumerate(blocks))
    traffic = rig.stack.traffic
    assert (traffic.loaded_from_cpu, traffic.loaded_from_disk) == (3, 2)
    rig.stack.close()


def test_without_a_cpu_tier_demotions_go_straight_to_disk(
    tmp_path: Path, tokens: list[int]
) -> None:
    rig = TieredCache(16, cpu_slots=0, disk_dir=tmp_path)
    kv = rig.compute(tokens)
    rig.evict_to_tiers()
    assert rig.stack.traffic.demoted == 10 and rig.tier("disk").metrics().num_blocks == 10
    blocks, loaded = load_back(rig, tokens, 10)
    assert loaded == 10 and rig.stack.traffic.loaded_from_disk == 10
    assert all(bit_equal(rig.cache[block], kv[i]) for i, block in enumerate(blocks))
    rig.stack.close()


def test_a_written_through_block_is_still_demoted_to_the_cpu_tier(
    tmp_path: Path, tokens: list[int]
) -> None:
    """Already on disk is no reason to skip the CPU tier: it is the faster way back."""
    rig = TieredCache(16, cpu_slots=16, disk_dir=tmp_path)
    rig.compute(tokens, persist=True)
    rig.stack.flush()
    assert rig.stack.traffic.persisted == 10 and rig.tier("disk").metrics().num_blocks == 10
    rig.evict_to_tiers()
    assert rig.stack.traffic.demoted == 10 and rig.tier("cpu").metrics().num_blocks == 10
    load_back(rig, tokens, 10)
    assert (rig.stack.traffic.loaded_from_cpu, rig.stack.traffic.loaded_from_disk) == (10, 0)
    rig.stack.close()


def test_persisted_blocks_survive_a_restart_demoted_ones_only_in_memory_do_not(
    tmp_path: Path, tokens: list[int]
) -> None:
    rig = TieredCache(16, cpu_slots=16, disk_dir=tmp_path)
    first, second = tokens[: 5 * 4], [500 + t for t in tokens[: 5 * 4]]
    kv = rig.compute(first, persist=True)
    rig.compute(second)  # write-back only: demoted to the CPU tier, never to disk
    rig.evict_to_tiers()
    rig.stack.close()
    restarted = TieredCache(16, cpu_slots=16, disk_dir=tmp_path)
    blocks, loaded = load_back(restarted, first, 5)
    assert loaded == 5 and restarted.stack.traffic.loaded_from_disk == 5
    assert all(bit_equal(restarted.cache[block], kv[i]) for i, block in enumerate(blocks))
    assert not any(restarted.stack.contains(identity) for identity in chain(second))
    restarted.stack.close()


# ------------------------------------------------------------------------- write-through
class QueueTier(KVTier):
    """A persistent tier whose room the test controls; it records every put."""

    name = "disk"
    persistent = True

    def __init__(self) -> None:
        self.block_shape, self.dtype, self.capacity_bytes = SHAPE, torch.float32, 1 << 20
        self.room = True
        self.puts: list[tuple[bytes, bool]] = []  # (block hash, blocking)

    def contains(self, meta: BlockLike) -> bool:
        return any(block_hash == meta.block_hash for block_hash, _ in self.puts)

    def load_into(self, meta: BlockLike, dest: torch.Tensor) -> bool:
        return False

    def put(self, meta: BlockLike, block: torch.Tensor, *, blocking: bool = False) -> bool:
        if not (self.room or blocking):
            return False
        self.puts.append((meta.block_hash, blocking))
        return True

    def has_room(self) -> bool:
        return self.room

    def discard(self, meta: BlockLike) -> bool:
        return False

    def metrics(self) -> TierMetrics:
        return TierMetrics(capacity_bytes=self.capacity_bytes, num_blocks=len(self.puts))


def test_write_through_waits_in_a_backlog_until_there_is_room(tokens: list[int]) -> None:
    durable = QueueTier()
    cache, pool = torch.zeros((16, *SHAPE)), BlockPool(16)
    stack = TierStack([durable], cache, pool)
    pool.add_eviction_hook(stack.demote)
    identities = chain(tokens)[:4]
    blocks = pool.allocate(4)
    for block, identity in zip(blocks, identities, strict=True):
        assert pool.register(block, identity)
    stack.persist(blocks[0], identities[0])
    durable.room = False
    stack.persist(blocks[1], identities[1])
    durable.room = True
    stack.persist(blocks[2], identities[2])  # behind the backlog: order is kept
    assert durable.puts == [(identities[0].block_hash, False)]
    stack.drain_backlog()
    assert [block_hash for block_hash, _ in durable.puts] == [i.block_hash for i in identities[:3]]
    assert stack.traffic.persisted == 3

    durable.room = False
    stack.persist(blocks[3], identities[3])
    stack.drain_backlog()  # still no room: nothing is dropped, the block waits
    assert len(durable.puts) == 3
    pool.release(blocks)
    pool.evict_all_free()  # the device block's last chance: a blocking put
    assert durable.puts[-1] == (identities[3].block_hash, True)
    assert stack.traffic.persisted == 4


def test_close_writes_the_backlog(tokens: list[int]) -> None:
    durable = QueueTier()
    cache, pool = torch.zeros((4, *SHAPE)), BlockPool(4)
    stack = TierStack([durable], cache, pool)
    identity = chain(tokens)[0]
    [block] = pool.allocate(1)
    pool.register(block, identity)
    durable.room = False
    stack.persist(block, identity)
    stack.close()
    assert durable.puts == [(identity.block_hash, True)] and stack.traffic.persisted == 1


def test_without_a_persistent_tier_persist_is_a_no_op(tokens: list[int]) -> None:
    rig = TieredCache(16, cpu_slots=16)
    rig.compute(tokens, persist=True)
    assert rig.stack.traffic.persisted == 0 and rig.tier("cpu").metrics().num_blocks == 0


# ------------------------------------------------------------------------- loads
def test_loads_a_mixed_cpu_and_disk_run_and_reports_its_leading_hits(
    tmp_path: Path, tokens: list[int]
) -> None:
    rig = TieredCache(16, cpu_slots=4, disk_dir=tmp_path)  # 10 blocks: 6 spill to disk
    kv = rig.compute(tokens)
    rig.evict_to_tiers()
    identities = chain(tokens)
    assert sum(rig.tier("cpu").contains(identity) for identity in identities) == 4
    assert all(rig.stack.contains(identity) for identity in identities)
    blocks = rig.pool.allocate(10)
    assert rig.stack.load_many(identities, blocks) == 10
    assert all(bit_equal(rig.cache[block], kv[i]) for i, block in enumerate(blocks))
    traffic = rig.stack.traffic
    assert (traffic.loaded_from_cpu, traffic.loaded_from_disk) == (4, 6)
    assert traffic.load_seconds > 0

    rig.tier("disk").discard(identities[7])  # a miss in the middle: 7 leading blocks count
    assert rig.stack.load_many(identities, blocks) == 7
    assert traffic.discarded_loads == 2  # blocks 8 and 9 loaded, past the miss
    with pytest.raises(ValueError, match="10 blocks to load but 2 device blocks"):
        rig.stack.load_many(identities, blocks[:2])
    assert rig.stack.load_many([], []) == 0
    rig.pool.release(blocks)
    rig.pool.check_invariants()
    rig.stack.close()


# ------------------------------------------------------------------------- shape and report
def test_from_budgets_describes_its_tiers(tmp_path: Path) -> None:
    cache, pool = torch.zeros((4, *SHAPE)), BlockPool(4)
    stack = TierStack.from_budgets(
        cache, pool, cpu_gib=3 * NBYTES / GIB, disk_gib=1 / 1024, disk_dir=tmp_path / "kv"
    )
    assert stack.describe() == (
        TierInfo("cpu", 3 * NBYTES, None),
        TierInfo("disk", (1 << 30) // 1024, str(tmp_path / "kv")),
    )
    metrics = stack.metrics()
    assert list(metrics) == ["cpu", "disk"] and metrics["disk"].capacity_bytes == (1 << 30) // 1024
    assert stack.block_nbytes == NBYTES
    stack.close()


def test_from_budgets_leaves_out_a_zero_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cache, pool = torch.zeros((4, *SHAPE)), BlockPool(4)
    disk_only = TierStack.from_budgets(cache, pool, cpu_gib=0, disk_gib=1 / 1024)
    assert [info.name for info in disk_only.describe()] == ["disk"]
    assert disk_only.describe()[0].location == str(resolve_disk_dir(None))
    disk_only.close()
    cpu_only = TierStack.from_budgets(cache, BlockPool(4), cpu_gib=NBYTES / GIB, disk_gib=0)
    assert [info.name for info in cpu_only.describe()] == ["cpu"]
    with pytest.raises(ValueError, match="at least one tier"):
        TierStack.from_budgets(cache, BlockPool(4), cpu_gib=0, disk_gib=0)


def test_a_tier_is_wired_into_one_stack_only() -> None:
    cpu = CpuTier(SHAPE, torch.float32, 2 * NBYTES)
    lower = QueueTier()
    TierStack([cpu, lower], torch.zeros((4, *SHAPE)), BlockPool(4))
    with pytest.raises(ValueError, match="already has an eviction callback"):
        TierStack([cpu, QueueTier()], torch.zeros((4, *SHAPE)), BlockPool(4))
    with pytest.raises(ValueError, match="distinct"):
        TierStack([QueueTier(), QueueTier()], torch.zeros((4, *SHAPE)), BlockPool(4))
