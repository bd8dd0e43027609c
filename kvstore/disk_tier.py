"""Disk KV tier: one verified record file per block, LRU within a byte budget.

The tier ties three parts together behind ``KVTier``: the directory's index (layout,
LRU order, byte budget, start-up scan; ``disk_index``), the reads (``disk_reader``) and
the background writes with their error policy (``disk_writer``).

A record file is complete or absent: it is written under a unique temporary name
(``.<hash>.<pid>.<random>.tmp``, flock-ed while written) in the same directory, fsync-ed,
renamed over the final name, and the directory is fsync-ed. Readers verify everything and
remove what fails, so a crash, a second process or bit rot can cost a hit, never
correctness.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Sequence

import torch

from kvstore.disk_index import (
    DiskIndex,
    TierDirectoryError,
    check_writable,
    resolve_disk_dir,
)
from kvstore.disk_links import DiskLinks
from kvstore.disk_reader import DiskReader
from kvstore.disk_writer import DiskWriter
from kvstore.record_cipher import RecordCipher
from kvstore.tier import (
    BlockLike,
    BlockRecordKey,
    KVTier,
    TierMetrics,
    block_nbytes,
    check_block_shape,
    record_key,
)

logger = logging.getLogger(__name__)


class DiskTier(KVTier):
    """Content-addressed block files under ``directory`` within ``capacity_bytes``.

    ``directory`` defaults to ``resolve_disk_dir``'s. On start the directory is probed
    (``TierDirectoryError`` if it cannot be written, or with ``disable_on_error`` one
    warning and a tier where every lookup misses), indexed from file names alone, and
    the writer threads start. A lookup that misses the index checks for the file once
    (``stat``), so records written by another process are found.

    Writes are asynchronous (``put`` queues, ``flush`` waits); restores read with
    ``num_readers`` threads. Evicted records are deleted, never handed on (``on_evict``
    is not called).
    """

    name = "disk"
    persistent = True

    def __init__(
        self,
        block_shape: Sequence[int],
        dtype: torch.dtype,
        capacity_bytes: int,
        directory: str | os.PathLike[str] | None = None,
        *,
        num_writers: int = 2,
        max_pending_writes: int = 64,
        num_readers: int = 64,  # NOTE: threads mostly wait on the drive (see disk_reader)
        disk_full_retry_s: float = 30.0,
        fsync: bool = True,
        disable_on_error: bool = False,
        cipher: RecordCipher | None = None,
    ) -> None:
        self.block_shape = check_block_shape(block_shape)
        self.dtype = dtype
        self.block_nbytes = block_nbytes(self.block_shape, dtype)
        if capacity_bytes <= 0:
            raise ValueError(f"disk tier capacity must be > 0 bytes, got {capacity_bytes}")
        if num_writers < 1 or max_pending_writes < 1 or num_readers < 1:
            raise ValueError(
                "num_writers, max_pending_writes and num_readers must be >= 1, got "
                f"{num_writers}, {max_pending_writes}, {num_readers}"
            )
        self.root = resolve_disk_dir(directory)
        self.capacity_bytes = int(capacity_bytes)
        self._index = DiskIndex(self.root, self.capacity_bytes)
        self._reader = DiskReader(self._index, self.block_shape, dtype, num_readers, cipher)
        self._links = DiskLinks(max_records=max(1, self.capacity_bytes // self.block_nbytes))
        self._writer = DiskWriter(
            self._index,
            self.block_shape,
            dtype,
            num_writers=num_writers,
            max_pending_writes=max_pending_writes,
            disk_full_retry_s=disk_full_retry_s,
            fsync=fsync,
            cipher=cipher,
        )
        self._closed = False
        self._disabled = False
        try:
            check_writable(self.root)
        except TierDirectoryError as exc:
            if not disable_on_error:
                raise
            logger.warning("%s; the disk KV tier is disabled (every lookup misses)", exc)
            self._disabled = True
            return
        self._index.scan()
        self._writer.start()

    @property
    def location(self) -> str:
        return str(self.root)

    @property
    def temp_files_removed(self) -> int:
        """Temporary files of dead writers removed by the start-up scan."""
        return self._index.temp_files_removed

    def _usable(self) -> bool:
        return not (self._disabled or self._closed)

    def contains(self, meta: BlockLike) -> bool:
        if not self._usable():
            return False
        key = record_key(meta)
        return self._index.contains(key) or self._index.adopt(key)

    def load_into(self, meta: BlockLike, dest: torch.Tensor) -> bool:
        self.check_block(dest, "destination")
        if not self._usable():
            self._reader.count_misses(1)
            return False
        return self._reader.read(meta, dest)

    def load_many_into(
        self, metas: Sequence[BlockLike], dests: torch.Tensor | Sequence[torch.Tensor]
    ) -> list[bool]:
        """Restore ``metas[i]`` into ``dests[i]`` with parallel reads (see ``DiskReader``);
        returns after every copy has completed."""
        self.check_batch(metas, dests)
        for dest in dests:
            self.check_block(dest, "destination")
        if not self._usable():
            self._reader.count_misses(len(metas))
            return [False] * len(metas)
        return self._reader.read_many(metas, dests)

    def put(self, meta: BlockLike, block: torch.Tensor, *, blocking: bool = False) -> bool:
        """Queue a copy of ``block`` for writing; never blocks unless ``blocking=True``.

        Returns True if queued or already stored, False if dropped (queue full, disk full,
        tier disabled or closed). ``blocking=True`` waits for queue space.
        """
        self.check_block(block, "block")
        if not self._usable():
            return False
        key = record_key(meta)
        path = self._index.path(key)
        self._links.wrote(key.fingerprint, path, meta.block_hash, meta.parent_hash)
        return self._writer.put(key, meta, block, blocking)

    def has_room(self) -> bool:
        return self._usable() and self._writer.has_room()

    def discard(self, meta: BlockLike) -> bool:
        return self._index.discard(record_key(meta))

    def block_links(self, fingerprint: str) -> list[tuple[bytes, bytes | None]]:
        """The links of every record under ``fingerprint`` (other processes' too): read
        from the headers of records this tier has not read or written before; records
        that cannot be read are left out."""
        if not self._usable():
            return []
        self.flush()
        return self._links.links(fingerprint, self._index.record_paths(fingerprint))

    def purge(self, fingerprint: str, hashes: Collection[bytes]) -> int:
        """Waits for queued writes first, so none of them lands after the purge.

        NOTE: files are unlinked whether or not this process indexed them: another
        process sharing the directory may have written them."""
        if self._closed:
            return 0
        self.flush()
        return self._index.purge([BlockRecordKey(fingerprint, h) for h in hashes])

    def lru_keys(self) -> list[BlockRecordKey]:
        """Indexed records, least recently used first."""
        return self._index.lru_keys()

    def metrics(self) -> TierMetrics:
        snapshot = TierMetrics(capacity_bytes=self._index.capacity_bytes)  # fitted to the drive
        self._index.add_metrics(snapshot)
        self._reader.add_metrics(snapshot)
        self._writer.add_metrics(snapshot)
        snapshot.disabled = not self._usable()
        return snapshot

    def flush(self) -> None:
        if not self._closed:
            self._writer.flush()

    def close(self) -> None:
        """Finish queued writes, stop the workers; later operations miss or drop."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._writer.close()
        self._reader.close()
