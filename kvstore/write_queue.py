"""The bounded queue of block copies in front of a tier's background writers.

``put`` copies the block to a private host tensor and enqueues it; it waits for room only
when asked to (``blocking``), and drops the block (``dropped_demotions``) when the queue is
full or the tier refuses writes for now (a full disk, a store known to be down). The
writers that drain the queue are the subclass's: one record file per item on the disk, one
pipelined batch per round trip to a remote store.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from kvstore.tier import BlockLike, TierMetrics

Key = TypeVar("Key")


@dataclass
class PendingWrite(Generic[Key]):
    key: Key
    meta: BlockLike
    block: torch.Tensor  # private contiguous CPU copy


class WriteQueue(Generic[Key]):
    """Invariant: a key is in ``_pending`` from the ``put`` that queued it until its write
    finished (stored or not, see ``_finished``); a second ``put`` of a pending key, or of
    one the tier already holds, is a no-op. Subclasses take ``_lock`` for their own state
    and bump ``_counts`` under it."""

    def __init__(
        self, block_shape: tuple[int, ...], dtype: torch.dtype, max_pending_writes: int
    ) -> None:
        self.block_shape = block_shape
        self.dtype = dtype
        self._queue: queue.Queue[PendingWrite[Key] | None] = queue.Queue(max_pending_writes)
        self._lock = threading.Lock()
        self._pending: set[Key] = set()
        self._written = threading.Condition(self._lock)  # notified as writes finish
        self._counts = TierMetrics()

    def _holds(self, key: Key) -> bool:
        """The tier stores ``key`` already (called under ``_lock``)."""
        raise NotImplementedError

    def _refusing(self) -> bool:
        """The tier takes no writes for now (called under ``_lock``)."""
        raise NotImplementedError

    def put(self, key: Key, meta: BlockLike, block: torch.Tensor, blocking: bool) -> bool:
        """Queue a copy of ``block``; True if queued or already stored, False if dropped.
        ``blocking`` waits for queue space instead of dropping."""
        with self._lock:
            if key in self._pending or self._holds(key):
                return True
            if self._refusing() or (not blocking and self._queue.full()):
                self._counts.dropped_demotions += 1
                return False
            self._pending.add(key)
        try:
            copy = torch.empty(self.block_shape, dtype=self.dtype)
            copy.copy_(block)
            self._queue.put(PendingWrite(key, meta, copy), block=blocking)
        except queue.Full:
            with self._lock:
                self._counts.dropped_demotions += 1
            self._finished([key])
            return False
        except BaseException:  # NOTE: a key left pending would be skipped by every put
            self._finished([key])
            raise
        return True

    def has_room(self) -> bool:
        """True if a ``put`` now would be queued rather than dropped."""
        with self._lock:
            return not self._refusing() and not self._queue.full()

    def _finished(self, keys: list[Key]) -> None:
        """The writes of ``keys`` are over, stored or not: they may be queued again."""
        with self._lock:
            self._pending.difference_update(keys)
            self._written.notify_all()

    def wait_for_queued(self, timeout: float | None = None) -> bool:
        """Wait until the writes queued before this call are over (stored or not), not
        those queued since: under a steady stream of writes the queue never empties.
        False if ``timeout`` seconds passed first. Needs the writers running."""
        with self._lock:
            queued = set(self._pending)
            return self._written.wait_for(lambda: queued.isdisjoint(self._pending), timeout)

    def _copy_write_counts(self, snapshot: TierMetrics) -> None:
        """The counters every writer keeps, into ``snapshot`` (called under ``_lock``)."""
        counts = self._counts
        snapshot.bytes_written = counts.bytes_written
        snapshot.store_count = counts.store_count
        snapshot.store_seconds_total = counts.store_seconds_total
        snapshot.dropped_demotions = counts.dropped_demotions
        snapshot.write_errors = counts.write_errors
