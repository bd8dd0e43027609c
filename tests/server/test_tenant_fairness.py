"""One tenant can never crowd out another, on a real ``ragserve serve`` with two API keys.

The flood: tenant A runs many concurrent chats, uploads many documents and submits many
summarization jobs at once, under the default per-tenant limits: 64 requests in flight,
256 documents of 2,000,000 tokens in all, a quarter of the pin budget, 16 queued and 100
kept summarization jobs, 16 KiB of metadata per document. Work admission is off
(``--max-queue-seconds 0``), so all of A's flood that its limits let through reaches the
engine, and only the scheduler keeps B served. Tenant B's requests are still admitted and
answered about as fast as alone, and B's pinned document and finished job are untouched.
Then each per-tenant limit's refusal, on a server with small limits.

NOTE: on a CPU a step's time grows with its tokens and its sequences, and under a flood
every step is full, so B's TTFT is about a step and a half of the flood's (what is left of
the step running when it arrives, then its own). Steps of at most 128 tokens and 32
sequences keep a full step near the time of B's own prompt (about 100 tokens to compute);
B then takes a slot from A when all are A's. A KV cache of 1 GiB holds the whole flood.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
import pytest

from tests.server.server_fixtures import BLOCK_SIZE, ServerProcess, module_server, wait_for

pytestmark = pytest.mark.e2e

KEY_A, KEY_B = "key-flood-a", "key-quiet-b"
A = {"Authorization": f"Bearer {KEY_A}"}
B = {"Authorization": f"Bearer {KEY_B}"}
CHAT = "/v1/chat/completions"
DOCS = "/v1/documents"
JOBS = "/v1/pipelines/summarize"
ACTIVE = "ragserve_num_requests_active"
server = module_server(
    "--api-key", KEY_A, "--api-key", KEY_B, "--max-queue-seconds", "0",
    "--max-num-batched-tokens", "128", "--max-num-seqs", "32", "--kv-cache-gib", "1",
)  # fmt: skip
T = TypeVar("T")

FLOOD_CHATS = 80  # concurrent: more than the 64 a tenant may have in flight
FLOOD_DOCUMENTS = 24
FLOOD_JOBS = 24  # 4 run, 16 wait, the rest are refused
B_REQUESTS = 7


def make_text(topic: str, count: int) -> str:
    """About 15 tokens a sentence."""
    return " ".join(
        f"In the {topic} registry, item {i} has code {(i * 37 + len(topic)) % 101}."
        for i in range(count)
    )


def run(server: ServerProcess, body: Callable[[aiohttp.ClientSession], Awaitable[T]]) -> T:
    async def main() -> T:
        timeout = aiohttp.ClientTimeout(total=180)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(server.url, timeout=timeout, connector=connector) as http:
            return await body(http)

    return asyncio.run(main())


async def call(
    http: aiohttp.ClientSession, method: str, path: str, headers: dict[str, str], body: Any = None
) -> tuple[int, Any, dict[str, str]]:
    async with http.request(method, path, json=body, headers=headers) as response:
        return response.status, await response.json(), dict(response.headers)


async def ttft(http: aiohttp.ClientSession, body: dict[str, Any], headers: dict[str, str]) -> float:
    """Seconds to the first streamed chunk that holds a choice; fails on anything but 200."""
    started = time.perf_counter()
    first = None
    async with http.post(CHAT, json={**body, "stream": True}, headers=headers) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if line.startswith(b"data: {") and first is None:
                assert b'"error"' not in line, line
                if json.loads(line[6:])["choices"]:
                    first = time.perf_counter() - started
    assert first is not None
    return first


async def wait_until(
    http: aiohttp.ClientSession, path: str, headers: dict[str, str], done: Callable[[Any], bool]
) -> Any:
    deadline = time.monotonic() + 120
    while True:
        status, state, _ = await call(http, "GET", path, headers)
        assert status == 200, state
        if done(state) or time.monotonic() > deadline:
            assert done(state), state
            return state
        await asyncio.sleep(0.2)


def question(doc_id: str, index: int) -> dict[str, Any]:
    """About 100 tokens to compute after B's cached document: as long as a step allows."""
    context = " ".join(
        f"Note {index}.{n}: the auditor checked shelf {n * 7 + index}." for n in range(6)
    )
    return {
        "messages": [
            {"role": "user", "content": f"Question {index}. {context} Which code has item {index}?"}
        ],
        "documents": [doc_id],
        "max_tokens": 4,
        "temperature": 0.0,
    }


