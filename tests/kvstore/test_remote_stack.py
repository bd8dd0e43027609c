"""The remote tier in a stack: beside the local chain, given every demoted and persisted
block, read after the local tiers, and one round trip for a run of blocks."""

from __future__ import annotations

import redis

from kvstore.block_pool import BlockPool
from kvstore.cpu_tier import CpuTier
from kvstore.kv_cache_manager import KVCacheManager
from kvstore.remote_tier import RemoteTier
from kvstore.tier import block_nbytes
from kvstore.tier_stack import TierStack
from tests.kvstore.tier_blocks import bit_equal
from tests.kvstore.tiered_cache import SHAPE, TieredCache, chain
from tests.valkey_server import ValkeyServer

TOKENS = list(range(10 * 4 + 2))  # 10 full blocks and a partial one


def calls(client: redis.Redis, command: str) -> int:
    stats = client.info("commandstats").get(f"cmdstat_{command}")
    return int(stats["calls"]) if stats else 0


def test_demoted_blocks_go_to_the_cpu_tier_and_the_store(valkey: ValkeyServer) -> None:
    rig = TieredCache(16, cpu_slots=3, remote_url=valkey.url)
    kv = rig.compute(TOKENS[: 5 * 4])
    rig.evict_to_tiers()
    identities = chain(TOKENS)[:5]
    cpu, remote = rig.tier("cpu"), rig.tier("remote")
    # The CPU tier kept the last three demoted (its evictions go nowhere: no disk); the
    # store has all five.
    assert [cpu.contains(identity) for identity in identities] == [True] * 3 + [False] * 2
    assert remote.contains_many(identities) == [True] * 5
    assert rig.stack.traffic.demoted == 5 and rig.stack.traffic.published == 5
    blocks = rig.pool.allocate(5)
    assert rig.stack.load_many(identities, blocks) == 5
    assert all(bit_equal(rig.cache[block], kv[i]) for i, block in enumerate(blocks))
    traffic = rig.stack.traffic
    assert (traffic.loaded_from_cpu, traffic.loaded_from_remote) == (3, 2)
    rig.stack.close()


def test_persisted_blocks_reach_a_fresh_engine_in_one_round_trip(valkey: ValkeyServer) -> None:
    first = TieredCache(16, cpu_slots=0, remote_url=valkey.url)
    kv = first.compute(TOKENS, persist=True)  # written through at once, never evicted
    first.stack.close()
    client = valkey.client()
    assert client.dbsize() == 10

    second = TieredCache(16, cpu_slots=0, remote_url=valkey.url)
    before = {command: calls(client, command) for command in ("exists", "mget", "get")}
    alloc = second.alloc(TOKENS)
    assert second.manager.match_prefix(alloc, TOKENS, 0) == 10 * 4
    after = {command: calls(client, command) - before[command] for command in before}
    assert after == {"exists": 10, "mget": 1, "get": 0}  # one pipeline, one MGET
    assert all(bit_equal(second.cache[alloc.block_table[i]], kv[i]) for i in range(10))
    assert alloc.loaded_blocks == {"remote": 10}
    second.manager.free(alloc)
    second.stack.close()


def test_a_prompt_nothing_holds_is_asked_about_once(valkey: ValkeyServer) -> None:
    rig = TieredCache(16, cpu_slots=2, remote_url=valkey.url)
    client = valkey.client()
    before = calls(client, "exists")
    alloc = rig.alloc(TOKENS)
    assert rig.manager.match_prefix(alloc, TOKENS, 0) == 0
    assert calls(client, "exists") - before == 10  # in one pipeline
    # Asked again at once (the next step of a prefill): remembered, no round trip.
    assert not rig.manager.has_more_to_load(alloc, TOKENS, 0)
    assert rig.manager.match_prefix(alloc, TOKENS, 0) == 0
    assert calls(client, "exists") - before == 10
    rig.manager.free(alloc)
    rig.stack.close()


def test_shared_tiers_come_after_the_chain(valkey: ValkeyServer) -> None:
    import pytest
    import torch

    nbytes = block_nbytes(SHAPE, torch.float32)
    remote = RemoteTier(SHAPE, torch.float32, valkey.url)
    cpu = CpuTier(SHAPE, torch.float32, 4 * nbytes)
    with pytest.raises(ValueError, match="shared tiers come after"):
        TierStack([remote, cpu], torch.zeros((4, *SHAPE)), BlockPool(4))
    stack = TierStack([cpu, remote], torch.zeros((4, *SHAPE)), BlockPool(4))
    assert cpu.on_evict is None  # nothing is handed into the shared tier
    KVCacheManager(stack.pool, 4, True, tiers=stack)
    stack.close()


def test_a_run_continues_from_the_local_tiers_into_the_store(valkey: ValkeyServer) -> None:
    rig = TieredCache(16, cpu_slots=3, remote_url=valkey.url)
    kv = rig.compute(TOKENS[: 6 * 4])
    rig.evict_to_tiers()  # the CPU tier keeps blocks 0-2; the store has all six
    identities = chain(TOKENS)[:6]
    assert rig.stack.leading_present(identities) == 6
    assert rig.tier("remote").discard(identities[4])
    assert rig.stack.leading_present(identities) == 4
    alloc = rig.alloc(TOKENS)
    assert rig.manager.match_prefix(alloc, TOKENS, 0) == 4 * 4
    assert alloc.loaded_blocks == {"cpu": 3, "remote": 1}
    assert all(bit_equal(rig.cache[alloc.block_table[i]], kv[i]) for i in range(4))
    rig.manager.free(alloc)
    rig.stack.close()
