"""A request's own fault fails that request alone, against a real server with two tenants.

The server runs with the test-only sampling fault hook: a request whose id contains
``faulty`` raises while its token is drawn. Eight victims from two tenants, a document
ingestion and a summarization job run beside it and must not notice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from ragserve.engine.guarded_sampling import FAIL_SAMPLING_ENV
from tests.server.server_fixtures import BASE_ARGS, ServerProcess

pytestmark = pytest.mark.e2e

KEY_A, KEY_B = "key-isolation-a", "key-isolation-b"
TENANTS = [{"Authorization": f"Bearer {KEY_A}"}, {"Authorization": f"Bearer {KEY_B}"}]
QUESTIONS = [
    "Name three colours.",
    "What is two plus two?",
    "Say hello in French.",
    "Name a large animal.",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory: Path = tmp_path_factory.mktemp("isolation")
    args = [*BASE_ARGS, "--dtype", "float32", "--api-key", KEY_A, "--api-key", KEY_B,
            "--max-queue-seconds", "0"]  # fmt: skip
    with ServerProcess(
        args, directory / "server.log", env={FAIL_SAMPLING_ENV: "faulty"}, start_timeout=180
    ).start() as process:
        yield process


def victim(index: int) -> tuple[dict[str, str], dict[str, Any]]:
    """Request ``index`` of 8: alternate tenants, greedy and seeded sampling."""
    body: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": QUESTIONS[index % 4]}],
        "max_tokens": 12,
    }
    if index % 2:
        body |= {"temperature": 0.9, "top_k": 40, "seed": index}
    else:
        body["temperature"] = 0
    return TENANTS[index % 2], body


async def chat(
    http: aiohttp.ClientSession, url: str, headers: dict[str, str], body: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as response:
        return response.status, await response.json()


async def victims(http: aiohttp.ClientSession, url: str) -> list[str]:
    results = await asyncio.gather(*(chat(http, url, *victim(i)) for i in range(8)))
    assert all(status == 200 for status, _ in results), results
    return [reply["choices"][0]["message"]["content"] for _, reply in results]


async def wait_until(
    http: aiohttp.ClientSession, url: str, headers: dict[str, str], done: Any
) -> Any:
    for _ in range(600):
        async with http.get(url, headers=headers) as response:
            state = await response.json()
        if done(state):
            return state
        await asyncio.sleep(0.2)
    raise AssertionError(f"still not done: {state}")


def test_faults_of_one_request_leave_the_others_untouched(server: ServerProcess) -> None:
    async def scenario() -> None:
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            alone = await victims(http, server.url)

            a, b = TENANTS
            text = " ".join(
                f"Clause {i}: the tenant pays the rent on the first day." for i in range(40)
            )
            async with http.post(
                f"{server.url}/v1/documents", json={"text": text}, headers=a
            ) as response:
                assert response.status == 202, await response.text()
                doc = await response.json()
            job_body = {"texts": [text], "max_summary_tokens": 8, "chunk_tokens": 128}
            async with http.post(
                f"{server.url}/v1/pipelines/summarize", json=job_body, headers=b
            ) as response:
                assert response.status in (200, 202), await response.text()
                job = await response.json()

            faulty = {**victim(0)[1], "temperature": 1.0}
            overflow = {**victim(0)[1], "temperature": 1.0, "top_k": 10**20}
            together = await asyncio.gather(
                victims(http, server.url),
                chat(http, server.url, {**a, "X-Request-Id": "faulty-1"}, faulty),
                chat(http, server.url, b, overflow),
            )
            outputs, (fault_status, fault), (overflow_status, overflow_reply) = together
            assert outputs == alone
            assert fault_status == 500 and fault["error"]["code"] == "request_failed", fault
            assert "injected sampling fault" in fault["error"]["message"]
            assert overflow_status == 400 and overflow_reply["error"]["param"] == "top_k", (
                overflow_reply
            )

            ready = await wait_until(
                http,
                f"{server.url}/v1/documents/{doc['id']}",
                a,
                lambda s: s["status"] != "ingesting",
            )
            assert ready["status"] == "ready", ready
            finished = await wait_until(
                http,
                f"{server.url}/v1/pipelines/summarize/{job['id']}",
                b,
                lambda s: s["status"] not in ("queued", "running"),
            )
            assert finished["status"] == "succeeded", finished
            async with http.get(f"{server.url}/health") as response:
                assert response.status == 200

    asyncio.run(scenario())
