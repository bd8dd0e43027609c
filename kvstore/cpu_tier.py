"""Host-memory KV tier: one preallocated tensor of block slots, LRU eviction.

Batched loads (``load_rows_into`` / ``load_many_into``) issue every host-to-device copy
with ``non_blocking=True`` from the pinned slots, queued on the destination device's
current stream, and return without waiting: the copies stream back to back, overlapped
with the host's next work, instead of one synchronous round trip per block.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence

import torch

from kvstore.tier import (
    BlockLike,
    BlockRecordKey,
    EvictCallback,
    KVTier,
    TierMetrics,
    block_nbytes,
    check_block_shape,
    record_key,
    same_block,
)

logger = logging.getLogger(__name__)

# NOTE: a merged run is issued once it reaches this size, so the first copies of a batch
# start while later blocks are still being verified.
MAX_RUN_BYTES = 64 << 20


class CpuTier(KVTier):
    """``capacity_bytes // block_nbytes`` slots in one (pinned when CUDA is available) tensor.

    Invariants: a slot is in exactly one of: the free list, the index, or being filled by
    one ``put`` call. The index's order is LRU first. ``on_evict(meta, slot_view)``
    runs before an evicted slot is reused and must copy what it needs before returning
    (the stack hands it to the next tier down, whose ``put`` copies synchronously).
    Thread-safe: the index, the free list and every load are handled under one lock.

    Asynchronous copies: a batched load records an event per destination device after its
    copies; before a slot is handed out again (``put``, eviction) or the tier closes, the
    recorded events are waited for, under the lock. So a slot an in-flight copy may still
    read is never rewritten. Work that uses the destination blocks on the same stream is
    ordered after the copies by the stream itself.
    """

    name = "cpu"

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
        self.capacity_bytes = num_slots * self.block_nbytes
        self.on_evict = on_evict
        self._storage = torch.empty(
            (num_slots, *self.block_shape), dtype=dtype, pin_memory=pin_memory
        )
        self._index: OrderedDict[BlockRecordKey, tuple[int, BlockLike]] = OrderedDict()
        # NOTE: slots are handed out from the top down. The device releases a sequence's
        # blocks tail first (so the tail is evicted first), so a demoted document lands in
        # ascending slots, and its restore copies long runs instead of one block at a time.
        self._free = list(range(num_slots))
        self._lock = threading.RLock()
        self._metrics = TierMetrics(capacity_bytes=self.capacity_bytes)
        self._closed = False
        # Events after batched loads whose copies may still read slots (CUDA only).
        self._reads_in_flight: list[torch.cuda.Event] = []

    def __len__(self) -> int:
        return len(self._index)

    def contains(self, meta: BlockLike) -> bool:
        with self._lock:
            return record_key(meta) in self._index

    def keep_for_load(self, metas: Sequence[BlockLike]) -> None:
        with self._lock:
            # NOTE: last to first, so if room must still be made among them, the run's
            # tail goes and its head (a prefix, so the part that is used) stays.
            for meta in reversed(metas):
                key = record_key(meta)
                if key in self._index:
                    self._index.move_to_end(key)

    def put(self, meta: BlockLike, block: torch.Tensor, *, blocking: bool = False) -> bool:
        """Copy ``block`` (any device) into a slot, evicting the LRU block if needed.

        The copy runs without the lock (the slot is private until registered) and always
        completes before returning, so ``blocking`` changes nothing. Returns True if the
        block is now present, False if no slot could be taken.
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
        self._wait_for_reads_locked()  # the slot handed out is refilled at once
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
        with self._lock:
            slot = self._hit_slot_locked(meta)
            if slot is None:
                return False
            dest.copy_(self._storage[slot])
            self._count_loads_locked(1, 1, time.perf_counter() - start)
            return True

    def load_rows_into(
        self, metas: Sequence[BlockLike], cache: torch.Tensor, rows: Sequence[int]
    ) -> list[bool]:
        """Load ``metas[i]`` into ``cache[rows[i]]`` (any device) as one batch.

        ``cache`` is a block-major tensor ``[n, *block_shape]`` (the device KV cache); the
        rows must be distinct. Hits are copied asynchronously from the pinned slots, a run
        of consecutive rows stored in consecutive slots as one copy; the call returns once
        they are queued (see the class docstring). Misses leave their rows unspecified.
        """
        if len(rows) != len(metas):
            raise ValueError(f"{len(metas)} blocks to load but {len(rows)} destination rows")
        if tuple(cache.shape[1:]) != self.block_shape or cache.dtype != self.dtype:
            raise ValueError(
                f"the destination must hold blocks of {self.block_shape} {self.dtype}, "
                f"got {tuple(cache.shape)} {cache.dtype}"
            )

        def copy_run(first: int, slot: int, length: int) -> None:
            cache[rows[first] : rows[first] + length].copy_(
                self._storage[slot : slot + length], non_blocking=True
            )

        def contiguous(index: int, first: int, length: int) -> bool:
            return rows[index] == rows[first] + length

        return self._load_batch(metas, copy_run, contiguous, [cache.device])

    def load_many_into(
        self, metas: Sequence[BlockLike], dests: torch.Tensor | Sequence[torch.Tensor]
    ) -> list[bool]:
        """Batched ``load_into`` (see ``load_rows_into``): asynchronous copies."""
        self.check_batch(metas, dests)
        if isinstance(dests, torch.Tensor):
            return self.load_rows_into(metas, dests, range(len(metas)))
        for dest in dests:
            self.check_block(dest, "destination")

        def copy_one(first: int, slot: int, length: int) -> None:
            assert length == 1, "separate destinations are never merged"
            dests[first].copy_(self._storage[slot], non_blocking=True)

        return self._load_batch(metas, copy_one, lambda *_: False, [d.device for d in dests])

    def _load_batch(
        self,
        metas: Sequence[BlockLike],
        copy_run: Callable[[int, int, int], None],
        contiguous: Callable[[int, int, int], bool],
        devices: Iterable[torch.device],
    ) -> list[bool]:
        """Verify each meta and queue the hits' copies run by run, under the lock.

        ``copy_run(first, slot, length)`` copies slots ``slot..slot+length-1`` into the
        destinations of metas ``first..first+length-1``; ``contiguous(index, first,
        length)`` says whether meta ``index``'s destination directly follows that run's.
        """
        start = time.perf_counter()
        found = [False] * len(metas)
        max_run = max(1, MAX_RUN_BYTES // self.block_nbytes)
        copies = 0
        with self._lock:
            run: tuple[int, int, int] | None = None  # (first meta, first slot, length)
            try:
                for index, meta in enumerate(metas):
                    slot = self._hit_slot_locked(meta)
                    if slot is None:
                        continue
                    found[index] = True
                    if run is not None:
                        first, first_slot, length = run
                        if (
                            index == first + length
                            and slot == first_slot + length
                            and length < max_run
                            and contiguous(index, first, length)
                        ):
                            run = (first, first_slot, length + 1)
                            continue
                        copy_run(*run)
                        copies += 1
                    run = (index, slot, 1)
                if run is not None:
                    copy_run(*run)
                    copies += 1
            finally:
                # NOTE: even when a copy raised: earlier copies may still read slots.
                self._track_reads_locked(devices)
            self._count_loads_locked(sum(found), copies, time.perf_counter() - start)
        return found

    def _hit_slot_locked(self, meta: BlockLike) -> int | None:
        """The slot holding exactly ``meta`` (now most recently used), or None, counted."""
        key = record_key(meta)
        entry = None if self._closed else self._index.get(key)
        if entry is None:
            self._metrics.misses += 1
            return None
        slot, stored = entry
        if not same_block(stored, meta):
            # NOTE: same hash and fingerprint, other tokens: a collision; never serve it.
            self._metrics.mismatched_records += 1
            self._metrics.misses += 1
            return None
        self._index.move_to_end(key)
        return slot

    def _track_reads_locked(self, devices: Iterable[torch.device]) -> None:
        """Remember the batch's copies; a slot is reused only after they have completed."""
        self._reads_in_flight = [event for event in self._reads_in_flight if not event.query()]
        for device in set(devices):
            if device.type == "cuda":
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                self._reads_in_flight.append(event)

    def _wait_for_reads_locked(self) -> None:
        for event in self._reads_in_flight:
            event.synchronize()
        self._reads_in_flight.clear()

    def _count_loads_locked(self, hits: int, copies: int, seconds: float) -> None:
        if not hits:
            return
        self._metrics.hits += hits
        self._metrics.bytes_read += hits * self.block_nbytes
        self._metrics.load_count += hits
        self._metrics.load_copies += copies
        self._metrics.load_seconds_total += seconds

    def discard(self, meta: BlockLike) -> bool:
        with self._lock:
            entry = self._index.pop(record_key(meta), None)
            if entry is None:
                return False
            self._free.append(entry[0])
            return True

    def block_links(self, fingerprint: str) -> list[tuple[bytes, bytes | None]]:
        with self._lock:
            return [
                (meta.block_hash, meta.parent_hash)
                for key, (_, meta) in self._index.items()
                if key.fingerprint == fingerprint
            ]

    def purge(self, fingerprint: str, hashes: Collection[bytes]) -> int:
        removed = 0
        with self._lock:
            self._wait_for_reads_locked()  # NOTE: a slot an async copy still reads is not zeroed
            for block_hash in hashes:
                entry = self._index.pop(BlockRecordKey(fingerprint, block_hash), None)
                if entry is not None:
                    self._storage[entry[0]].zero_()
                    self._free.append(entry[0])
                    removed += 1
        return removed

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
            self._wait_for_reads_locked()
            self._closed = True
            self._index.clear()
