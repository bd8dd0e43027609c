"""The background task that notices documents another server on the same directory
uploaded or deleted (a DELETE there removes the rows of every model).

Every ``INTERVAL_S`` it asks the document service to forget the documents whose row is
gone: otherwise this server would go on listing one, answering from its pinned blocks,
and computing (and writing to disk) its KV again after an eviction.
Through the store (see :mod:`ragserve.server.store_registry`) it also takes the newer
rows of known documents: a PATCH's, or the status another server's ingestion ended in.
On the directory it renews the leases of the ingestions running here and, without a
store, follows the statuses of the others' (see
:mod:`ragserve.server.registry_ingestions`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from ragserve.server.background_loop import BackgroundLoop

logger = logging.getLogger(__name__)

INTERVAL_S = 2.0


class RegistryWatch(BackgroundLoop):
    """``start`` and ``stop`` on the event loop."""

    task_name = "document-registry-watch"

    def __init__(self, sync: Callable[[], Awaitable[int]], interval: float = INTERVAL_S) -> None:
        super().__init__()
        self._sync = sync
        self._interval = interval

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self._sync()
            except Exception as exc:  # NOTE: a failed round must not end the watch
                logger.warning("document registry watch failed: %s", exc)
