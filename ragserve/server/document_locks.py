"""One asyncio lock per (tenant, document id): upload, PATCH and DELETE of one document
take turns.

Without it a DELETE that waits (for questions in flight, or for the registry thread) could
delete the row a re-upload of the same text had just written, or a PATCH could write back
the row a DELETE had just removed. Locks of documents nobody is using are dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

Key = tuple[str, str]


class DocumentLocks:
    """Event-loop only."""

    def __init__(self) -> None:
        self._locks: dict[Key, asyncio.Lock] = {}
        self._users: dict[Key, int] = {}

    @asynccontextmanager
    async def hold(self, namespace: str, doc_id: str) -> AsyncIterator[None]:
        key = (namespace, doc_id)
        lock = self._locks.setdefault(key, asyncio.Lock())
        self._users[key] = self._users.get(key, 0) + 1
        try:
            async with lock:
                yield
        finally:
            self._users[key] -= 1
            if not self._users[key]:
                del self._users[key], self._locks[key]

    def __len__(self) -> int:
        return len(self._locks)
