"""An allocation counts the blocks each tier served it, for the usage report."""

from __future__ import annotations

from pathlib import Path

from tests.kvstore.tiered_cache import BS, TieredCache


def test_loaded_blocks_are_counted_per_tier(tmp_path: Path) -> None:
    tokens = list(range(100, 100 + 6 * BS))
    cache = TieredCache(num_blocks=16, cpu_slots=3, disk_dir=tmp_path)
    cache.compute(tokens, persist=True)
    cache.stack.flush()
    cache.evict_to_tiers()  # the CPU tier keeps 3 blocks; all 6 are on disk
    alloc = cache.alloc(tokens + [1])
    cache.manager.begin_step()
    computed = cache.manager.match_prefix(alloc, tokens + [1], 0)
    assert computed == 6 * BS
    assert sum(alloc.loaded_blocks.values()) == 6
    assert alloc.loaded_blocks.get("disk", 0) >= 3 and alloc.loaded_blocks.get("cpu", 0) >= 1
    cache.manager.free(alloc)


def test_the_split_always_sums_to_the_cached_tokens() -> None:
    from ragserve.engine.engine_request import split_by_tier

    assert split_by_tier(64, {}, 16) == {"device": 64}
    assert split_by_tier(64, {"disk": 1, "cpu": 2}, 16) == {"device": 16, "cpu": 32, "disk": 16}
    assert split_by_tier(32, {"disk": 5}, 16) == {
        "device": 0,
        "disk": 32,
    }  # loaded twice (preempted)
