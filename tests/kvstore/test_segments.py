"""Segments: their own hash domain, private to a tenant, found on the device and in every
tier like prefix blocks, and verified like them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstore.hashing import hash_full_blocks, make_salt
from kvstore.kv_cache_manager import KVAllocation
from kvstore.segments import Segment, hold_segment, make_segment, release_segment, segment_salt
from tests.kvstore.tiered_cache import BS, SALT, TieredCache, block_for

TEMPLATE = [1, 2, 3, 4, 5, 6]
DOC = list(range(40, 57))  # 17 tokens: template + doc = 23 = 5 full blocks + 3


def store(rig: TieredCache, segment: Segment) -> list[torch.Tensor]:
    """'Compute' the segment with random KV, index it and release it; its blocks' KV."""
    alloc = KVAllocation(salt=segment.salt)
    rig.manager.update_hashes(alloc, segment.token_ids)
    assert rig.manager.allocate(alloc, len(segment.token_ids))
    kv = []
    for index, block in enumerate(alloc.block_table):
        rig.cache[block] = block_for(77 + index)
        kv.append(rig.cache[block].clone())
    rig.manager.commit(alloc, segment.token_ids, len(segment.token_ids))
    rig.manager.free(alloc)
    return kv[: len(segment.hashes)]


def read(rig: TieredCache, segment: Segment) -> tuple[int, list[torch.Tensor]]:
    hold = hold_segment(rig.manager, segment)
    kv = [rig.cache[block].clone() for block in hold.alloc.block_table]
    release_segment(rig.manager, hold)
    return hold.tokens, kv


def test_segment_keys_are_their_own_domain_and_per_tenant() -> None:
    segment = make_segment(SALT, TEMPLATE, DOC, BS)
    prefix = hash_full_blocks(SALT, TEMPLATE + DOC, BS)
    assert len(segment.hashes) == len(prefix) == 5
    assert not set(segment.hashes) & set(prefix)
    assert segment.stored_document_tokens == 5 * BS - len(TEMPLATE)
    other = make_salt("batched-loads-test", BS, "float32", "tenant-b")
    assert segment_salt(other) != segment.salt
    assert not set(make_segment(other, TEMPLATE, DOC, BS).hashes) & set(segment.hashes)


def test_segment_is_found_on_device_cpu_and_disk(tmp_path: Path) -> None:
    rig = TieredCache(num_blocks=12, cpu_slots=2, disk_dir=tmp_path)
    segment = make_segment(SALT, TEMPLATE, DOC, BS)
    kv = store(rig, segment)
    # A prompt starting with the same tokens does not hit the segment, nor the reverse.
    assert rig.manager.match_prefix(rig.alloc(TEMPLATE + DOC), TEMPLATE + DOC, 0) == 0
    held, got = read(rig, segment)
    assert held == len(segment.hashes) * BS and all(map(torch.equal, got, kv))
    rig.evict_to_tiers()  # 2 blocks in the CPU tier, the rest on disk
    assert rig.pool.num_cached == 0
    held, got = read(rig, segment)
    assert held == len(segment.hashes) * BS
    assert all(map(torch.equal, got, kv))
    assert rig.stack.tiers[1].name == "disk"
    rig.pool.check_invariants()
    assert rig.pool.num_used == 0


def test_other_tenant_does_not_find_the_segment() -> None:
    rig = TieredCache(num_blocks=12, cpu_slots=6)
    store(rig, make_segment(SALT, TEMPLATE, DOC, BS))
    other = make_salt("batched-loads-test", BS, "float32", "tenant-b")
    assert read(rig, make_segment(other, TEMPLATE, DOC, BS))[0] == 0
    rig.evict_to_tiers()
    assert read(rig, make_segment(other, TEMPLATE, DOC, BS))[0] == 0
    assert read(rig, make_segment(SALT, TEMPLATE, DOC, BS))[0] == 5 * BS


def test_a_tier_fault_while_holding_a_segment_gives_its_device_blocks_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rig = TieredCache(num_blocks=12, cpu_slots=8)
    segment = make_segment(SALT, TEMPLATE, DOC, BS)
    store(rig, segment)
    hold = hold_segment(rig.manager, segment)
    first_two = hold.alloc.block_table[:2]
    release_segment(rig.manager, hold)
    for block in first_two:  # NOTE: most recently used: they stay on the device
        rig.pool.share(block)
    rig.pool.release(first_two)
    others = rig.pool.allocate(rig.pool.num_free - 2)  # evicts the other three to the tier
    rig.pool.release(others)
    rig.stack.flush()

    def device_error(*args: object, **kwargs: object) -> None:
        raise RuntimeError("device error during the copy")

    monkeypatch.setattr(rig.stack, "load_many", device_error)
    with pytest.raises(RuntimeError, match="device error"):
        hold_segment(rig.manager, segment)
    rig.pool.check_invariants()
    assert rig.pool.num_used == 0
