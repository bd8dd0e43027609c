"""The background task that notices documents another server on the same directory
deleted (a DELETE there removes the rows of every model).

Every ``INTERVAL_S`` it asks the document service to forget the documents whose row is
gone: otherwise this server would go on listing one, answering from its pinned blocks,
and computing (and writing to disk) its KV again after an eviction.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

INTERVAL_S = 2.0


class RegistryWatch:
    """Owns one asyncio task; ``start`` and ``stop`` on the event loop."""

    def __init__(self, sync: Callable[[], Awaitable[int]], interval: float = INTERVAL_S) -> None:
        self._sync = sync
        self._interval = interval
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="document-registry-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self._sync()
            except Exception as exc:  # NOTE: a failed round must not end the watch
                logger.warning("document registry watch failed: %s", exc)
