"""Pinned prefixes (uploaded documents): references that keep their blocks from eviction.

Pins live under a budget, so that they never starve requests of blocks, nor one tenant's
pins another's: all pins together hold at most ``MAX_PINNED_FRACTION`` of the device
blocks, and one namespace at most its share of that.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from kvstore.block_pool import BlockPool
from kvstore.kv_cache_manager import KVAllocation, KVCacheManager
from kvstore.tier_stack import TierStack

logger = logging.getLogger(__name__)

MAX_PINNED_FRACTION = 0.5


class _Pin(NamedTuple):
    """A pinned prefix and the namespace whose share of the pin budget it counts against."""

    namespace: str
    alloc: KVAllocation


class PrefixPins:
    def __init__(self, kv_manager: KVCacheManager, block_pool: BlockPool) -> None:
        self.kv_manager = kv_manager
        self.block_pool = block_pool
        self._pins: dict[str, _Pin] = {}

    def pin(
        self,
        pin_id: str,
        alloc: KVAllocation,
        token_ids: list[int],
        namespace: str,
        namespace_share: float,
        tiers: TierStack | None,
    ) -> int:
        """Hold the cached full blocks of ``token_ids`` (hashed with ``alloc``'s salt).

        Returns how many leading tokens are pinned (the cached full blocks found now), or 0
        when the pin would break the budget. Either way the blocks are persisted to the
        tiers below: a document outlives a restart whether or not it could be pinned.
        """
        if not 0.0 <= namespace_share <= 1.0:
            raise ValueError(f"namespace_share must be in [0, 1], got {namespace_share}")
        self.unpin(pin_id)
        self.kv_manager.update_hashes(alloc, token_ids)
        self.kv_manager.begin_step()  # between steps: a step's worth of tier loads
        try:
            pinned = self.kv_manager.match_prefix(alloc, token_ids, 0, leave_one=False)
        except BaseException:  # NOTE: a tier's copy fault: the blocks shared so far go back
            self.kv_manager.free(alloc)
            raise
        if tiers is not None:  # documents persist, pinned or not, whoever computed them
            self._persist(alloc, tiers)
        blocks = set(alloc.block_table)
        limit = int(self.block_pool.num_blocks * MAX_PINNED_FRACTION)
        own_limit = int(limit * namespace_share)
        own = {
            b
            for pin in self._pins.values()
            if pin.namespace == namespace
            for b in pin.alloc.block_table
        }
        if len(self.blocks() | blocks) > limit or len(own | blocks) > own_limit:
            # NOTE: the document stays cached (and on disk with a disk tier: persisted above),
            # just evictable.
            self.kv_manager.free(alloc)
            logger.warning(
                "not pinning %s: pins would hold more than %d of %d KV blocks, or this "
                "namespace's more than %d",
                pin_id,
                limit,
                self.block_pool.num_blocks,
                own_limit,
            )
            return 0
        self._pins[pin_id] = _Pin(namespace, alloc)
        return pinned

    def _persist(self, alloc: KVAllocation, tiers: TierStack) -> None:
        """Write the blocks of ``alloc`` the disk tier lacks through to it (and offer them
        to the shared store): computed here, loaded from a tier, or found cached."""
        for block in alloc.block_table:
            identity = self.block_pool.identities[block]
            if identity is not None and not tiers.persisted(identity):
                tiers.persist(block, identity)

    def unpin(self, pin_id: str) -> bool:
        pin = self._pins.pop(pin_id, None)
        if pin is None:
            return False
        self.kv_manager.free(pin.alloc)
        return True

    def blocks(self) -> set[int]:
        """Device blocks held by pins (a block shared by two pins counts once)."""
        return {block for pin in self._pins.values() for block in pin.alloc.block_table}
