"""The remote tier's writes: a bounded queue drained by one thread in pipelined batches.

``put`` copies the block to a private host tensor and enqueues it; it never waits unless
asked to, and never while the store is known to be down: a full queue or an open circuit
drops the block (``dropped_demotions``). The thread takes what is queued, up to
``batch_blocks`` blocks, encodes the records and sends them as one pipeline of SETs
(one round trip). Values carry no expiry: the store's ``maxmemory`` policy bounds them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import redis
import torch

from kvstore.record_bytes import encode_value
from kvstore.record_cipher import RecordCipher
from kvstore.remote_keys import KnownKeys
from kvstore.remote_store import RemoteStore, StoreUnavailable
from kvstore.tier import BlockLike, TierMetrics
from kvstore.warn_once import WarnOnce

logger = logging.getLogger(__name__)


@dataclass
class _PendingWrite:
    key: bytes
    meta: BlockLike
    block: torch.Tensor  # private contiguous CPU copy


class RemoteWriter:
    """Invariant: a key is in ``_pending`` from the ``put`` that queued it until its batch
    was sent (stored or not); a second ``put`` of a pending or known key is a no-op."""

    def __init__(
        self,
        store: RemoteStore,
        known: KnownKeys,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        max_pending_writes: int,
        batch_blocks: int,
        cipher: RecordCipher | None = None,
    ) -> None:
        self.store = store
        self.known = known
        self.block_shape = block_shape
        self.dtype = dtype
        self.cipher = cipher
        self.batch_blocks = batch_blocks
        self._queue: queue.Queue[_PendingWrite | None] = queue.Queue(max_pending_writes)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pending: set[bytes] = set()
        self._counts = TierMetrics()
        self._warn = WarnOnce(logger)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kv-remote-writer", daemon=True)
        self._thread.start()

    def put(self, key: bytes, meta: BlockLike, block: torch.Tensor, blocking: bool) -> bool:
        """Queue a copy of ``block``; True if queued or already stored, False if dropped."""
        with self._lock:
            if key in self._pending or self.known.state(key) is True:
                return True
            if self.store.breaker.is_open or (not blocking and self._queue.full()):
                self._counts.dropped_demotions += 1
                return False
            self._pending.add(key)
        copy = torch.empty(self.block_shape, dtype=self.dtype)
        copy.copy_(block)
        try:
            self._queue.put(_PendingWrite(key, meta, copy), block=blocking)
        except queue.Full:
            with self._lock:
                self._pending.discard(key)
                self._counts.dropped_demotions += 1
            return False
        return True

    def has_room(self) -> bool:
        return not self.store.breaker.is_open and not self._queue.full()

    def flush(self) -> None:
        """Wait until every queued write has been sent (stored, dropped or failed)."""
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        self.flush()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def add_metrics(self, snapshot: TierMetrics) -> None:
        with self._lock:
            counts = self._counts
            snapshot.bytes_written = counts.bytes_written
            snapshot.store_count = counts.store_count
            snapshot.store_seconds_total = counts.store_seconds_total
            snapshot.dropped_demotions = counts.dropped_demotions
            snapshot.write_errors = counts.write_errors

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                self._queue.task_done()
                return
            batch = [first]
            stop = False
            while len(batch) < self.batch_blocks:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
            try:
                self._write(batch)
            except Exception:
                logger.exception("KV remote writer failed on a batch of %d blocks", len(batch))
            finally:
                with self._lock:
                    self._pending.difference_update(item.key for item in batch)
                for _ in range(len(batch) + stop):
                    self._queue.task_done()
            if stop:
                return

    def _write(self, batch: list[_PendingWrite]) -> None:
        values = [encode_value(item.meta, item.block, self.cipher) for item in batch]

        def send(client: redis.Redis) -> list[object]:
            pipe = client.pipeline(transaction=False)
            for item, value in zip(batch, values, strict=True):
                pipe.set(item.key, value)
            return list(pipe.execute(raise_on_error=False))

        start = time.perf_counter()
        try:
            results = self.store.call(send)
        except StoreUnavailable:
            with self._lock:
                self._counts.dropped_demotions += len(batch)
            return
        elapsed = time.perf_counter() - start
        stored = 0
        for item, value, result in zip(batch, values, results, strict=True):
            if isinstance(result, Exception):
                self._warn(
                    f"write-{type(result).__name__}",
                    "the remote KV store refused a write: %s (is maxmemory-policy allkeys-lru?)",
                    result,
                )
                with self._lock:
                    self._counts.write_errors += 1
                continue
            self.known.present(item.key)
            stored += 1
            with self._lock:
                self._counts.bytes_written += len(value)
        with self._lock:
            self._counts.store_count += stored
            self._counts.store_seconds_total += elapsed
