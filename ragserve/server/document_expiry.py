"""The background task that deletes documents whose expire_time has passed.

It sleeps until the earliest expiry (at most ``MAX_SLEEP_S``, so a PATCH that brings an
expiry closer is noticed soon), then removes every expired document exactly as a DELETE
would: unpinned, its registry row deleted, its KV purged from every tier.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from ragserve.server.background_loop import BackgroundLoop

logger = logging.getLogger(__name__)

MAX_SLEEP_S = 1.0

# (namespace, id, expire_time) of every live document that expires
Expiring = Callable[[], Iterable[tuple[str, str, float]]]
Remove = Callable[[str, str], Awaitable[object]]


class ExpirySweeper(BackgroundLoop):
    """``start`` and ``stop`` on the event loop."""

    task_name = "document-expiry"

    def __init__(self, expiring: Expiring, remove: Remove) -> None:
        super().__init__()
        self._expiring = expiring
        self._remove = remove

    async def sweep(self) -> int:
        """Remove what has expired now; returns how many."""
        now = time.time()
        due = [(ns, doc_id) for ns, doc_id, when in self._expiring() if when <= now]
        for namespace, doc_id in due:
            try:
                await self._remove(namespace, doc_id)
                logger.info("document %s expired and was deleted", doc_id)
            except Exception as exc:  # NOTE: one document's failure must not stop expiry
                logger.warning("document %s expired but could not be deleted: %s", doc_id, exc)
        return len(due)

    async def _run(self) -> None:
        while True:
            await self.sweep()
            upcoming = [when for _, _, when in self._expiring()]
            wait = min([MAX_SLEEP_S, *(when - time.time() for when in upcoming)])
            await asyncio.sleep(max(0.05, wait))
