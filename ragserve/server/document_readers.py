"""Requests between reading a document's tokens and handing them to the engine.

A DELETE purges a document's KV through the engine's command queue, and the engine keeps
every request queued before the purge from indexing or persisting the purged blocks (see
``LLMEngine.purge_prefix``). A request that read the document's tokens but has not reached
the engine yet (it is still tokenizing its question) would come after the purge and cache
the document again. So each such request holds a :class:`Reading` from ``token_lists``
until its engine requests are queued (or it ends), and a DELETE waits for the readings of
its document before it purges. The wait is short: no generation happens in between.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable

logger = logging.getLogger(__name__)

# NOTE: far beyond any tokenization; a reader stuck past it must not hang a DELETE.
MAX_WAIT_S = 30.0
Key = tuple[str, str]  # (tenant namespace, document id)


class Reading:
    """One request's hold on its documents. ``queued`` is set once its engine requests are
    all queued, or it ended without them; ``on_end`` runs then, once."""

    def __init__(self, keys: list[Key], on_end: Callable[[Reading], None]) -> None:
        self.keys = keys
        self.queued = asyncio.Event()
        self._on_end = on_end
        self._to_queue = 1

    def expect(self, num_requests: int) -> None:
        """The request will queue ``num_requests`` engine requests (default 1)."""
        self._to_queue = num_requests

    def note_queued(self) -> None:
        self._to_queue -= 1
        if self._to_queue <= 0:
            self.end()

    def end(self) -> None:
        if not self.queued.is_set():
            self.queued.set()
            self._on_end(self)


class DocumentReaders:
    """The open readings, by document; event-loop only.

    A reading belongs to the task that opened it (the request's handler: aiohttp runs each
    request in a task of its own): it ends when its engine requests are queued or when
    that task finishes, whichever comes first."""

    def __init__(self) -> None:
        self._open: dict[Key, set[Reading]] = defaultdict(set)
        self._by_task: dict[asyncio.Task[object], Reading] = {}

    def open(self, namespace: str, doc_ids: list[str]) -> None:
        task = asyncio.current_task()
        if not doc_ids or task is None:
            return
        reading = Reading([(namespace, doc_id) for doc_id in doc_ids], self._close)
        for key in reading.keys:
            self._open[key].add(reading)
        self._by_task[task] = reading
        task.add_done_callback(lambda _: reading.end())

    def current(self) -> Reading | None:
        """The reading the current task opened, if it is still open."""
        task = asyncio.current_task()
        return self._by_task.get(task) if task is not None else None

    async def settled(self, namespace: str, doc_id: str) -> None:
        """Wait until every request that read this document has queued its engine requests
        or ended (at most ``MAX_WAIT_S``)."""
        readings = list(self._open.get((namespace, doc_id), ()))
        if not readings:
            return
        waits = [asyncio.ensure_future(reading.queued.wait()) for reading in readings]
        _, pending = await asyncio.wait(waits, timeout=MAX_WAIT_S)
        for wait in pending:
            wait.cancel()
        if pending:
            logger.warning(
                "document %s: %d requests reading it did not reach the engine in %.0fs; "
                "purging anyway",
                doc_id,
                len(pending),
                MAX_WAIT_S,
            )

    def _close(self, reading: Reading) -> None:
        for key in reading.keys:
            readers = self._open.get(key)
            if readers is not None:
                readers.discard(reading)
                if not readers:
                    del self._open[key]
        for task, held in list(self._by_task.items()):
            if held is reading:
                del self._by_task[task]
