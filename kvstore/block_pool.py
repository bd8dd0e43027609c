"""The device block pool: ref counts, the free blocks (empty ones, then cached ones in LRU
order), and the prefix-cache index.

Invariants (checked by ``check_invariants`` in tests):
- a block is free (on the empty stack or the cached list) exactly when its ref count is 0;
- a block's ref count equals the number of live block tables holding it;
- the index maps a hash to a block whose stored identity (salt, parent, tokens) is that hash's;
- a free block may stay in the index (a cached block) until its room is needed: the cached
  list is also the evictor, least recently released first; a free block holding nothing
  is on the empty stack, and allocations take those first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from kvstore.hashing import ROOT_PARENT, BlockHash


class BlockIdentity(NamedTuple):
    """What a cached block holds: enough to verify a hash hit and to persist the block.

    A named tuple: a long prompt's prefix match builds and compares one per block, and
    tuples do both in C (a frozen dataclass took about twice as long).
    """

    block_hash: BlockHash
    parent_hash: BlockHash
    salt: bytes
    token_ids: tuple[int, ...]


EvictionHook = Callable[[int, BlockIdentity], None]


class NoFreeBlocksError(RuntimeError):
    """Raised internally when an allocation asks for more blocks than are free."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.identities: list[BlockIdentity | None] = [None] * num_blocks
        # Free blocks that hold cached KV: insertion order is eviction order.
        self._cached: OrderedDict[int, None] = OrderedDict()
        # Free blocks that hold nothing, taken before any cached one is evicted; last freed
        # first (on the CPU its pages are mapped and warm), then never used ones from 0 up.
        self._empty: list[int] = list(range(num_blocks - 1, -1, -1))
        self._index: dict[BlockHash, int] = {}
        self._eviction_hooks: list[EvictionHook] = []
        self.num_evictions = 0
        # One past the highest block ever handed out: a fresh pool hands blocks out in
        # order, so the blocks from here on have never been written.
        self.high_water = 0

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (cached-but-unused ones included)."""
        return len(self._empty) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._index)

    def lookup(self, identity: BlockIdentity) -> int | None:
        """The cached block holding exactly ``identity``, or None.

        A hit is trusted only when the stored salt, parent and token ids match too, so a
        hash collision is a miss, never someone else's KV.
        """
        block = self._index.get(identity.block_hash)
        if block is None or self.identities[block] != identity:
            return None
        return block

    def share_chain(
        self,
        salt: bytes,
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        block_size: int,
        start: int,
        stop: int,
    ) -> list[int]:
        """Share the cached blocks that hold blocks ``start..stop-1`` of a sequence (its
        chain of ``block_hashes``, its ``token_ids``), up to the first that none holds;
        returns them in order. Each hit is checked as :meth:`lookup` checks it.

        NOTE: one call for a whole run: a question on a cached 128k-token document matches
        8,192 blocks, and a lookup and a share per block took 2.5x as long.
        """
        index, identities = self._index, self.identities
        ref_counts, free = self.ref_counts, self._cached
        parent = block_hashes[start - 1] if start else ROOT_PARENT
        blocks: list[int] = []
        for position in range(start, stop):
            block_hash = block_hashes[position]
            block = index.get(block_hash)
            if block is None:
                break
            first = position * block_size
            held = identities[block]
            if held != (block_hash, parent, salt, tuple(token_ids[first : first + block_size])):
                break
            if ref_counts[block] == 0:
                del free[block]
            ref_counts[block] += 1
            blocks.append(block)
            parent = block_hash
        return blocks

    def cached_identity(self, block_hash: BlockHash) -> BlockIdentity | None:
        block = self._index.get(block_hash)
        return None if block is None else self.identities[block]

    # -- changes ---------------------------------------------------------------------------
    def add_eviction_hook(self, hook: EvictionHook) -> None:
        """``hook(block_id, identity)`` runs before a cached block's room is reused."""
        self._eviction_hooks.append(hook)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks (ref count 1 each): empty ones first, then cached ones,
        evicting the least recently used."""
        if count > self.num_free:
            raise NoFreeBlocksError(f"asked for {count} blocks, {self.num_free} free")
        taken = min(count, len(self._empty))
        blocks = self._empty[len(self._empty) - taken :][::-1]
        del self._empty[len(self._empty) - taken :]
        for _ in range(count - taken):
            block, _ = self._cached.popitem(last=False)
            self._evict(block)
            blocks.append(block)
        for block in blocks:
            self.ref_counts[block] = 1
        self.high_water = max(self.high_water, max(blocks, default=-1) + 1)
        return blocks

    def share(self, block: int) -> None:
        """Add a reference to a (cached) block, taking it off the free list if it was free."""
        if self.ref_counts[block] == 0:
            self._take_free(block)
        self.ref_counts[block] += 1

    def _take_free(self, block: int) -> None:
        if block in self._cached:
            del self._cached[block]
        else:
            self._empty.remove(block)  # NOTE: rare: the blocks shared are cached ones

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 become free: cached ones
        at the MRU end of the cached list, the others on top of the empty stack."""
        for block in blocks:
            assert self.ref_counts[block] > 0, f"block {block} released more often than held"
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.identities[block] is None:
                    self._empty.append(block)
                else:
                    self._cached[block] = None

    def register(self, block: int, identity: BlockIdentity) -> bool:
        """Index a full, computed block under its hash. False if another block holds it."""
        assert self.ref_counts[block] > 0, "only live blocks are registered"
        existing = self._index.get(identity.block_hash)
        if existing is not None:
            return existing == block
        if self.identities[block] is not None:
            return False  # already indexed under another hash (a collision elsewhere)
        self.identities[block] = identity
        self._index[identity.block_hash] = block
        return True

    def forget(self, block_hash: BlockHash) -> bool:
        """Drop a block from the index without running the eviction hooks (a purge: its
        contents must not be demoted). A block still referenced stays with its holders,
        unindexed, and is freed as an ordinary uncached block. True if it was indexed."""
        block = self._index.pop(block_hash, None)
        if block is None:
            return False
        self.identities[block] = None
        if block in self._cached:
            del self._cached[block]
            self._empty.append(block)
        return True

    def cached_links(self, salt: bytes) -> list[tuple[BlockHash, BlockHash]]:
        """(hash, parent hash) of every indexed block under ``salt``."""
        return [
            (identity.block_hash, identity.parent_hash)
            for identity in self.identities
            if identity is not None and identity.salt == salt
        ]

    def evict_all_free(self) -> int:
        """Drop every free block from the index (reset_prefix_cache). Returns how many."""
        dropped = 0
        while self._cached:
            block, _ = self._cached.popitem(last=False)
            self._evict(block)
            self._empty.append(block)
            dropped += 1
        return dropped

    def _evict(self, block: int) -> None:
        identity = self.identities[block]
        if identity is None:
            return
        for hook in self._eviction_hooks:
            hook(block, identity)
        del self._index[identity.block_hash]
        self.identities[block] = None
        self.num_evictions += 1

    def check_invariants(self, live_tables: Iterable[list[int]] = ()) -> None:
        """Assert the pool's invariants; ``live_tables`` are the block tables of live sequences."""
        expected = [0] * self.num_blocks
        for table in live_tables:
            for block in table:
                expected[block] += 1
        assert expected == self.ref_counts, "ref counts differ from live references"
        empty = set(self._empty)
        assert len(empty) == len(self._empty), "a block is on the empty stack twice"
        for block in range(self.num_blocks):
            free = block in empty or block in self._cached
            assert free == (self.ref_counts[block] == 0), f"block {block}"
            assert not (block in empty and block in self._cached), f"block {block}"
            if free:
                cached = self.identities[block] is not None
                assert cached == (block in self._cached), f"block {block} on the wrong list"
        for block_hash, block in self._index.items():
            identity = self.identities[block]
            assert identity is not None and identity.block_hash == block_hash
        assert sum(identity is not None for identity in self.identities) == len(self._index)
