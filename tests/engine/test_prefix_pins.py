"""Pinning a document whose blocks come back from a tier: a copy fault while loading them
fails the pin and leaves no block held (a real pool, CPU tier and manager; no model)."""

from __future__ import annotations

import pytest

from kvstore.kv_cache_manager import KVAllocation
from ragserve.engine.prefix_pins import PrefixPins
from tests.kvstore.tiered_cache import SALT, TieredCache


def test_a_tier_fault_while_pinning_leaves_no_block_held(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = TieredCache(16, cpu_slots=16)
    tokens = list(range(10 * 4))
    rig.compute(tokens[:16])  # NOTE: the first 4 blocks stay on the device, shared by the pin
    rig.compute(tokens)
    rig.evict_to_tiers()
    rig.compute(tokens[:16])
    cpu = rig.tier("cpu")

    def fault(*args: object, **kwargs: object) -> list[bool]:
        raise RuntimeError("copy fault")

    monkeypatch.setattr(cpu, "load_rows_into", fault)
    monkeypatch.setattr(cpu, "load_many_into", fault)
    pins = PrefixPins(rig.manager, rig.pool)
    with pytest.raises(RuntimeError, match="copy fault"):
        pins.pin("doc", KVAllocation(salt=SALT), tokens, "", 1.0, rig.stack)
    assert not pins.blocks()
    rig.pool.check_invariants()
    assert rig.pool.num_used == 0
