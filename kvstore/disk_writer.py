"""The disk tier's writes: a bounded queue served by writer threads, and the error policy.

``put`` copies the block to a private host tensor and enqueues it; a full queue drops the
block (``dropped_demotions``) instead of blocking. A writer reserves the record's bytes in
the index (evicting LRU records), writes it atomically (``write_record_file``: temp file,
fsync, rename) and indexes it.

Disk full (ENOSPC/EDQUOT): the failed record is removed, one warning is logged, the
``disk_full`` flag is set and ``disk_full_events`` counts it; writes are dropped for
``disk_full_retry_s`` seconds, after which they are tried again (the flag clears on the
first successful write). Other write errors are counted (``write_errors``) and logged once
per errno; the record is simply not stored.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass

import torch

from kvstore.disk_index import DiskIndex
from kvstore.record_cipher import RecordCipher
from kvstore.record_format import (
    DIR_MODE,
    encode_head,
    seal_record,
    tensor_bytes,
    write_record_file,
)
from kvstore.tier import BlockLike, BlockRecordKey, TierMetrics
from kvstore.warn_once import WarnOnce

logger = logging.getLogger(__name__)

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


@dataclass
class _PendingWrite:
    key: BlockRecordKey
    meta: BlockLike
    block: torch.Tensor  # private contiguous CPU copy


class DiskWriter:
    """Writes records of ``index`` in the background with ``num_writers`` threads.

    Invariant: a key is in ``_pending`` from the ``put`` that queued it until its write
    finished (stored or not); a second ``put`` of a pending or indexed key is a no-op.
    Lock order: this writer's lock, then the index's.
    """

    def __init__(
        self,
        index: DiskIndex,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        num_writers: int,
        max_pending_writes: int,
        disk_full_retry_s: float,
        fsync: bool,
        cipher: RecordCipher | None = None,
    ) -> None:
        self.index = index
        self.cipher = cipher
        self.block_shape = block_shape
        self.dtype = dtype
        self.disk_full_retry_s = disk_full_retry_s
        self.fsync = fsync
        self._num_writers = num_writers
        self._queue: queue.Queue[_PendingWrite | None] = queue.Queue(max_pending_writes)
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._pending: set[BlockRecordKey] = set()
        self._full = False
        self._full_until = 0.0
        self._counts = TierMetrics()
        self._made_dirs: set[str] = set()
        self._warn = WarnOnce(logger)

    def start(self) -> None:
        for number in range(self._num_writers):
            thread = threading.Thread(
                target=self._writer_loop, name=f"kv-disk-writer-{number}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def put(
        self, key: BlockRecordKey, meta: BlockLike, block: torch.Tensor, blocking: bool
    ) -> bool:
        """Queue a copy of ``block``; True if queued or already stored, False if dropped
        (queue full, disk full). ``blocking`` waits for queue space instead of dropping."""
        with self._lock:
            if key in self._pending or self.index.contains(key):
                return True
            if self._paused_locked() or (not blocking and self._queue.full()):
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
        """True if a ``put`` now would be queued rather than dropped."""
        with self._lock:
            return not self._paused_locked() and not self._queue.full()

    def flush(self) -> None:
        """Wait until every queued write has finished."""
        if self._threads:
            self._queue.join()

    def close(self) -> None:
        """Finish queued writes and stop the threads."""
        self.flush()
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
        self._threads = []

    def add_metrics(self, snapshot: TierMetrics) -> None:
        """Fill in the store counters, drops, write errors and the disk-full state."""
        with self._lock:
            counts = self._counts
            snapshot.bytes_written = counts.bytes_written
            snapshot.store_count = counts.store_count
            snapshot.store_seconds_total = counts.store_seconds_total
            snapshot.dropped_demotions = counts.dropped_demotions
            snapshot.write_errors = counts.write_errors
            snapshot.disk_full_events = counts.disk_full_events
            snapshot.disk_full = self._full

    def _paused_locked(self) -> bool:
        return self._full and time.monotonic() < self._full_until

    def _writer_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(item)
            except Exception:
                logger.exception("KV disk writer failed on %s", item.key if item else None)
            finally:
                self._queue.task_done()

    def _write(self, item: _PendingWrite) -> None:
        try:
            with self._lock:
                if self._paused_locked():
                    self._counts.dropped_demotions += 1
                    return
            payload = tensor_bytes(item.block)
            if self.cipher is None:
                head = encode_head(item.meta, self.dtype, self.block_shape, payload)
            else:
                head, sealed = seal_record(
                    item.meta, self.dtype, self.block_shape, payload, self.cipher
                )
                payload = memoryview(sealed)
            size = len(head) + len(payload)
            if not self.index.reserve(size):
                with self._lock:
                    self._counts.dropped_demotions += 1
                return
            start = time.perf_counter()
            try:
                self._write_file(item.key, head, payload)
            except OSError as exc:
                self.index.unreserve(size)
                self._on_write_error(exc)
                return
            elapsed = time.perf_counter() - start
            self.index.commit(item.key, size)
            with self._lock:
                self._counts.bytes_written += size
                self._counts.store_count += 1
                self._counts.store_seconds_total += elapsed
                recovered, self._full = self._full, False
            if recovered:
                logger.info("disk KV tier %s accepts writes again", self.index.root)
        finally:
            with self._lock:
                self._pending.discard(item.key)

    def _write_file(self, key: BlockRecordKey, head: bytes, payload: memoryview) -> None:
        directory = os.path.join(self.index.root, key.fingerprint)
        if directory not in self._made_dirs:
            os.makedirs(directory, mode=DIR_MODE, exist_ok=True)
            self._made_dirs.add(directory)
        try:
            write_record_file(directory, key.block_hash.hex(), head, payload, fsync=self.fsync)
        except FileNotFoundError:
            self._made_dirs.discard(directory)  # removed behind our back: recreate next time
            raise

    def _on_write_error(self, exc: OSError) -> None:
        if exc.errno in _FULL_ERRNOS:
            with self._lock:
                # NOTE: one event per episode: concurrent writers and retries that fail
                # again while still full do not count again.
                self._counts.disk_full_events += 0 if self._full else 1
                self._full = True
                self._full_until = time.monotonic() + self.disk_full_retry_s
            self._warn(
                "disk-full",
                "disk KV tier %s is full (%s): demotions are dropped, retrying in %.0f s; "
                "serving continues",
                self.index.root,
                exc.strerror,
                self.disk_full_retry_s,
            )
            return
        with self._lock:
            self._counts.write_errors += 1
        self._warn(f"write-{exc.errno}", "cannot write a KV record in %s: %s", self.index.root, exc)
