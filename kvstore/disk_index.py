"""The disk tier's directory: where it is, its record files, their LRU order and byte budget.

Layout: ``<root>/<salt fingerprint>/<block hash hex>.kv`` (format in ``record_format``);
temporary files of writes in flight end in ``.tmp``. The index maps a record's key to its
file size, least recently used first.

Capacity: ``used_bytes`` counts indexed files plus reservations of writes in flight and
never exceeds ``capacity_bytes``; LRU files are removed before a write to make room.
Each process accounts for its own view: two processes sharing a directory (each
verifies what the other wrote) can together exceed one budget until restart.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import secrets
import stat
import threading
import time
from collections import OrderedDict
from pathlib import Path

from kvstore.record_format import (
    DIR_MODE,
    FILE_MODE,
    RECORD_SUFFIX,
    TEMP_SUFFIX,
    remove_abandoned_temp,
)
from kvstore.tier import BlockRecordKey, TierMetrics
from kvstore.warn_once import WarnOnce

logger = logging.getLogger(__name__)

_HEX_DIGITS = frozenset("0123456789abcdef")


class TierDirectoryError(OSError):
    """The disk tier's directory cannot be created or written; ``filename`` is the path."""


def resolve_disk_dir(directory: str | os.PathLike[str] | None = None) -> Path:
    """The disk tier's directory: ``directory`` with ``~`` expanded, or by default
    ``$XDG_CACHE_HOME/ragserve/kv``, else ``~/.cache/ragserve/kv``."""
    if directory:
        return Path(directory).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ragserve" / "kv"


def check_writable(root: Path) -> None:
    """Create ``root`` if needed and write a probe file in it, or raise TierDirectoryError."""
    probe = root / f".probe.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
    try:
        root.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        try:
            os.write(fd, b"probe")
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise TierDirectoryError(
            exc.errno or errno.EACCES,
            f"KV disk tier directory is not a writable directory ({exc.strerror or exc})",
            str(root),
        ) from exc


FIT_INTERVAL_S = 1.0


