"""Heap release: a large request body's memory goes back to the system once the request is
gone (a real aiohttp server and client); the trim itself returns freed heap pages."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from ragserve.server.heap_release import (
    LARGE_BODY,
    HeapRelease,
    _malloc_trim,
    make_heap_release_middleware,
    release_free_memory,
)


async def refuse(request: web.Request) -> web.Response:
    body = await request.read()
    return web.json_response({"bytes": len(body)}, status=400)


async def trims_after(release: HeapRelease, bodies: list[bytes | AsyncIterator[bytes]]) -> int:
    app = web.Application(
        client_max_size=4 * LARGE_BODY, middlewares=[make_heap_release_middleware(release)]
    )
    app.router.add_post("/", refuse)
    server = TestServer(app)
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            for body in bodies:
                async with session.post(server.make_url("/"), data=body) as response:
                    assert response.status == 400
                    await response.read()
        for _ in range(100):  # the trim runs on its own thread
            await asyncio.sleep(0.02)
        return release.trims
    finally:
        await server.close()
        release.close()


async def chunked(size: int) -> AsyncIterator[bytes]:
    for _ in range(size // 65536):
        yield b"x" * 65536


def test_a_large_body_is_trimmed_after_its_request_and_a_small_one_is_not() -> None:
    assert asyncio.run(trims_after(HeapRelease(), [b"x" * 1000, b"y" * 100])) == 0
    assert asyncio.run(trims_after(HeapRelease(), [b"x" * LARGE_BODY])) == 1
    # A body of unknown length (chunked) may be large.
    assert asyncio.run(trims_after(HeapRelease(), [chunked(2 * LARGE_BODY)])) == 1


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(_malloc_trim() is None, reason="needs glibc's malloc_trim")
def test_release_returns_freed_pieces_held_among_live_ones() -> None:
    # Pieces below glibc's mmap threshold, each followed by a survivor on the C heap (past
    # Python's small-object allocator), as a body read in pieces lands among other
    # allocations: freeing the pieces leaves holes that the heap keeps.
    pieces, survivors = [], []
    for i in range(1024):
        pieces.append(bytes(64 * 1024 - 64) + bytes([i % 256]))
        survivors.append(bytes([i % 256]) * 1024)
    before = rss_bytes()
    del pieces
    held = rss_bytes()
    release_free_memory()
    assert before - held < 16 * 2**20  # the holes stay until trimmed
    assert held - rss_bytes() > 32 * 2**20, (held - rss_bytes()) / 2**20
    assert survivors[-1] == bytes([255]) * 1024
