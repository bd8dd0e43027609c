"""``/health`` tells a dead or stalled engine from a working one (in-process server)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from ragserve.config import EngineConfig
from ragserve.engine.async_engine import AsyncEngine
from ragserve.server.app import create_app
from ragserve.server.config import ServerConfig


def test_health_turns_unhealthy_while_a_step_stalls(
    smollm_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        config = EngineConfig(model=smollm_path, max_model_len=256, kv_cache_gib=0.02)
        engine = AsyncEngine(config)
        server = TestServer(create_app(engine, ServerConfig(engine_stall_seconds=0.5)))
        await server.start_server()
        release = threading.Event()
        try:
            async with aiohttp.ClientSession() as http:
                health = str(server.make_url("/health"))
                async with http.get(health) as response:
                    assert response.status == 200
                execute = engine.engine.runner.execute

                def stuck(*args: Any, **kwargs: Any) -> Any:
                    release.wait(timeout=60)
                    return execute(*args, **kwargs)

                monkeypatch.setattr(engine.engine.runner, "execute", stuck)
                body = {"prompt": [5, 6, 7], "max_tokens": 1, "model": engine.info.model_name}
                request = asyncio.create_task(
                    http.post(str(server.make_url("/v1/completions")), json=body)
                )
                deadline = time.monotonic() + 30
                status = 200
                while status == 200 and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                    async with http.get(health) as response:
                        status, state = response.status, await response.json()
                assert status == 503 and state["status"] == "engine_stalled", state
                release.set()
                reply = await request
                assert reply.status == 200, await reply.text()
                async with http.get(health) as response:
                    assert response.status == 200
        finally:
            release.set()
            await server.close()

    asyncio.run(scenario())
