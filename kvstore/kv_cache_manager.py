"""Per-sequence KV bookkeeping on top of the block pool: block tables, prefix hits, sharing.

The scheduler talks to this class only; it never sees blocks' internals. A sequence's
state lives in its ``KVAllocation``; the manager updates it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstore.block_pool import BlockIdentity, BlockPool
from kvstore.hashing import ROOT_PARENT, BlockHash, BlockHashMemo, hash_full_blocks
from kvstore.purge import PurgeCounts, doomed_blocks, first_doomed
from kvstore.tier import BlockMeta, salt_fingerprint
from kvstore.tier_stack import TierStack

# NOTE: 1 GiB is ~20 ms of pinned host-to-device copies on an NVIDIA H200 (512 blocks of
# a Llama-3.1-8B-shaped cache): a 128k-token document streams in over 16 steps, and other
# sequences decode between them.
DEFAULT_MAX_LOAD_BYTES_PER_STEP = 1 << 30
# NOTE: tier loads are verified and queued this many blocks at a time: the first copies
# start after 64 blocks' bookkeeping, not after a whole step's (1,024 blocks
# of an FP8 cache), and the later batches' bookkeeping runs while earlier copies do.
LOAD_BATCH_BLOCKS = 64


@dataclass(eq=False)
class KVAllocation:
    """One sequence's view of the cache: its block table and its full blocks' hashes."""

    salt: bytes
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_registered: int = 0  # leading blocks already indexed in the prefix cache
    persist: bool = False  # write computed blocks through to disk at once
    # Blocks from this index on are never indexed (nor written to a tier): a purge doomed
    # them while this sequence was live (see ``KVCacheManager.purge``). None: no limit.
    register_limit: int | None = None
    # Blocks loaded into this allocation from each tier (by tier name), over its life.
    loaded_blocks: dict[str, int] = field(default_factory=dict)
    # The step in which a load of its next block could not make progress (no free block,
    # or the tier's read failed): it computes that block instead of waiting for it.
    load_stalled_step: int = -1


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
        tiers: TierStack | None = None,
        max_load_bytes_per_step: int = DEFAULT_MAX_LOAD_BYTES_PER_STEP,
    ) -> None:
        if max_load_bytes_per_step < 1:
            raise ValueError(f"max_load_bytes_per_step must be >= 1, got {max_load_bytes_per_step}")
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.tiers = tiers if enable_prefix_caching else None
        # Tier bytes loaded per step, over all sequences: a long document streams in over
        # several steps while other sequences keep decoding. At least one block.
        self.max_load_bytes_per_step = max_load_bytes_per_step
        if self.tiers is not None:
            pool.add_eviction_hook(self.tiers.demote)
        self.counters = CacheCounters()
        # Hashes of blocks some sequence is computing right now: another sequence reading
        # the same prefix waits for them instead of computing them twice.
        self._pending: dict[BlockHash, KVAllocation] = {}
        self._loads_left = self.max_loads_per_step
        self._step = 0
        # Runs of block hashes seen lately: a new question on a long document re-hashes it.
        self.hash_memo = BlockHashMemo()

    @property
    def max_loads_per_step(self) -> int:
        """Blocks the ``match_prefix`` calls of one step may load from the tiers (0 without)."""
        if self.tiers is None:
            return 0
        return max(1, self.max_load_bytes_per_step // self.tiers.block_nbytes)

    def begin_step(self) -> None:
        """Refill the tier-load budget that the next ``match_prefix`` calls share."""
        self._loads_left = self.max_loads_per_step
        self._step += 1

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_hashes(self, alloc: KVAllocation, token_ids: Sequence[int] | np.ndarray) -> None:
        """Extend ``alloc.block_hashes`` with the blocks that ``token_ids`` (the sequence's
        ids: a list, or an integer array of them) now fill."""
        if not self.enable_prefix_caching:
            return
        known = len(alloc.block_hashes)
        if len(token_ids) < (known + 1) * self.block_size:
            return
        parent = alloc.block_hashes[-1] if known else ROOT_PARENT
        alloc.block_hashes += hash_full_blocks(
            alloc.salt, token_ids, self.block_size, parent, known, self.hash_memo
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

        Device hits are shared; a run of consecutive tier hits after them is loaded into
        fresh device blocks as one batch, within what is left of the step's load budget
        (see ``begin_step``).
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
            shared = self.pool.share_chain(
                alloc.salt, alloc.block_hashes, token_ids, self.block_size, index, limit
            )
            alloc.block_table += shared
            index += len(shared)
            if index == limit:
                break
            identity = self._identity(alloc, token_ids, index)
            stop = min(limit, index + self._loads_left, index + LOAD_BATCH_BLOCKS)
            loaded = self._load_run(alloc, token_ids, identity, index, stop)
            if not loaded:
                if stop > index:
                    # NOTE: no progress with budget left: waiting would not help (nothing
                    # frees a block while pins hold the rest; a failed read fails again).
                    alloc.load_stalled_step = self._step
                break
            index += loaded
            self._loads_left -= loaded
        alloc.num_registered = max(alloc.num_registered, index)
        return index * self.block_size

    def _load_run(
        self,
        alloc: KVAllocation,
        token_ids: Sequence[int],
        first: BlockIdentity,
        start: int,
        stop: int,
    ) -> int:
        """Load blocks ``start..stop-1`` (the first is ``first``, not on the device) from the
        tiers in one batch, up to the first one no tier holds, one already on the device,
        or the first load that misses. The loaded blocks join the block table and the
        prefix-cache index; returns how many.
        """
        if self.tiers is None or start >= stop:
            return 0
        candidates: list[BlockIdentity] = []
        room = min(stop - start, self.pool.num_free)
        for index in range(start, start + room):
            identity = first if index == start else self._identity(alloc, token_ids, index)
            if index > start and self.pool.lookup(identity) is not None:
                break  # NOTE: shared by the caller's next round, not loaded again
            candidates.append(identity)
        # NOTE: asked as one run, so a remote tier answers it in one round trip.
        run = candidates[: self.tiers.leading_present(candidates)]
        if not run:
            return 0
        self.tiers.keep_for_load(run)
        # NOTE: allocating may evict cached device blocks (demoting them), never live ones.
        # Sorted: evicted cached blocks come in LRU order (a chain's tail first), and in
        # ascending order the rows of a run of slots follow each other: one copy.
        blocks = sorted(self.pool.allocate(len(run)))
        try:
            loaded = self.tiers.load_many(run, blocks, served=alloc.loaded_blocks)
        except BaseException:  # NOTE: a copy fault: the blocks are in no table yet
            self.pool.release(blocks)
            raise
        self.pool.release(blocks[loaded:])
        for block, identity in zip(blocks[:loaded], run, strict=False):
            self.pool.register(block, identity)
        alloc.block_table += blocks[:loaded]
        return loaded

    def has_more_to_load(
        self, alloc: KVAllocation, token_ids: Sequence[int], num_computed: int
    ) -> bool:
        """True if the next block to compute can be loaded from a tier in a later step
        instead; False in a step in which loading it made no progress."""
        index = num_computed // self.block_size
        if self.tiers is None or num_computed % self.block_size or len(alloc.block_table) != index:
            return False
        if alloc.load_stalled_step == self._step:
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
            touched = min(self.blocks_needed(num_tokens), _registrable(alloc))
            for index in range(alloc.num_registered, touched):
                self._pending.setdefault(alloc.block_hashes[index], alloc)
        return True

    def commit(self, alloc: KVAllocation, token_ids: Sequence[int], num_computed: int) -> None:
        """Index the full blocks whose KV is now computed, so other sequences can hit them."""
        if not self.enable_prefix_caching:
            return
        full = min(num_computed // self.block_size, _registrable(alloc))
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

    def purge(
        self,
        salt: bytes,
        owned: Sequence[BlockHash],
        kept: Iterable[BlockHash],
        live: Iterable[KVAllocation] = (),
    ) -> PurgeCounts:
        """Remove the blocks of ``owned`` (a chain of hashes under ``salt``) that ``kept``
        does not hold, and their descendants, from the prefix cache and every tier (see
        :mod:`kvstore.purge`). Call between steps.

        ``live``: the allocations of every sequence not finished (running, waiting or
        preempted). One whose chain passes through a doomed block keeps computing and using
        its blocks, but never indexes (so never demotes or persists) that block or any
        later one: a request admitted before the purge cannot bring the KV back after it."""
        counts = PurgeCounts()
        if not self.enable_prefix_caching:
            return counts
        fingerprint = salt_fingerprint(salt)
        links: list[tuple[bytes, bytes | None]] = list(self.pool.cached_links(salt))
        if self.tiers is not None:
            links += self.tiers.block_links(fingerprint)
        doomed = doomed_blocks(owned, kept, links)
        for alloc in live:
            self._stop_registering(alloc, doomed)
        counts.device = sum(self.pool.forget(block_hash) for block_hash in doomed)
        if self.tiers is not None:
            counts.tiers = self.tiers.purge(fingerprint, doomed)
        return counts

    def _stop_registering(self, alloc: KVAllocation, doomed: set[BlockHash]) -> None:
        limit = first_doomed(alloc.block_hashes, doomed)
        if limit is None:
            return
        alloc.register_limit = min(limit, _registrable(alloc))
        # NOTE: a reader waiting for one of these blocks would wait for nothing: it computes.
        for block_hash in alloc.block_hashes[limit:]:
            if self._pending.get(block_hash) is alloc:
                del self._pending[block_hash]

    def locate(self, salt: bytes, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """How many of the blocks ``hashes`` (under ``salt``) each place holds now:
        ``device`` (the prefix cache) and one count per tier. A block may be in several."""
        counts = {"device": sum(self.pool.cached_identity(h) is not None for h in hashes)}
        if self.tiers is not None:
            metas = [BlockMeta(h, None, (), salt) for h in hashes]
            for tier in self.tiers.tiers:
                counts[tier.name] = sum(tier.contains_many(metas))
        return counts

    def reset_prefix_cache(self) -> int:
        return self.pool.evict_all_free()


def _registrable(alloc: KVAllocation) -> int:
    """Leading blocks of ``alloc`` that may be indexed: all hashed ones, up to its limit."""
    if alloc.register_limit is None:
        return len(alloc.block_hashes)
    return min(alloc.register_limit, len(alloc.block_hashes))
