"""The disk tier's writes: a bounded queue served by writer threads, and the error policy.

``put`` (``WriteQueue``) queues a private copy of the block, or drops it while the disk is
full. A writer reserves the record's bytes in
the index (evicting LRU records), writes it atomically (``write_record_file``: temp file,
fsync, rename) and indexes it.

Disk full (ENOSPC/EDQUOT): the failed record is removed, one warning is logged, the
``disk_full`` flag is set and ``disk_full_events`` counts it; writes are dropped for
``disk_full_retry_s`` seconds, after which they are tried again (the flag clears on the
first successful write) within a capacity fitted to the drive's room: the tier's oldest
records make room for new ones, and the capacity grows back as the drive frees up. Other
write errors are counted (``write_errors``) and logged once per errno; the record is simply
not stored.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

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
from kvstore.tier import BlockRecordKey, TierMetrics
from kvstore.warn_once import WarnOnce
from kvstore.write_queue import PendingWrite, WriteQueue

logger = logging.getLogger(__name__)

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class DiskWriter(WriteQueue[BlockRecordKey]):
    """Writes records of ``index`` in the background with ``num_writers`` threads.

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
        super().__init__(block_shape, dtype, max_pending_writes)
        self.index = index
        self.cipher = cipher
        self.disk_full_retry_s = disk_full_retry_s
        self.fsync = fsync
        self._num_writers = num_writers
        self._threads: list[threading.Thread] = []
        self._full = False
        self._full_until = 0.0
        self._made_dirs: set[str] = set()
        self._warn = WarnOnce(logger)

    def start(self) -> None:
        for number in range(self._num_writers):
            thread = threading.Thread(
                target=self._writer_loop, name=f"kv-disk-writer-{number}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _holds(self, key: BlockRecordKey) -> bool:
        return self.index.contains(key)

    def _refusing(self) -> bool:
        return self._full and time.monotonic() < self._full_until

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
            self._copy_write_counts(snapshot)
            snapshot.disk_full_events = self._counts.disk_full_events
            snapshot.disk_full = self._full

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

    def _write(self, item: PendingWrite[BlockRecordKey]) -> None:
        try:
            with self._lock:
                if self._refusing():
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
            if self._full or self.index.capacity_bytes < self.index.configured_bytes:
                self.index.fit_to_drive()  # NOTE: shrinks after a full drive, grows back later
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
            self._finished([item.key])

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
