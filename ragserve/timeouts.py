"""Time limits on awaits that never lose the caller's cancellation.

``asyncio.wait_for`` before Python 3.12 returns the awaited result when the work completes
in the same loop turn as a ``cancel()`` of the caller: the cancellation is dropped and the
caller runs on. A DELETE cancels the document's ingestion and waits for it to end while
holding the document's lock; an ingestion that ran on past its cancellation went on to
wait for that lock, and both waited for good.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(awaitable: Awaitable[T], timeout: float | None) -> T:
    """The result of ``awaitable`` within ``timeout`` seconds (None: no limit).

    Past the limit the work is cancelled and ``asyncio.TimeoutError`` raised. A
    cancellation of the caller always propagates, and cancels the work too."""
    work = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({work}, timeout=timeout)
    except asyncio.CancelledError:
        work.cancel()
        raise
    if not done:
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        raise asyncio.TimeoutError
    return work.result()
