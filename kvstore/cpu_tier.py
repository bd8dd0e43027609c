"""Host-memory KV tier: one preallocated tensor of block slots, LRU eviction."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from kvstore.tier import (
    BlockLike,
    BlockRecordKey,
    KVTier,
    TierMetrics,
    block_nbytes,
    check_block_shape,
    record_key,
    same_block,
)

logger = logging.getLogger(__name__)

EvictCallback = Callable[[BlockLike, torch.Tensor], None]


class CpuTier(KVTier):
    """``capacity_bytes // block_nbytes`` slots in one (pinned when CUDA is available) tensor.

    Invariants: a slot is in exactly one of: the free list, the index, or being filled by
    one ``put`` call. The index's order is LRU first. ``on_evict(meta, slot_view)``
    runs before an evicted slot is reused and must copy what it needs before returning
    (the manager hands it to the disk tier, whose ``put`` copies synchronously).
    Thread-safe; copies run under the tier's lock so a slot is never read while refilled.
    """

    def __init__(
        self,
        block_shape: Sequence[int],
        dtype: torch.dtype,
        capacity_bytes: int,
        *,
        pin_memory: bool | None = None,
        on_evict: EvictCallback | None = None,
    ) -> None:
        self.block_shape = check_block_shape(block_shape)
        self.dtype = dtype
        self.block_nbytes = block_nbytes(self.block_shape, dtype)
        num_slots = int(capacity_bytes) // self.block_nbytes
        if num_slots < 1:
            raise ValueError(
                f"CPU tier capacity {capacity_bytes} bytes is smaller than one block "
                f"({self.block_nbytes} bytes for {self.block_shape} {dtype})"
            )
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.num_slots = num_slots
        self.on_evict = on_evict
        self._storage = torch.empty(
            (num_slots, *self.block_shape), dtype=dtype, pin_memory=pin_memory
        )
        self._index: OrderedDict[BlockRecordKey, tuple[int, BlockLike]] = OrderedDict()
        # NOTE: reversed so that slots are handed out in ascending order (easier to debug).
        self._free = list(range(num_slots - 1, -1, -1))
        self._lock = threading.RLock()
        self._metrics = TierMetrics(capacity_bytes=num_slots * self.block_nbytes)
        self._closed = False

    def __len__(self) -> int:
        return len(self._index)

    def contains(self, meta: BlockLike) -> bool:
        with self._lock:
            return record_key(meta) in self._index

    def put(self, meta: BlockLike, block: torch.Tensor) -> bool:
        """Copy ``block`` (any device) into a slot, evicting the LRU block if needed.

        The copy runs without the lock (the slot is private until registered). Returns
        True if the block is now present, False if no slot could be taken.
        """
        self.check_block(block, "block")
        key = record_key(meta)
        with self._lock:
            if self._closed:
                return False
            if key in self._index:
                self._index.move_to_end(key)
                return True
            slot = self._take_slot_locked()
            if slot is None:
                self._metrics.dropped_demotions += 1
                return False
        start = time.perf_counter()
        copied = False
        try:
            self._storage[slot].copy_(block)
            copied = True
        finally:
            with self._lock:
                if copied and key not in self._index and not self._closed:
                    self._index[key] = (slot, meta)
                    self._metrics.store_count += 1
                    self._metrics.store_seconds_total += time.perf_counter() - start
                    self._metrics.bytes_written += self.block_nbytes
                else:
                    self._free.append(slot)
        return copied

    def _take_slot_locked(self) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._index:
            return None  # every slot is being filled by a concurrent put
        victim_key, (slot, victim_meta) = self._index.popitem(last=False)
        self._metrics.evictions += 1
        if self.on_evict is not None:
            try:
                self.on_evict(victim_meta, self._storage[slot])
            except Exception:
                # NOTE: demotion is best effort; a failing consumer must not break puts.
                logger.exception("CPU tier eviction callback failed for %s", victim_key)
        return slot

    def load_into(self, meta: BlockLike, dest: torch.Tensor) -> bool:
        self.check_block(dest, "destination")
        start = time.perf_counter()
        key = record_key(meta)
        with self._lock:
            entry = self._index.get(key)
            if entry is None or self._closed:
                self._metrics.misses += 1
                return False
            slot, stored = entry
            if not same_block(stored, meta):
                # NOTE: same hash and fingerprint, other tokens: a collision; never serve it.
                self._metrics.mismatched_records += 1
                self._metrics.misses += 1
                return False
            dest.copy_(self._storage[slot])
            self._index.move_to_end(key)
            self._metrics.hits += 1
            self._metrics.bytes_read += self.block_nbytes
            self._metrics.load_count += 1
            self._metrics.load_seconds_total += time.perf_counter() - start
            return True

    def discard(self, meta: BlockLike) -> bool:
        with self._lock:
            entry = self._index.pop(record_key(meta), None)
            if entry is None:
                return False
            self._free.append(entry[0])
            return True

    def lru_metas(self) -> list[BlockLike]:
        """Stored blocks, least recently used first."""
        with self._lock:
            return [stored for _, stored in self._index.values()]

    def metrics(self) -> TierMetrics:
        with self._lock:
            snapshot = TierMetrics(**vars(self._metrics))
            snapshot.num_blocks = len(self._index)
            snapshot.used_bytes = len(self._index) * self.block_nbytes
            snapshot.disabled = self._closed
            return snapshot

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._index.clear()
