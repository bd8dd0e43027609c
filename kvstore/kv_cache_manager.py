"""Per-sequence KV bookkeeping on top of the block pool: block tables, prefix hits, sharing.

The scheduler talks to this class only; it never sees blocks' internals. A sequence's
state lives in its ``KVAllocation``; the manager updates it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.block_pool import BlockIdentity, BlockPool
from kvstore.hashing import ROOT_PARENT, BlockHash, hash_full_blocks
from kvstore.tier_link import TierLink


@dataclass(eq=False)
class KVAllocation:
    """One sequence's view of the cache: its block table and its full blocks' hashes."""

    salt: bytes
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_registered: int = 0  # leading blocks already indexed in the prefix cache
    persist: bool = False  # write computed blocks through to disk at once


@dataclass
class CacheCounters:
    """Engine-wide prefix-cache accounting (tokens are prompt tokens at admission)."""

    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        enable_prefix_caching: bool,
        tiers: TierLink | None = None,
        max_loads_per_step: int = 256,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.tiers = tiers if enable_prefix_caching else None
        # Tier loads per match: a long document streams in over several steps while
        # other sequences keep decoding.
        self.max_loads_per_step = max_loads_per_step
        if self.tiers is not None:
            pool.add_eviction_hook(self.tiers.demote)
        self.counters = CacheCounters()
        # Hashes of blocks some sequence is computing right now: another sequence reading
        # the same prefix waits for them instead of computing them twice.
        self._pending: dict[BlockHash, KVAllocation] = {}

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_hashes(self, alloc: KVAllocation, token_ids: Sequence[int]) -> None:
        """Extend ``alloc.block_hashes`` with the blocks that ``token_ids`` now fill."""
        if not self.enable_prefix_caching:
            return
        known = len(alloc.block_hashes)
        if len(token_ids) < (known + 1) * self.block_size:
            return
        parent = alloc.block_hashes[-1] if known else ROOT_PARENT
        alloc.block_hashes += hash_full_blocks(
            alloc.salt, token_ids, self.block_size, parent=parent, start_block=known
        )

    def _identity(self, alloc: KVAllocation, token_ids: Sequence[int], index: int) -> BlockIdentity:
        start = index * self.block_size
        return BlockIdentity(
            block_hash=alloc.block_hashes[index],
            parent_hash=alloc.block_hashes[index - 1] if index else ROOT_PARENT,
            salt=alloc.salt,
            token_ids=tuple(token_ids[start : start + self.block_size]),
        )

    def match_prefix(
        self,
        alloc: KVAllocation,
        token_ids: Sequence[int],
        num_computed: int,
        leave_one: bool = True,
    ) -> int:
        """Share cached blocks that continue the sequence's computed prefix.

        Returns the new number of computed tokens. With ``leave_one`` at least one token is
        left to compute, since the last prompt token's logits are needed.
        """
        if not self.enable_prefix_caching or num_computed % self.block_size:
            return num_computed
        index = num_computed // self.block_size
        if len(alloc.block_table) != index:
            return num_computed  # blocks past the computed prefix are already private
        usable = len(token_ids) - 1 if leave_one else len(token_ids)
        limit = min(len(alloc.block_hashes), usable // self.block_size)
        loads = 0
        while index < limit:
            identity = self._identity(alloc, token_ids, index)
            block = self.pool.lookup(identity)
            if block is not None:
                self.pool.share(block)
            elif loads < self.max_loads_per_step and self._in_tiers(identity):
                block = self._load(identity)
                loads += 1
            if block is None:
                break
            alloc.block_table.append(block)
            index += 1
        alloc.num_registered = max(alloc.num_registered, index)
        return index * self.block_size

    def _in_tiers(self, identity: BlockIdentity) -> bool:
        return self.tiers is not None and self.pool.num_free > 0 and self.tiers.contains(identity)

    def _load(self, identity: BlockIdentity) -> int | None:
        """A fresh device block holding ``identity`` from a lower tier, or None on a miss."""
        assert self.tiers is not None
        [block] = self.pool.allocate(1)
        if not self.tiers.load(identity, block):
            self.pool.release([block])
            return None
        self.pool.register(block, identity)
        return block

    def has_more_to_load(self, alloc: KVAllocation, token_ids: Sequence[int], num_computed: int) -> bool:
        """True if the next block to compute can be loaded from a tier in a later step instead."""
        index = num_computed // self.block_size
        if self.tiers is None or num_computed % self.block_size or len(alloc.block_table) != index:
            return False
        if index >= min(len(alloc.block_hashes), (len(token_ids) - 1) // self.block_size):
            return False
        identity = self._identity(alloc, token_ids, index)
        return self.pool.lookup(identity) is None and self.tiers.contains(identity)

    def waits_for_other(self, alloc: KVAllocation, num_computed: int) -> bool:
        """True if the next block this sequence would compute is being computed by another."""
        if not self.enable_prefix_caching or num_computed % self.block_size:
            return False
        index = num_computed // self.block_size
        if index >= len(alloc.block_hashes):
            return False
        owner = self._pending.get(alloc.block_hashes[index])
        return owner is not None and owner is not alloc

    def can_allocate(self, alloc: KVAllocation, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(alloc.block_table) <= self.pool.num_free

    def allocate(self, alloc: KVAllocation, num_tokens: int) -> bool:
        """Grow the block table to hold ``num_tokens`` tokens. False (and no change) if full."""
        missing = self.blocks_needed(num_tokens) - len(alloc.block_table)
        if missing > self.pool.num_free:
            return False
        if missing > 0:
            alloc.block_table += self.pool.allocate(missing)
        if self.enable_prefix_caching:
            # NOTE: a block counts as being computed from its first scheduled token on, so
            # a reader never duplicates a block another sequence is halfway through.
            touched = min(self.blocks_needed(num_tokens), len(alloc.block_hashes))
            for index in range(alloc.num_registered, touched):
                self._pending.setdefault(alloc.block_hashes[index], alloc)
        return True

    def commit(self, alloc: KVAllocation, token_ids: Sequence[int], num_computed: int) -> None:
        """Index the full blocks whose KV is now computed, so other sequences can hit them."""
        if not self.enable_prefix_caching:
            return
        full = min(num_computed // self.block_size, len(alloc.block_hashes))
        for index in range(alloc.num_registered, full):
            identity = self._identity(alloc, token_ids, index)
            if self._pending.get(identity.block_hash) is alloc:
                del self._pending[identity.block_hash]
            block = alloc.block_table[index]
            if self.pool.register(block, identity) and alloc.persist and self.tiers is not None:
                self.tiers.persist(block, identity)
        alloc.num_registered = max(alloc.num_registered, full)

    def free(self, alloc: KVAllocation) -> None:
        """Release every block; the chain's tail is released first so it is evicted first."""
        for block_hash in alloc.block_hashes[alloc.num_registered :]:
            if self._pending.get(block_hash) is alloc:
                del self._pending[block_hash]
        self.pool.release(reversed(alloc.block_table))
        alloc.block_table = []
        alloc.num_registered = 0

    def record_admission(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.counters.queried_tokens += num_prompt_tokens
        self.counters.hit_tokens += num_hit_tokens

    def reset_prefix_cache(self) -> int:
        return self.pool.evict_all_free()
