"""One asyncio lock per (tenant, document id): upload, PATCH and DELETE of one document
take turns.

Without it a DELETE that waits (for questions in flight, or for the registry thread) could
delete the row a re-upload of the same text had just written, or a PATCH could write back
the row a DELETE had just removed. Locks of documents nobody is using are dropped.

``run`` also finishes what it starts: a client that leaves cancels its request's handler,
and a DELETE stopped half way would have dropped the document from memory but kept its
row (which a restart restores) and its KV.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

logger = logging.getLogger(__name__)
Key = tuple[str, str]
T = TypeVar("T")


class DocumentLocks:
    """Event-loop only."""

    def __init__(self) -> None:
        self._locks: dict[Key, asyncio.Lock] = {}
        self._users: dict[Key, int] = {}
        self._running: set[asyncio.Task[object]] = set()

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

    async def run(self, namespace: str, doc_id: str, work: Callable[[], Awaitable[T]]) -> T:
        """``work()`` under the document's lock, run to its end even when the caller is
        cancelled (the caller then stops waiting at once; ``drain`` waits for the rest)."""

        async def locked() -> T:
            async with self.hold(namespace, doc_id):
                return await work()

        task = asyncio.ensure_future(locked())
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(_log_failure)  # NOTE: nobody is left to hear of it
            raise

    async def drain(self) -> None:
        """Wait for the work ``run`` started whose callers were cancelled."""
        await asyncio.gather(*self._running, return_exceptions=True)

    def __len__(self) -> int:
        return len(self._locks)


def _log_failure(task: asyncio.Task[object]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("a document change whose client left failed: %r", task.exception())
