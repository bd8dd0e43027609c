"""Per-sequence KV bookkeeping on top of the block pool: block tables, prefix hits, sharing.

The scheduler talks to this class only; it never sees blocks' internals. A sequence's
state lives in its ``KVAllocation``; the manager updates it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.block_pool import BlockIdentity, BlockPool
from kvstore.hashing import ROOT_PARENT, BlockHash, hash_full_blocks


@dataclass(eq=False)
class KVAllocation:
    """One sequence's view of the cache: its block table and its full blocks' hashes."""

    salt: bytes
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_registered: int = 0  # leading blocks already indexed in the prefix cache


@dataclass
class CacheCounters:
    """Engine-wide prefix-cache accounting (tokens are prompt tokens at admission)."""

    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
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
        while index < limit:
            block = self.pool.lookup(self._identity(alloc, token_ids, index))
            if block is None:
                break
            self.pool.share(block)
            alloc.block_table.append(block)
            index += 1
        alloc.num_registered = max(alloc.num_registered, index)
        return index * self.block_size

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
            self.pool.register(alloc.block_table[index], identity)
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
