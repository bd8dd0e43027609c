"""One asyncio task that a server component owns for its life: started and stopped on the
event loop, its body (``_run``) written by the subclass."""

from __future__ import annotations

import asyncio
import contextlib


class BackgroundLoop:
    task_name = "background-loop"

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self.task_name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        raise NotImplementedError