class Flood:
    """Tenant A's traffic, counted by what the server answered."""

    def __init__(self, http: aiohttp.ClientSession) -> None:
        self.http = http
        self.statuses: Counter[tuple[str, int]] = Counter()
        self.codes: Counter[str] = Counter()
        self.stop = asyncio.Event()
        self.jobs: list[str] = []
        self.documents: list[str] = []

    def count(self, kind: str, status: int, body: Any) -> None:
        self.statuses[(kind, status)] += 1
        if status >= 400 and isinstance(body, dict):
            self.codes[body["error"]["code"]] += 1

    async def chats(self, worker: int) -> None:
        """Chats one after the other; after a refusal, wait as ``Retry-After`` says."""
        body = {
            "messages": [{"role": "user", "content": f"Write a story about the number {worker}."}],
            "max_tokens": 24,
            "ignore_eos": True,
        }
        while not self.stop.is_set():
            status, answer, headers = await call(self.http, "POST", CHAT, A, body)
            self.count("chat", status, answer)
            if status != 200:
                await asyncio.sleep(float(headers.get("Retry-After", "1")))

    async def upload(self, index: int) -> None:
        text = make_text(f"warehouse-{index}", 12)
        status, body, _ = await call(self.http, "POST", DOCS, A, {"text": text})
        self.count("document", status, body)
        if status == 202:
            self.documents.append(body["id"])

    async def submit(self, index: int) -> None:
        job = {
            "text": make_text(f"ledger-{index}", 20),
            "max_summary_tokens": 16,
            "chunk_tokens": 120,
        }
        status, body, _ = await call(self.http, "POST", JOBS, A, job)
        self.count("job", status, body)
        if status == 202:
            self.jobs.append(body["id"])

    async def run(self) -> None:
        """Until ``stop``: the chats go on; the uploads and jobs are submitted at once. Then
        the chats still waiting are dropped (their requests are aborted)."""
        chats = [asyncio.create_task(self.chats(worker)) for worker in range(FLOOD_CHATS)]
        await asyncio.gather(
            *(self.upload(i) for i in range(FLOOD_DOCUMENTS)),
            *(self.submit(i) for i in range(FLOOD_JOBS)),
        )
        await self.stop.wait()
        for task in chats:
            task.cancel()
        await asyncio.gather(*chats, return_exceptions=True)

    async def clean_up(self) -> None:
        for job_id in self.jobs:
            await call(self.http, "DELETE", f"{JOBS}/{job_id}", A)
        for doc_id in self.documents:
            await call(self.http, "DELETE", f"{DOCS}/{doc_id}", A)


def test_a_flood_leaves_the_other_tenant_served(server: ServerProcess) -> None:
    async def body(http: aiohttp.ClientSession) -> dict[str, Any]:
        # B's document, pinned, and B's finished job, before anything else happens.
        status, doc, _ = await call(http, "POST", DOCS, B, {"text": make_text("harbor", 24)})
        assert status == 202, doc
        doc = await wait_until(http, f"{DOCS}/{doc['id']}", B, lambda d: d["status"] != "ingesting")
        assert (
            doc["status"] == "ready" and doc["pinned_tokens"] >= doc["prefix_tokens"] - BLOCK_SIZE
        )
        status, job, _ = await call(
            http, "POST", JOBS, B, {"text": make_text("harbor", 8), "max_summary_tokens": 8}
        )
        assert status == 202, job
        job = await wait_until(http, f"{JOBS}/{job['id']}", B, lambda j: j["status"] == "succeeded")

        await ttft(http, question(doc["id"], 0), B)  # warm up
        alone = [await ttft(http, question(doc["id"], i), B) for i in range(1, B_REQUESTS + 1)]

        flood = Flood(http)
        flooding = asyncio.create_task(flood.run())
        try:
            await asyncio.sleep(3.0)  # A's chats, ingestions and jobs all running
            before = await asyncio.to_thread(server.metrics)
            started = time.perf_counter()
            loaded = [await ttft(http, question(doc["id"], i), B) for i in range(1, B_REQUESTS + 1)]
            elapsed = time.perf_counter() - started
            after = await asyncio.to_thread(server.metrics)
            steps = after["ragserve_engine_steps_total"] - before["ragserve_engine_steps_total"]
            print(
                f"B's TTFTs alone {alone}, under A's flood {loaded}; meanwhile {steps:.0f} steps "
                f"of {elapsed / max(1, steps):.2f} s, "
                f"{after['ragserve_preemptions_total'] - before['ragserve_preemptions_total']:.0f} "
                "preemptions"
            )
            states = [(await call(http, "GET", f"{JOBS}/{job_id}", A))[1] for job_id in flood.jobs]
            a_jobs_running = sum(state["status"] == "running" for state in states)
            # B's document and finished job are untouched by A's uploads and jobs.
            status, doc_after, _ = await call(http, "GET", f"{DOCS}/{doc['id']}", B)
            status_job, job_after, _ = await call(http, "GET", f"{JOBS}/{job['id']}", B)
            # A is served too: its own flood only makes it wait.
            deadline = time.monotonic() + 120
            while not flood.statuses[("chat", 200)] and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
        finally:
            flood.stop.set()
            await flooding
            await flood.clean_up()
        return {
            "alone": alone,
            "loaded": loaded,
            "doc": doc,
            "doc_after": (status, doc_after),
            "job": job,
            "job_after": (status_job, job_after),
            "flood": flood,
            "a_jobs_running": a_jobs_running,
        }

    result = run(server, body)
    flood: Flood = result["flood"]
    alone, loaded = statistics.median(result["alone"]), statistics.median(result["loaded"])
    print(f"B's TTFT median alone {alone * 1000:.0f} ms, under A's flood {loaded * 1000:.0f} ms")
    print(f"A's answers: {dict(flood.statuses)}, error codes {dict(flood.codes)}")
    # A was flooding for real while B was measured, past its own limits (429), and was
    # served too.
    assert result["a_jobs_running"] >= 1
    assert flood.statuses[("chat", 200)] > 0 and flood.statuses[("chat", 429)] > 0
    assert flood.codes["rate_limit_exceeded"] > 0
    assert flood.statuses[("job", 429)] > 0 and flood.statuses[("document", 202)] > 0
    assert loaded <= 3 * alone, (result["alone"], result["loaded"])
    status, doc_after = result["doc_after"]
    assert status == 200 and doc_after["status"] == "ready"
    assert doc_after["pinned_tokens"] == result["doc"]["pinned_tokens"] > 0
    status, job_after = result["job_after"]
    assert status == 200 and job_after["status"] == "succeeded"
    assert job_after["results"] == result["job"]["results"]
    assert wait_for(lambda: server.metrics()[ACTIVE] == 0, 60)