class DiskIndex:
    """The records under ``root`` this process knows of, in LRU order, within a byte budget.

    Invariant: ``used_bytes`` = sum of indexed sizes + outstanding reservations, and a
    reservation is granted only if it keeps ``used_bytes <= capacity_bytes``. A record in
    the index may have vanished from disk (a reader then ``forget``s it); a record on disk
    may be missing from the index (another process wrote it; ``adopt`` finds it).
    Thread-safe; methods never call out while holding the lock.
    """

    def __init__(self, root: Path, capacity_bytes: int) -> None:
        self.root = root
        self.configured_bytes = capacity_bytes
        self.capacity_bytes = capacity_bytes  # less while the drive has less room
        self._fitted_at = -math.inf
        self._reserved = 0  # bytes reserved for writes not committed yet
        self.temp_files_removed = 0
        self._lock = threading.Lock()
        self._sizes: OrderedDict[BlockRecordKey, int] = OrderedDict()
        self._used = 0
        # Keys dropped from the index whose files this process is removing, and a count of
        # removals ended: a record read meanwhile must not be indexed again with no file.
        self._removing: set[BlockRecordKey] = set()
        self._removals = 0
        self._evictions = 0
        self._warn = WarnOnce(logger)

    def path(self, key: BlockRecordKey) -> str:
        return os.path.join(self.root, key.fingerprint, key.block_hash.hex() + RECORD_SUFFIX)

    def scan(self) -> None:
        """Index the directory from file names, sizes and mtimes only (no payload reads;
        LRU order = mtime order), remove stale temporary files of dead writers, and evict
        LRU records beyond the capacity."""
        found: list[tuple[int, BlockRecordKey, int]] = []
        with os.scandir(self.root) as top:
            for group in top:
                if not group.is_dir(follow_symlinks=False) or not _is_hex(group.name, 16):
                    continue
                with os.scandir(group.path) as records:
                    for entry in records:
                        if entry.name.endswith(TEMP_SUFFIX):
                            self.temp_files_removed += remove_abandoned_temp(entry.path)
                            continue
                        stem = entry.name.removesuffix(RECORD_SUFFIX)
                        if stem == entry.name or not _is_hex(stem, 32):
                            continue
                        try:
                            info = entry.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        if stat.S_ISREG(info.st_mode):
                            key = BlockRecordKey(group.name, bytes.fromhex(stem))
                            found.append((info.st_mtime_ns, key, info.st_size))
        found.sort(key=lambda item: item[0])
        with self._lock:
            for _, key, size in found:
                self._sizes[key] = size
                self._used += size
            victims = self._evict_locked(0)
        self.remove_files(victims)

    def contains(self, key: BlockRecordKey) -> bool:
        with self._lock:
            return key in self._sizes

    def adopt(self, key: BlockRecordKey) -> bool:
        """Index a record another process (or an earlier run) wrote after our scan."""
        with self._lock:
            removals = self._removals
        info = self._regular_file(key)
        return info is not None and self._index_found(key, info.st_size, removals)

    def touch(self, key: BlockRecordKey, size: int, inode: int) -> None:
        """Mark a record just read (file ``inode``) as most recently used. One not indexed
        (written by another process since our scan, or evicted while it was read) is
        indexed only while that file is still there."""
        with self._lock:
            if key in self._sizes:
                self._used += size - self._sizes.pop(key)
                self._sizes[key] = size
                return
            removals = self._removals
        info = self._regular_file(key)
        if info is not None and info.st_ino == inode:
            self._index_found(key, size, removals)

    def _regular_file(self, key: BlockRecordKey) -> os.stat_result | None:
        try:
            info = os.stat(self.path(key))
        except OSError:
            return None
        return info if stat.S_ISREG(info.st_mode) else None

    def _index_found(self, key: BlockRecordKey, size: int, removals: int) -> bool:
        """Index a record whose file was seen after ``removals`` removals had ended; not
        while a removal that may have taken it is under way or has ended since."""
        with self._lock:
            if key in self._sizes:
                return True
            if key in self._removing or self._removals != removals:
                return False
            self._sizes[key] = size
            self._used += size
            return True

    def forget(self, key: BlockRecordKey) -> bool:
        """Drop a record from the index (its file is left alone); True if it was there."""
        with self._lock:
            return self._forget_locked(key)

    def discard(self, key: BlockRecordKey) -> bool:
        """Forget a record and remove its file; True if it was indexed."""
        with self._lock:
            present = self._drop_locked(key)
        if present:
            self.remove_files([key])
        else:
            self._removed([key])
        return present

    def purge(self, keys: list[BlockRecordKey]) -> int:
        """Forget ``keys`` and unlink their files, indexed or not; how many files were removed."""
        with self._lock:
            for key in keys:
                self._drop_locked(key)
        return self.remove_files(keys)

    def record_paths(self, fingerprint: str) -> list[str]:
        """Paths of the record files under salt ``fingerprint`` now on disk."""
        directory = os.path.join(self.root, fingerprint)
        try:
            with os.scandir(directory) as entries:
                return [e.path for e in entries if e.name.endswith(RECORD_SUFFIX)]
        except FileNotFoundError:
            return []

    def remove_rejected(self, key: BlockRecordKey, inode: int) -> None:
        """Forget a record that failed verification and remove its file, if the file is
        still the one that was read (inode ``inode``)."""
        with self._lock:
            self._drop_locked(key)
        path = self.path(key)
        try:
            # NOTE: only remove the file we read; another process may have replaced it.
            if os.stat(path).st_ino == inode:
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:  # NOTE: a read-only or failing drive: the read is a miss anyway
            self._warn(f"unlink-{exc.errno}", "cannot remove a rejected KV record: %s", exc)
        finally:
            self._removed([key])

    def fit_to_drive(self) -> None:
        """Take as capacity the configured bytes, or what this tier's records use plus the
        drive's free room where that is less: on a full drive (other files, or a budget
        larger than the drive) the oldest records then make room for new ones. Asked of
        the drive once a second at most."""
        now = time.monotonic()
        if now - self._fitted_at < FIT_INTERVAL_S:
            return
        self._fitted_at = now
        try:
            info = os.statvfs(self.root)
        except OSError:
            return
        free = info.f_bavail * (info.f_frsize or info.f_bsize)
        with self._lock:
            # NOTE: reserved bytes not written yet are still free on the drive: not twice.
            self.capacity_bytes = min(self.configured_bytes, self._used - self._reserved + free)

    def reserve(self, size: int) -> bool:
        """Evict LRU records until ``size`` more bytes fit, then reserve them.

        False (and nothing evicted) for a record larger than the whole capacity.
        """
        with self._lock:
            if size > self.capacity_bytes:  # NOTE: never empty the tier for a hopeless write
                return False
            victims = self._evict_locked(size)
            fits = self._used + size <= self.capacity_bytes
            if fits:
                self._used += size
                self._reserved += size
        self.remove_files(victims)
        return fits

    def unreserve(self, size: int) -> None:
        """Return a reservation whose write failed."""
        with self._lock:
            self._used -= size
            self._reserved -= size

    def commit(self, key: BlockRecordKey, size: int) -> None:
        """Index a record written under a reservation of ``size`` bytes (most recent)."""
        with self._lock:
            # NOTE: the reservation already counts ``size``; a copy adopted meanwhile
            # (written by another process) is replaced, so subtract its size.
            self._used -= self._sizes.pop(key, 0)
            self._sizes[key] = size
            self._reserved -= size

    def _evict_locked(self, incoming: int) -> list[BlockRecordKey]:
        victims = []
        while self._used + incoming > self.capacity_bytes and self._sizes:
            key = next(iter(self._sizes))
            self._drop_locked(key)
            victims.append(key)
        self._evictions += len(victims)
        return victims

    def _drop_locked(self, key: BlockRecordKey) -> bool:
        """Forget ``key`` as its file is about to be removed (``remove_files`` or
        ``_removed`` ends that); True if it was indexed."""
        self._removing.add(key)
        return self._forget_locked(key)

    def _forget_locked(self, key: BlockRecordKey) -> bool:
        size = self._sizes.pop(key, None)
        if size is not None:
            self._used -= size
        return size is not None

    def _removed(self, keys: list[BlockRecordKey]) -> None:
        with self._lock:
            self._removing.difference_update(keys)
            self._removals += 1

    def remove_files(self, keys: list[BlockRecordKey]) -> int:
        """Unlink the files of ``keys``, dropped from the index (``_drop_locked``); how
        many were there."""
        removed = 0
        try:
            for key in keys:
                try:
                    os.unlink(self.path(key))
                    removed += 1
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    self._warn(f"unlink-{exc.errno}", "cannot remove KV record: %s", exc)
        finally:
            self._removed(keys)
        return removed

    def lru_keys(self) -> list[BlockRecordKey]:
        """Indexed records, least recently used first."""
        with self._lock:
            return list(self._sizes)

    def add_metrics(self, snapshot: TierMetrics) -> None:
        """Fill in ``num_blocks``, ``used_bytes`` and ``evictions``."""
        with self._lock:
            snapshot.num_blocks = len(self._sizes)
            snapshot.used_bytes = self._used
            snapshot.evictions = self._evictions


def _is_hex(text: str, length: int) -> bool:
    return len(text) == length and set(text) <= _HEX_DIGITS
