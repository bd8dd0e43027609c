"""Handing freed heap back to the system (glibc ``malloc_trim``) after large inputs.

A large request body is read in many small pieces that land among the heap's other
allocations, so freeing them leaves holes glibc keeps for itself. NOTE: measured on two
shared cores: after 20 MB chat bodies refused on their size the server stayed 80 to 100 MB
larger for good; trimming after each brought that down to 20 to 75 MB.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import functools
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

# Bodies of this many bytes or more give their memory back once their request is gone.
LARGE_BODY = 1 << 20


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_free_memory() -> None:
    """Return the heap's free pages to the system, where the C library can (glibc)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class HeapRelease:
    """Trims the heap on its own thread after each large request is freed; trims asked
    for while one is waiting to run are one trim."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragserve-heap")
        self._pending = threading.Event()
        self._closed = False
        self.trims = 0  # how many have run

    def after_freed(self, request: web.Request) -> None:
        """Trim once ``request`` (and the body it holds) has been freed."""
        loop = asyncio.get_running_loop()
        # The finalizer runs while the request is being torn down, its body still held:
        # the trim is queued behind the teardown on the event loop (thread-safe: a garbage
        # collection on another thread may be what frees the request).
        weakref.finalize(request, self._on_freed, loop).atexit = False

    def _on_freed(self, loop: asyncio.AbstractEventLoop) -> None:
        with contextlib.suppress(RuntimeError):  # NOTE: the loop closed meanwhile
            loop.call_soon_threadsafe(self._submit)

    def _submit(self) -> None:
        if self._closed or self._pending.is_set():
            return
        self._pending.set()
        self._thread.submit(self._trim)

    def _trim(self) -> None:
        self._pending.clear()
        release_free_memory()
        self.trims += 1

    def close(self) -> None:
        self._closed = True
        self._thread.shutdown(wait=False, cancel_futures=True)


def make_heap_release_middleware(release: HeapRelease) -> Any:
    @web.middleware
    async def heap_release_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        size = request.content_length
        if (size is None and request.body_exists) or (size or 0) >= LARGE_BODY:  # None: chunked
            release.after_freed(request)
        return await handler(request)

    return heap_release_middleware
