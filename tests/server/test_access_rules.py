"""Who may read what, and flag combinations that used to be silently ignored.

The auth middleware alone, in process: with API keys ``/v1``, ``/openapi.json`` and
``/metrics`` need a key (with a metrics key, ``/metrics`` takes that one alone, and it
opens nothing else); ``/health`` stays open. Engine and server configs refuse contradictory flags, and
``--kv-disk-dir`` alone turns the disk tier on with the default budget.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from ragserve.config import DEFAULT_DISK_GIB, EngineConfig
from ragserve.server.auth import make_auth_middleware
from ragserve.server.config import ServerConfig
from ragserve.server.errors import error_middleware

PATHS = ("/health", "/metrics", "/openapi.json", "/v1/models")


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({})


def statuses(keys: tuple[str, ...], metrics_key: str | None, sent: str | None) -> dict[str, int]:
    async def run() -> dict[str, int]:
        app = web.Application(
            middlewares=[error_middleware, make_auth_middleware(keys, metrics_key)]
        )
        for path in PATHS:
            app.router.add_get(path, _ok)
        server = TestServer(app)
        await server.start_server()
        headers = {"Authorization": f"Bearer {sent}"} if sent else {}
        try:
            async with aiohttp.ClientSession() as http:
                found = {}
                for path in PATHS:
                    async with http.get(str(server.make_url(path)), headers=headers) as response:
                        found[path] = response.status
                return found
        finally:
            await server.close()

    return asyncio.run(run())


def test_keys_guard_v1_the_spec_and_metrics() -> None:
    assert set(statuses((), None, None).values()) == {200}
    assert statuses(("k1",), None, None) == {
        "/health": 200, "/metrics": 401, "/openapi.json": 401, "/v1/models": 401,
    }  # fmt: skip
    assert set(statuses(("k1",), None, "k1").values()) == {200}
    assert statuses(("k1",), "scrape", "scrape") == {
        "/health": 200, "/metrics": 200, "/openapi.json": 401, "/v1/models": 401,
    }  # fmt: skip
    # With a metrics key, a tenant's key no longer reads the server's counts (every
    # tenant's documents and requests).
    assert statuses(("k1",), "scrape", "k1") == {
        "/health": 200, "/metrics": 401, "/openapi.json": 200, "/v1/models": 200,
    }  # fmt: skip
    # A metrics key alone protects /metrics only.
    assert statuses((), "scrape", None) == {
        "/health": 200, "/metrics": 401, "/openapi.json": 200, "/v1/models": 200,
    }  # fmt: skip


def test_flag_combinations_are_meaningful_or_refused() -> None:
    assert EngineConfig().disk_tier_gib == 0
    assert EngineConfig(kv_disk_dir="/tmp/kv").disk_tier_gib == DEFAULT_DISK_GIB
    assert EngineConfig(kv_disk_dir="/tmp/kv", kv_disk_gib=0.5).disk_tier_gib == 0.5
    assert EngineConfig(kv_disk_gib=0.5).disk_tier_gib == 0.5  # the default folder
    assert EngineConfig(kv_encryption_key_file="/tmp/key").disk_tier_gib == DEFAULT_DISK_GIB
    refused = [
        {"kv_disk_dir": "/tmp/kv", "kv_disk_gib": 0},
        {"enable_prefix_caching": False, "kv_cpu_gib": 1.0},
        {"enable_prefix_caching": False, "kv_disk_dir": "/tmp/kv"},
        {"kv_disk_gib": -1.0},
        {"kv_encryption_key_file": "/tmp/key", "kv_disk_gib": 0},
    ]
    for fields in refused:
        with pytest.raises(ValueError):
            EngineConfig(**fields)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ServerConfig(api_keys=("same",), metrics_key="same")
    with pytest.raises(ValueError):
        ServerConfig(metrics_key="has space")