# -- each limit's refusal --------------------------------------------------------------------
limited = module_server(
    "--api-key", KEY_A, "--api-key", KEY_B, "--max-queue-seconds", "0",
    "--max-requests-per-tenant", "2",
    "--max-documents-per-tenant", "3",
    "--max-document-tokens-per-tenant", "1100",
    "--max-document-metadata-bytes", "100",
    "--tenant-pin-share", "0.2",  # of the pin budget: 36 of the 364 KV blocks
    "--max-queued-jobs-per-tenant", "1",
    "--max-kept-jobs-per-tenant", "4",
)  # fmt: skip


def check_429(status: int, body: Any, headers: dict[str, str], *named: str) -> None:
    assert status == 429, (status, body)
    error = body["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert int(headers["Retry-After"]) >= 1
    for text in named:
        assert text in error["message"], error["message"]


def test_requests_in_flight_limit(limited: ServerProcess) -> None:
    long_chat = {
        "messages": [{"role": "user", "content": "Count to one thousand."}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }

    async def body(http: aiohttp.ClientSession) -> None:
        streams = [await http.post(CHAT, json=long_chat, headers=A) for _ in range(2)]
        try:
            for response in streams:
                assert response.status == 200
                await response.content.readline()  # streaming: in flight
            status, refused, headers = await call(
                http, "POST", CHAT, A, {**long_chat, "stream": False}
            )
            check_429(
                status,
                refused,
                headers,
                "2 requests in flight",
                "limit is 2",
                "--max-requests-per-tenant",
            )
            # B's places are its own.
            status, answer, _ = await call(
                http, "POST", CHAT, B, {**long_chat, "max_tokens": 2, "stream": False}
            )
            assert status == 200, answer
        finally:
            for response in streams:
                response.close()  # the client goes away: its requests are aborted
        idle = await asyncio.to_thread(wait_for, lambda: limited.metrics()[ACTIVE] == 0, 30)
        assert idle
        status, answer, _ = await call(
            http, "POST", CHAT, A, {**long_chat, "max_tokens": 2, "stream": False}
        )
        assert status == 200, answer

    run(limited, body)


def test_document_limits_and_pin_share(limited: ServerProcess) -> None:
    async def upload(
        http: aiohttp.ClientSession, headers: dict[str, str], text: str, **metadata: Any
    ) -> tuple[int, Any, dict[str, str]]:
        return await call(http, "POST", DOCS, headers, {"text": text, "metadata": metadata})

    async def ready(http: aiohttp.ClientSession, headers: dict[str, str], doc: Any) -> Any:
        return await wait_until(
            http, f"{DOCS}/{doc['id']}", headers, lambda d: d["status"] == "ready"
        )

    async def body(http: aiohttp.ClientSession) -> None:
        status, first, _ = await upload(http, A, make_text("harbor", 20))
        assert status == 202 and first["tokens"] < 400, first
        status, second, _ = await upload(http, A, make_text("orchard", 32))
        assert status == 202 and first["tokens"] + second["tokens"] < 1100 - 100, second
        first, second = await ready(http, A, first), await ready(http, A, second)
        # A's first document fits its share of the pin budget; the second would not.
        assert first["pinned_tokens"] >= first["prefix_tokens"] - BLOCK_SIZE
        assert second["pinned_tokens"] == 0
        # The same document for B is pinned: B's share is its own.
        status, other, _ = await upload(http, B, make_text("orchard", 32))
        assert status == 202
        other = await ready(http, B, other)
        assert other["pinned_tokens"] == second["prefix_tokens"] // BLOCK_SIZE * BLOCK_SIZE
        # Tokens: 1100 per tenant.
        status, refused, headers = await upload(http, A, make_text("meadow", 30))
        check_429(
            status, refused, headers, "1100 tokens per API key", "--max-document-tokens-per-tenant"
        )
        # Count: 3 per tenant.
        status, third, _ = await upload(http, A, make_text("meadow", 4))
        assert status == 202, third
        status, refused, headers = await upload(http, A, make_text("quarry", 4))
        check_429(
            status,
            refused,
            headers,
            "keeps 3 documents",
            "limit is 3",
            "--max-documents-per-tenant",
        )
        status, _, _ = await call(http, "DELETE", f"{DOCS}/{third['id']}", A)
        assert status == 200
        status, fourth, _ = await upload(http, A, make_text("quarry", 4))
        assert status == 202, fourth
        # Metadata: 100 bytes per document; a 400, since retrying cannot help.
        status, refused, _ = await upload(http, B, make_text("lake", 4), note="x" * 100)
        assert status == 400 and refused["error"]["code"] == "metadata_too_large", refused
        assert "limit is 100" in refused["error"]["message"]
        for headers, doc in ((A, first), (A, second), (A, fourth), (B, other)):
            await call(http, "DELETE", f"{DOCS}/{doc['id']}", headers)

    run(limited, body)
    assert wait_for(lambda: limited.metrics()['ragserve_kv_blocks{state="pinned"}'] == 0, 30)


def test_job_limits_and_per_tenant_retention(limited: ServerProcess) -> None:
    slow = {"text": make_text("quarry", 60), "max_summary_tokens": 64, "chunk_tokens": 160}
    tiny = {"text": make_text("lake", 4), "max_summary_tokens": 4}

    async def submit(
        http: aiohttp.ClientSession, headers: dict[str, str], job: dict[str, Any]
    ) -> tuple[int, Any, dict[str, str]]:
        return await call(http, "POST", JOBS, headers, job)

    async def body(http: aiohttp.ClientSession) -> None:
        # B's four jobs take every running place; B may keep no more unfinished ones.
        running = []
        for _ in range(4):
            status, job, _ = await submit(http, B, slow)
            assert status == 202, job
            running.append(job["id"])
        for job_id in running:
            await wait_until(http, f"{JOBS}/{job_id}", B, lambda j: j["status"] == "running")
        status, refused, headers = await submit(http, B, tiny)
        check_429(
            status, refused, headers, "all 4 summarization jobs", "--max-kept-jobs-per-tenant"
        )
        # A may have one job waiting.
        status, queued, _ = await submit(http, A, tiny)
        assert status == 202 and queued["status"] == "queued", queued
        status, refused, headers = await submit(http, A, tiny)
        check_429(
            status, refused, headers, "1 summarization jobs queued", "--max-queued-jobs-per-tenant"
        )
        for job_id in running:
            status, _, _ = await call(http, "DELETE", f"{JOBS}/{job_id}", B)
            assert status == 200
        done = await wait_until(
            http, f"{JOBS}/{queued['id']}", A, lambda j: j["status"] == "succeeded"
        )
        # B's new jobs push out B's own oldest finished ones, never A's result.
        latest = []
        for _ in range(5):
            status, job, _ = await submit(http, B, tiny)
            assert status == 202, job
            await wait_until(http, f"{JOBS}/{job['id']}", B, lambda j: j["status"] == "succeeded")
            latest.append(job["id"])
        _, listed, _ = await call(http, "GET", JOBS, B)
        assert [job["id"] for job in listed["data"]] == latest[-4:]
        status, still, _ = await call(http, "GET", f"{JOBS}/{queued['id']}", A)
        assert status == 200 and still["results"] == done["results"]

    run(limited, body)
    assert wait_for(lambda: limited.metrics()[ACTIVE] == 0, 30)
