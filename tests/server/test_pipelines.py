"""Summarization jobs on a real ``ragserve serve`` with two API keys (two tenants)."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
import pytest

from ragserve.server.summarize_jobs import PrioritySlots
from tests.server.server_fixtures import ServerProcess, module_server, wait_for

KEY_A, KEY_B = "key-summaries-a", "key-summaries-b"
A = {"Authorization": f"Bearer {KEY_A}"}
B = {"Authorization": f"Bearer {KEY_B}"}
# NOTE: no limit on queued work here: these tests fill the job queue on purpose (work
# admission of jobs: test_admission.py). One tenant may queue more jobs than the server
# as a whole (64), so the server's bound is the one a single tenant meets (the per-tenant
# limits: test_tenant_fairness.py).
server = module_server(
    "--api-key", KEY_A, "--api-key", KEY_B, "--max-queue-seconds", "0",
    "--max-queued-jobs-per-tenant", "65",
)  # fmt: skip

PATH = "/v1/pipelines/summarize"
USED = 'ragserve_kv_blocks{state="used"}'
ACTIVE = "ragserve_num_requests_active"
FINISHED = 'ragserve_pipeline_jobs_total{pipeline="summarize",status="%s"}'
PENDING = ("queued", "running")
SHORT = "The harbor opens at six. Boats leave at seven and come back before dark."
T = TypeVar("T")


def make_text(topic: str, count: int) -> str:
    """About 15 tokens a sentence, in paragraphs of four sentences."""
    sentences = [
        f"In the {topic} registry, item {i} has code {(i * 37 + len(topic)) % 101}."
        for i in range(count)
    ]
    return "\n\n".join(" ".join(sentences[i : i + 4]) for i in range(0, count, 4))


def run(server: ServerProcess, body: Callable[[aiohttp.ClientSession], Awaitable[T]]) -> T:
    async def main() -> T:
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(server.url, timeout=timeout) as http:
            return await body(http)

    return asyncio.run(main())


async def call(
    http: aiohttp.ClientSession,
    method: str,
    path: str,
    headers: dict[str, str],
    body: Any = None,
) -> tuple[int, Any]:
    async with http.request(method, path, json=body, headers=headers) as response:
        return response.status, await response.json()


async def submit(
    http: aiohttp.ClientSession, body: dict[str, Any], headers: dict[str, str] = A
) -> dict[str, Any]:
    status, job = await call(http, "POST", PATH, headers, body)
    assert status == 202, job
    assert re.fullmatch("[0-9a-f]{32}", job["id"]) and job["object"] == "pipeline.summarize"
    assert job["status"] in PENDING and isinstance(job["created"], int)
    return dict(job)


async def wait_job(
    http: aiohttp.ClientSession,
    job_id: str,
    until: Callable[[dict[str, Any]], bool] = lambda job: job["status"] not in PENDING,
    timeout: float = 45.0,
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        status, job = await call(http, "GET", f"{PATH}/{job_id}", A)
        assert status == 200, job
        if until(job) or time.monotonic() > deadline:
            assert until(job), job
            return dict(job)
        await asyncio.sleep(0.1)


def check_error(status: int, body: Any, expected: int, param: str | None = None) -> str:
    """An OpenAI-style error of status ``expected``; returns its message."""
    assert status == expected, (status, body)
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return str(error["message"])


@pytest.mark.e2e
def test_short_text_takes_one_call(server: ServerProcess) -> None:
    async def body(http: aiohttp.ClientSession) -> dict[str, Any]:
        job = await submit(http, {"text": SHORT, "max_summary_tokens": 16})
        done = await wait_job(http, job["id"])
        _, listed = await call(http, "GET", PATH, A)
        assert job["id"] in {j["id"] for j in listed["data"]}
        return done

    job = run(server, body)
    assert job["status"] == "succeeded" and job["error"] is None, job
    progress = job["progress"]
    assert progress["documents_done"] == progress["documents_total"] == 1
    assert progress["calls_done"] == progress["calls_total"] == progress["chunks"] == 1
    (result,) = job["results"]
    assert result["index"] == 0 and result["source"] == "text[0]"
    assert result["num_chunks"] == result["num_calls"] == 1 and result["reduce_depth"] == 0
    assert 1 <= result["generated_tokens"] == progress["generated_tokens"] <= 16
    assert result["summary"] and result["summary_tokens"] <= 16
    assert result["seconds"] > 0 and job["finished_at"] >= job["started_at"] >= job["created"]


@pytest.mark.e2e
def test_long_text_is_mapped_and_reduced(server: ServerProcess) -> None:
    options = {"max_summary_tokens": 16, "chunk_tokens": 48, "overlap_tokens": 8}
    before = server.metrics()
    job = run(
        server,
        lambda s: _submit_and_wait(s, {"texts": [make_text("harbor", 20), SHORT], **options}),
    )
    assert job["status"] == "succeeded", job
    assert job["options"] == {**options, "temperature": 0.0, "seed": 0}
    long, short = job["results"]
    assert (long["index"], short["index"]) == (0, 1)
    assert long["document_tokens"] > 4 * 48 and long["num_chunks"] >= 5
    assert long["reduce_depth"] >= 1 and long["num_calls"] >= long["num_chunks"] + 1
    assert short["num_calls"] == 1 and short["reduce_depth"] == 0
    for result in (long, short):
        assert result["summary"] and result["summary_tokens"] <= 16
    progress = job["progress"]
    assert progress["chunks"] == long["num_chunks"] + 1
    assert progress["calls_done"] == progress["calls_total"] == long["num_calls"] + 1
    generated = long["generated_tokens"] + short["generated_tokens"]
    assert progress["generated_tokens"] == generated
    assert wait_for(lambda: server.metrics()[USED] == 0, 10)
    after = server.metrics()
    tokens = 'ragserve_request_completion_tokens_total{endpoint="/v1/pipelines/summarize"}'
    assert after[tokens] - before.get(tokens, 0.0) == generated
    assert after[FINISHED % "succeeded"] - before.get(FINISHED % "succeeded", 0.0) == 1


async def _submit_and_wait(http: aiohttp.ClientSession, body: dict[str, Any]) -> dict[str, Any]:
    job = await submit(http, body)
    return await wait_job(http, job["id"])


@pytest.mark.e2e
def test_bad_inputs_get_errors(server: ServerProcess) -> None:
    async def body(http: aiohttp.ClientSession) -> None:
        _, models = await call(http, "GET", "/v1/models", A)
        max_len = models["data"][0]["max_model_len"]
        cases: list[tuple[dict[str, Any], str | None, list[str]]] = [
            ({}, None, ["exactly one of text, texts or documents", "none"]),
            ({"text": "a", "texts": ["b"]}, None, ["text and texts"]),
            ({"text": ""}, "text", ["at least 1 character"]),
            ({"text": " \n "}, "text", ["whitespace"]),
            ({"texts": []}, "texts", ["at least 1 item"]),
            ({"texts": ["ok", " "]}, "texts", ["texts[1]", "whitespace"]),
            ({"texts": ["x"] * 65}, "texts", ["at most 64"]),
            ({"text": 5}, "text", []),
            ({"text": "x", "max_summary_tokens": 0}, "max_summary_tokens", ["1"]),
            ({"text": "x", "temperature": 3}, "temperature", ["2"]),
            (
                {"text": "x", "max_summary_tokens": 16, "chunk_tokens": 20},
                "chunk_tokens",
                ["at least 33", "max_summary_tokens 16", "got 20"],
            ),
            (
                {"text": "x", "max_summary_tokens": 16, "chunk_tokens": 100, "overlap_tokens": 50},
                "overlap_tokens",
                ["[0, 50)", "got 50"],
            ),
            ({"text": "x", "chunk_tokens": 10**6}, "chunk_tokens", ["1000000", "context"]),
            (
                {"text": "x", "max_summary_tokens": max_len},
                "max_summary_tokens",
                [f"max_summary_tokens {max_len}", "context"],
            ),
            ({"documents": ["ABC"]}, "documents", ["32 lowercase hex"]),
        ]
        for request, param, fragments in cases:
            status, answer = await call(http, "POST", PATH, A, request)
            message = check_error(status, answer, 400, param)
            for fragment in fragments:
                assert fragment in message, (request, message)
        status, answer = await call(http, "POST", PATH, A, {"documents": ["0" * 32]})
        check_error(status, answer, 404, "documents")
        async with http.post(
            PATH, data=b"[1]", headers={**A, "Content-Type": "application/json"}
        ) as r:
            check_error(r.status, await r.json(), 400)
        async with http.post(PATH, data=b"text", headers={**A, "Content-Type": "text/plain"}) as r:
            check_error(r.status, await r.json(), 415)
        for method in ("GET", "DELETE"):
            status, answer = await call(http, method, f"{PATH}/{'0' * 32}", A)
            assert answer["error"]["code"] == "job_not_found"
            check_error(status, answer, 404)

    run(server, body)


@pytest.mark.e2e
def test_uploaded_documents_and_tenant_isolation(server: ServerProcess) -> None:
    async def body(http: aiohttp.ClientSession) -> None:
        status, doc = await call(http, "POST", "/v1/documents", A, {"text": make_text("mill", 8)})
        assert status == 202, doc
        request = {"documents": [doc["id"]], "max_summary_tokens": 16, "chunk_tokens": 64}
        job = await _submit_and_wait(http, request)
        assert job["status"] == "succeeded", job
        (result,) = job["results"]
        assert result["id"] == doc["id"] and result["source"] == "documents[0]"
        # The server's wrapper around the document is not summarized.
        assert doc["tokens"] - 12 <= result["document_tokens"] < doc["tokens"]
        assert result["num_chunks"] >= 2 and result["summary_tokens"] <= 16

        path = f"{PATH}/{job['id']}"
        for method in ("GET", "DELETE"):
            check_error(*await call(http, method, path, B), 404)
        _, listed_b = await call(http, "GET", PATH, B)
        assert job["id"] not in {j["id"] for j in listed_b["data"]}
        check_error(*await call(http, "POST", PATH, B, request), 404, "documents")
        status, still = await call(http, "GET", path, A)
        assert status == 200 and still["status"] == "succeeded"
        status, missing = await call(http, "GET", PATH, {})
        check_error(status, missing, 401)

    run(server, body)


def test_priority_slots_order_and_cancellation() -> None:
    async def main() -> None:
        slots = PrioritySlots(1)
        order: list[str] = []

        async def waiter(priority: int, name: str) -> None:
            await slots.acquire(priority)
            order.append(name)
            await asyncio.sleep(0)
            slots.release()

        await slots.acquire(0)
        tasks = [
            asyncio.create_task(waiter(priority, name))
            for priority, name in ((3, "c1"), (1, "a"), (-1, "gone"), (3, "c2"), (2, "b"))
        ]
        await asyncio.sleep(0)
        tasks[2].cancel()  # a cancelled waiter is skipped
        await asyncio.sleep(0)
        slots.release()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert order == ["a", "b", "c1", "c2"]
        # A slot handed to a waiter cancelled before it could run goes back.
        await slots.acquire(0)
        late = asyncio.create_task(slots.acquire(0))
        await asyncio.sleep(0)
        slots.release()
        late.cancel()
        await asyncio.gather(late, return_exceptions=True)
        await asyncio.wait_for(slots.acquire(0), 1.0)

    asyncio.run(main())


def _slow_job() -> dict[str, Any]:
    """Six map calls of up to 64 tokens each: seconds of work on a CPU."""
    return {"text": make_text("quarry", 60), "max_summary_tokens": 64, "chunk_tokens": 160}


@pytest.mark.e2e
def test_cancel_running_job_frees_blocks(server: ServerProcess) -> None:
    assert wait_for(lambda: server.metrics()[ACTIVE] == 0, 30)
    before = server.metrics().get(FINISHED % "cancelled", 0.0)

    async def body(http: aiohttp.ClientSession) -> tuple[dict[str, Any], dict[str, Any]]:
        job = await submit(http, _slow_job())
        await wait_job(http, job["id"], lambda j: j["progress"]["calls_total"] > 0)
        assert wait_for(lambda: server.metrics()[USED] > 0, 10)
        status, cancelled = await call(http, "DELETE", f"{PATH}/{job['id']}", A)
        assert status == 200, cancelled
        _, again = await call(http, "DELETE", f"{PATH}/{job['id']}", A)
        return cancelled, again

    cancelled, again = run(server, body)
    assert cancelled["status"] == "cancelled" and cancelled["error"] == "cancelled by the client"
    assert cancelled["progress"]["documents_done"] == 0 and not cancelled["results"]
    assert again == cancelled
    assert wait_for(lambda: server.metrics()[USED] == 0 == server.metrics()[ACTIVE], 10)
    assert server.metrics()[FINISHED % "cancelled"] == before + 1


@pytest.mark.e2e
def test_queue_bound_and_retention(server: ServerProcess) -> None:
    """64 jobs may wait while 4 run; beyond that 503. 100 jobs are kept, oldest finished first."""
    tiny = {"text": SHORT, "max_summary_tokens": 4}

    async def body(http: aiohttp.ClientSession) -> None:
        _, listed = await call(http, "GET", PATH, A)
        oldest = [job["id"] for job in listed["data"]]
        running = [(await submit(http, _slow_job()))["id"] for _ in range(4)]
        queued: list[str] = []
        while len(queued) <= 64:
            async with http.post(PATH, json=tiny, headers=A) as response:
                answer = await response.json()
                if response.status != 202:
                    assert response.headers["Retry-After"] == "1"
                    break
            queued.append(answer["id"])
        message = check_error(response.status, answer, 503)
        assert answer["error"]["code"] == "too_many_jobs" and "limit 64" in message
        assert len(queued) == 64
        assert (
            server.metrics()['ragserve_pipeline_jobs_active{pipeline="summarize",status="queued"}']
            == 64
        )
        for job_id in running + queued:
            status, job = await call(http, "DELETE", f"{PATH}/{job_id}", A)
            assert status == 200 and job["status"] == "cancelled"
        oldest += running + queued
        while len(oldest) <= 100:
            oldest.append((await submit(http, tiny))["id"])
            await call(http, "DELETE", f"{PATH}/{oldest[-1]}", A)
        _, listed = await call(http, "GET", PATH, A)
        assert [job["id"] for job in listed["data"]] == oldest[-100:]
        status, gone = await call(http, "GET", f"{PATH}/{oldest[0]}", A)
        check_error(status, gone, 404)

    run(server, body)
    assert wait_for(lambda: server.metrics()[USED] == 0 == server.metrics()[ACTIVE], 10)


@pytest.mark.e2e
def test_shutdown_cancels_running_jobs(server: ServerProcess) -> None:
    """Runs last: stops the module's server."""

    async def body(http: aiohttp.ClientSession) -> None:
        job = await submit(http, _slow_job())
        await wait_job(http, job["id"], lambda j: j["progress"]["calls_total"] > 0)

    run(server, body)
    server.send_signal(signal.SIGTERM)
    assert server.wait(30) == 0
    log = server.log()
    assert "cancelled 1 unfinished summarization jobs" in log and "engine stopped" in log
    assert "Traceback" not in log
