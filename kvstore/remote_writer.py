"""The remote tier's writes: a bounded queue drained by one thread in pipelined batches.

``put`` (``WriteQueue``) queues a private copy of the block; it never waits unless asked
to, and an open circuit (the store known to be down) drops the block. The thread takes
what is queued, up to ``batch_blocks`` blocks, asks the store which of their keys it
holds (one pipeline of EXISTS), then encodes the other records and sends them as one
pipeline of SETs: two round trips. Values carry no expiry: the store's ``maxmemory``
policy bounds them.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time

import redis
import torch

from kvstore.record_bytes import encode_value
from kvstore.record_cipher import RecordCipher
from kvstore.remote_keys import KnownKeys
from kvstore.remote_store import RemoteStore, StoreUnavailable
from kvstore.tier import TierMetrics
from kvstore.warn_once import WarnOnce
from kvstore.write_queue import PendingWrite, WriteQueue

logger = logging.getLogger(__name__)


class RemoteWriter(WriteQueue[bytes]):
    """One thread sending batches; a key stays pending until its batch was sent."""

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
        super().__init__(block_shape, dtype, max_pending_writes)
        self.store = store
        self.known = known
        self.cipher = cipher
        self.batch_blocks = batch_blocks
        self._thread: threading.Thread | None = None
        self._warn = WarnOnce(logger)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kv-remote-writer", daemon=True)
        self._thread.start()

    def _holds(self, key: bytes) -> bool:
        return self.known.state(key) is True

    def _refusing(self) -> bool:
        return self.store.breaker.is_open

    def flush(self) -> None:
        """Wait until every queued write has been sent (stored, dropped or failed)."""
        if self._thread is not None:
            self._queue.join()

    def flush_queued(self, timeout: float | None) -> bool:
        """``wait_for_queued`` while the thread runs (see ``KVTier.flush_queued``)."""
        return self._thread is None or self.wait_for_queued(timeout)

    def close(self) -> None:
        self.flush()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def add_metrics(self, snapshot: TierMetrics) -> None:
        with self._lock:
            self._copy_write_counts(snapshot)

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
                self._finished([item.key for item in batch])
                for _ in range(len(batch) + stop):
                    self._queue.task_done()
            if stop:
                return

    def _absent(self, batch: list[PendingWrite[bytes]]) -> list[PendingWrite[bytes]]:
        """The writes whose key the store lacks (one round trip): records are named by
        their content, so one already there (another engine's, or this one's from before
        its belief lapsed) needs no second copy."""

        def ask(client: redis.Redis) -> list[object]:
            pipe = client.pipeline(transaction=False)
            for item in batch:
                pipe.exists(item.key)
            return list(pipe.execute(raise_on_error=False))

        absent = []
        for item, answer in zip(batch, self.store.call(ask), strict=True):
            if answer == 1:
                self.known.present(item.key)
            else:
                absent.append(item)
        return absent

    def _write(self, batch: list[PendingWrite[bytes]]) -> None:
        start = time.perf_counter()
        try:
            batch = self._absent(batch)
            values = [encode_value(item.meta, item.block, self.cipher) for item in batch]
            keys = [item.key for item in batch]
            results = self.store.call(functools.partial(_set_all, keys=keys, values=values))
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


def _set_all(client: redis.Redis, *, keys: list[bytes], values: list[bytes]) -> list[object]:
    """One pipeline of SETs; each answer is its own (an error does not stop the rest)."""
    if not keys:
        return []
    pipe = client.pipeline(transaction=False)
    for key, value in zip(keys, values, strict=True):
        pipe.set(key, value)
    return list(pipe.execute(raise_on_error=False))
