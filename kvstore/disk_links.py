"""The chain links of the disk tier's records (block hash → parent hash), remembered.

A purge needs every record's parent to find a document's descendants. Reading each
record's header costs one open and read per file: 1.1 s on the engine thread per DELETE
with 30,000 records. A record's key fixes its parent (the block hash covers it), so a
link once read, or written by this process, holds for as long as that file exists: only
records new to this process are read.
"""

from __future__ import annotations

import threading

from kvstore.record_format import RecordError, read_head_file

Link = tuple[bytes, bytes | None]


class DiskLinks:
    """Thread-safe. Links are kept per salt fingerprint (a model and tenant); a group
    holds about twice the records it last listed at most, and all groups together about
    twice ``max_records`` (what the tier's budget holds): past that the oldest groups are
    forgotten (read again when needed), so links of evicted records do not pile up."""

    def __init__(self, max_records: int) -> None:
        self.max_records = max_records
        self._lock = threading.Lock()
        self._groups: dict[str, dict[str, Link]] = {}  # fingerprint -> record path -> link
        self._count = 0

    def __len__(self) -> int:
        """How many links are remembered."""
        with self._lock:
            return self._count

    def wrote(self, fingerprint: str, path: str, block_hash: bytes, parent: bytes | None) -> None:
        with self._lock:
            group = self._groups.setdefault(fingerprint, {})
            self._count += path not in group
            group[path] = (block_hash, parent)
            self._bound()

    def _bound(self) -> None:
        """Forget the groups used least lately until the links fit (lock held)."""
        while self._count > 2 * self.max_records + 1024 and len(self._groups) > 1:
            oldest = next(iter(self._groups))
            self._count -= len(self._groups.pop(oldest))
        if self._count > 2 * self.max_records + 1024:  # one group alone: start it again
            self._groups.clear()
            self._count = 0

    def links(self, fingerprint: str, paths: list[str]) -> list[Link]:
        """The links of the records at ``paths`` (all of ``fingerprint``'s now on disk);
        records that cannot be read are left out (and read again next time)."""
        with self._lock:
            group = self._groups.get(fingerprint, {})
            known = {path: group[path] for path in paths if path in group}
        read: dict[str, Link] = {}
        for path in paths:
            if path not in known:
                try:
                    header = read_head_file(path)
                except (OSError, RecordError):
                    continue
                read[path] = (header.block_hash, header.parent_hash)
        with self._lock:
            group = self._groups.pop(fingerprint, {})  # NOTE: re-inserted: used last
            group.update(read)
            if len(group) > 2 * len(paths) + 1024:  # files removed since: forget them
                group = {**known, **read}
            self._groups[fingerprint] = group
            self._count = sum(len(links) for links in self._groups.values())
            self._bound()
        return [*known.values(), *read.values()]
