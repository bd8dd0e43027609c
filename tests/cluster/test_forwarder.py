"""The ingress's forwarding when a replica dies with a request on its socket: a generation
goes to another replica, a request that changes state fails cleanly (no Ray: two real
loopback servers, one that reads a request and drops the connection as a killed process
does)."""

from __future__ import annotations

import asyncio
import gc
import gzip
import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web

pytest.importorskip("starlette")  # the ingress's responses; installed with ray[serve]

from ragserve.cluster.forwarder import REPLICA_HEADER, Forwarder, read_capped
from ragserve.cluster.settings import ClusterSettings, request_limit


async def _dying_replica(received: list[bytes]) -> tuple[asyncio.Server, str]:
    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await reader.readuntil(b"\r\n\r\n"))
        writer.transport.abort()  # NOTE: reset, no response: the process is gone

    server = await asyncio.start_server(drop, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    """``app`` on a real loopback server; its runner and URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def _replica(handler: Any) -> tuple[web.AppRunner, str]:
    """A real loopback server answering every POST with ``handler``."""
    app = web.Application()
    app.router.add_post("/{tail:.*}", handler)
    return await _serve(app)


async def _live_replica() -> tuple[web.AppRunner, str]:
    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"path": request.path, "body": await request.json()})

    return await _replica(answer)


async def _one_replica_forwarder(url: str) -> Forwarder:
    async def lookup(index: int) -> dict[str, object]:
        return {"url": url, "pid": 1000}

    forwarder = Forwarder(ClusterSettings(replicas=1), lookup)
    await forwarder.start()
    return forwarder


async def _scenario(path: str) -> tuple[int, str | None, bytes, int, list[bool]]:
    received: list[bytes] = []
    dying, dying_url = await _dying_replica(received)
    live, live_url = await _live_replica()
    urls = [dying_url, live_url]

    lookups = [0, 0]

    async def lookup(index: int) -> dict[str, object]:
        lookups[index] += 1
        if index == 0 and lookups[0] > 1:
            raise RuntimeError("replica 0 is restarting")  # as Ray answers meanwhile
        return {"url": urls[index], "pid": 1000 + index}

    forwarder = Forwarder(ClusterSettings(replicas=2, policy="round_robin"), lookup)
    await forwarder.start()
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    try:
        response = await forwarder.handle("POST", path, "", {}, body)
        up = [slot.up for slot in forwarder.slots]
        replica = response.headers.get(REPLICA_HEADER)
        return response.status_code, replica, bytes(response.body), len(received), up
    finally:
        await forwarder.close()
        dying.close()
        await live.cleanup()


def test_a_generation_whose_replica_dies_before_answering_goes_to_another() -> None:
    status, replica, body, sent_to_dying, up = asyncio.run(_scenario("/v1/completions"))
    assert sent_to_dying == 1  # the first replica got it, and died with it
    assert status == 200 and replica == "1"
    assert json.loads(body)["path"] == "/v1/completions"
    assert up[1] and not up[0]  # routed around until its successor answers


def test_an_upload_whose_replica_dies_fails_cleanly_and_is_not_sent_twice() -> None:
    status, _, body, sent_to_dying, _ = asyncio.run(_scenario("/v1/documents"))
    assert sent_to_dying == 1
    assert status == 503
    assert json.loads(body)["error"]["code"] == "replica_lost"


async def _two_replicas_die() -> tuple[int, str, int]:
    """Three replicas; the first and the last die with whatever reaches them (round robin
    sends the request to replica 0, then to replica 2 of the two left)."""
    received: list[bytes] = []
    dying = [await _dying_replica(received) for _ in range(2)]
    live, live_url = await _live_replica()
    urls = [dying[0][1], live_url, dying[1][1]]

    async def lookup(index: int) -> dict[str, object]:
        return {"url": urls[index], "pid": 1000 + index}

    forwarder = Forwarder(ClusterSettings(replicas=3, policy="round_robin"), lookup)
    await forwarder.start()
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    try:
        response = await forwarder.handle("POST", "/v1/completions", "", {}, body)
        code = json.loads(bytes(response.body))["error"]["code"]
        return response.status_code, code, len(received)
    finally:
        await forwarder.close()
        for server, _ in dying:
            server.close()
        await live.cleanup()


def test_a_generation_lost_with_two_replicas_is_not_sent_to_a_third() -> None:
    """A request that itself brings replicas down takes at most two with it."""
    status, code, received = asyncio.run(_two_replicas_die())
    assert (status, code, received) == (503, "replica_lost", 2)


async def _job_replica(name: str) -> tuple[web.AppRunner, str]:
    """A replica keeping summarization jobs in its memory, as a real one does."""
    jobs: dict[str, dict[str, Any]] = {}
    path = "/v1/pipelines/summarize"

    async def create(request: web.Request) -> web.Response:
        job = {"id": f"{name}-{len(jobs)}", "created": len(jobs), "replica": name}
        jobs[job["id"]] = job
        return web.json_response(job, status=202)

    async def listing(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": list(jobs.values())})

    async def one(request: web.Request) -> web.Response:
        job = jobs.get(request.match_info["id"])
        return web.json_response(job or {"error": {}}, status=200 if job else 404)

    async def cancel(request: web.Request) -> web.Response:
        job = jobs.get(request.match_info["id"])
        if job is not None:
            job["status"] = "cancelled"
        return web.json_response(job or {"error": {}}, status=200 if job else 404)

    app = web.Application()
    app.router.add_post(path, create)
    app.router.add_get(path, listing)
    app.router.add_get(path + "/{id}", one)
    app.router.add_delete(path + "/{id}", cancel)
    return await _serve(app)


async def _jobs_through_the_ingress() -> tuple[list[str], set[int], list[int], int]:
    replicas = [await _job_replica(name) for name in ("a", "b")]

    async def lookup(index: int) -> dict[str, object]:
        return {"url": replicas[index][1], "pid": 1000 + index}

    path = "/v1/pipelines/summarize"
    forwarders = [Forwarder(ClusterSettings(replicas=2), lookup) for _ in range(2)]
    try:
        for forwarder in forwarders:
            await forwarder.start()
        first, fresh = forwarders  # NOTE: a fresh ingress never saw the jobs created
        created = [await first.handle("POST", path, "", {}, b"{}") for _ in range(4)]
        ids = [json.loads(bytes(r.body))["id"] for r in created]
        statuses = {
            (await ingress.handle("GET", f"{path}/{job_id}", "", {}, b"")).status_code
            for job_id in ids
            for ingress in (first, fresh, first)
        }
        listed = await fresh.handle("GET", path, "", {}, b"")
        order = [job["created"] for job in json.loads(bytes(listed.body))["data"]]
        missing = await first.handle("GET", f"{path}/none", "", {}, b"")
        return ids, statuses, order, missing.status_code
    finally:
        for forwarder in forwarders:
            await forwarder.close()
        for runner, _ in replicas:
            await runner.cleanup()


def test_a_job_is_found_on_the_replica_that_runs_it_and_listings_gather_every_replicas() -> None:
    ids, statuses, order, missing = asyncio.run(_jobs_through_the_ingress())
    assert {job_id[0] for job_id in ids} == {"a", "b"}  # the jobs went to both replicas
    assert statuses == {200}
    assert sorted(order) == order and len(order) == 4
    assert missing == 404


async def _chunks(*parts: bytes) -> Any:
    for part in parts:
        yield part


def test_the_ingress_refuses_a_body_over_the_replicas_limit_before_holding_it() -> None:
    async def read(declared: str | None, *parts: bytes) -> bytes | int:
        read_parts: list[bytes] = []

        async def counted() -> Any:
            async for part in _chunks(*parts):
                read_parts.append(part)
                yield part

        body = await read_capped(counted(), declared, limit=10)
        if isinstance(body, bytes):
            return body
        assert json.loads(bytes(body.body))["error"]["code"] == "request_too_large"
        return -len(read_parts)  # a refusal, and how many chunks it read first

    assert asyncio.run(read(None, b"01234", b"56789")) == b"0123456789"
    assert asyncio.run(read("11", b"0" * 11)) == 0  # declared too large: nothing read
    assert asyncio.run(read(None, b"0" * 6, b"0" * 6, b"0" * 6)) == -2  # stops at the limit
    assert request_limit(("--max-request-bytes", "4096")) == 4096


async def _cancelled_mid_request() -> int:
    arrived, done = asyncio.Event(), asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        arrived.set()
        await done.wait()  # NOTE: a generation: headers come only when it ends
        return web.json_response({})

    runner, url = await _replica(slow)
    forwarder = await _one_replica_forwarder(url)
    try:
        body = json.dumps({"prompt": "hi"}).encode()
        request = asyncio.ensure_future(forwarder.handle("POST", "/v1/completions", "", {}, body))
        await asyncio.wait_for(arrived.wait(), 10)
        assert forwarder.slots[0].in_flight == 1
        request.cancel()  # NOTE: as the ingress does when its client disconnects
        await asyncio.gather(request, return_exceptions=True)
        return forwarder.slots[0].in_flight
    finally:
        done.set()
        await forwarder.close()
        await runner.cleanup()


def test_a_request_cancelled_while_its_replica_works_leaves_no_load_behind() -> None:
    """The in-flight count routes documents away from busy replicas: a leaked count would
    send them away for good."""
    assert asyncio.run(_cancelled_mid_request()) == 0


async def _first_lookup_fails() -> tuple[bool, bool]:
    runner, url = await _live_replica()
    lookups = [0, 0]

    async def lookup(index: int) -> dict[str, object]:
        lookups[index] += 1
        if index == 1 and lookups[1] == 1:
            raise RuntimeError("replica 1 is restarting")  # as Ray answers meanwhile
        return {"url": url, "pid": 1000 + index}

    forwarder = Forwarder(ClusterSettings(replicas=2), lookup)
    try:
        await forwarder.start()
        up_at_start = forwarder.slots[1].up
        for _ in range(100):
            if forwarder.slots[1].up:
                break
            await asyncio.sleep(0.05)
        return up_at_start, forwarder.slots[1].up
    finally:
        await forwarder.close()
        await runner.cleanup()


def test_a_replica_whose_first_lookup_fails_is_found_later() -> None:
    up_at_start, up_later = asyncio.run(_first_lookup_fails())
    assert not up_at_start and up_later


async def _first_lookup_hangs() -> tuple[bool, str | None, bool]:
    runner, url = await _live_replica()
    started = asyncio.Event()  # NOTE: replica 1 answers no lookup until it has started

    async def lookup(index: int) -> dict[str, object]:
        if index == 1:
            await started.wait()
        return {"url": url, "pid": 1000 + index}

    forwarder = Forwarder(ClusterSettings(replicas=2, start_timeout_s=0.2), lookup)
    try:
        await forwarder.start()
        up_at_start = forwarder.slots[1].up
        body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
        response = await forwarder.handle("POST", "/v1/completions", "", {}, body)
        replica = response.headers.get(REPLICA_HEADER)
        started.set()
        for _ in range(100):
            if forwarder.slots[1].up:
                break
            await asyncio.sleep(0.05)
        return up_at_start, replica, forwarder.slots[1].up
    finally:
        await forwarder.close()
        await runner.cleanup()


def test_a_replica_that_never_answers_its_first_lookup_does_not_hold_the_others_back() -> None:
    up_at_start, replica, up_later = asyncio.run(asyncio.wait_for(_first_lookup_hangs(), 30))
    assert not up_at_start and replica == "0"  # served by the replica that had started
    assert up_later  # found once it started


async def _streams(iterate: bool) -> list[int]:
    async def events(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: one\n\n")
        await response.write_eof()
        return response

    runner, url = await _replica(events)
    forwarder = await _one_replica_forwarder(url)
    try:
        body = json.dumps({"prompt": "hi", "stream": True}).encode()
        response = await forwarder.handle("POST", "/v1/completions", "", {}, body)
        counts = [forwarder.slots[0].in_flight]
        if iterate:
            chunks = [chunk async for chunk in response.body_iterator]  # type: ignore[attr-defined]
            assert b"".join(chunks) == b"data: one\n\n"
        del response  # NOTE: dropped unread: its client left before it streamed
        gc.collect()
        counts.append(forwarder.slots[0].in_flight)
        return counts
    finally:
        await forwarder.close()
        await runner.cleanup()


@pytest.mark.parametrize("iterate", [True, False], ids=["streamed", "dropped unread"])
def test_a_stream_gives_its_in_flight_count_back_once(iterate: bool) -> None:
    assert asyncio.run(_streams(iterate)) == [1, 0]


async def _stalled_replica() -> tuple[asyncio.Server, str]:
    """Accepts, reads a request and never answers (a wedged process)."""

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(3600)

    server = await asyncio.start_server(hang, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _fan_out_past_a_stalled_replica() -> tuple[float, str, list[dict[str, Any]]]:
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="# TYPE ragserve_up gauge\nragserve_up 1\n")

    async def jobs(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "a1", "created": 1}]})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/pipelines/summarize", jobs)
    live, live_url = await _serve(app)
    stalled, stalled_url = await _stalled_replica()
    urls = [live_url, stalled_url]

    async def lookup(index: int) -> dict[str, object]:
        return {"url": urls[index], "pid": 1000 + index}

    forwarder = Forwarder(ClusterSettings(replicas=2, fan_out_timeout_s=0.5), lookup)
    await forwarder.start()
    try:
        started = asyncio.get_running_loop().time()
        scraped = await forwarder.handle("GET", "/metrics", "", {}, b"")
        listed = await forwarder.handle("GET", "/v1/pipelines/summarize", "", {}, b"")
        elapsed = asyncio.get_running_loop().time() - started
        assert scraped.status_code == listed.status_code == 200
        return elapsed, bytes(scraped.body).decode(), json.loads(bytes(listed.body))["data"]
    finally:
        await forwarder.close()
        stalled.close()
        await live.cleanup()


def test_a_stalled_replica_is_left_out_of_the_metrics_and_job_listing() -> None:
    elapsed, text, jobs = asyncio.run(_fan_out_past_a_stalled_replica())
    assert elapsed < 5.0  # two fan-outs of 0.5 s each, not the forwarding time-out
    assert 'ragserve_router_replica_up{replica="0"} 1' in text
    assert 'ragserve_router_replica_up{replica="1"} 0' in text
    assert "ragserve_up" in text
    assert jobs == [{"id": "a1", "created": 1}]


async def _gzip_through_the_ingress() -> tuple[int, bytes]:
    async def echo(request: web.Request) -> web.Response:
        return web.json_response(await request.json())  # decompressed by the replica

    live, url = await _replica(echo)
    forwarder = await _one_replica_forwarder(url)
    body = gzip.compress(json.dumps({"prompt": "hi"}).encode())
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    try:
        response = await forwarder.handle("POST", "/v1/completions", "", headers, body)
        return response.status_code, bytes(response.body)
    finally:
        await forwarder.close()
        await live.cleanup()


def test_a_compressed_request_body_reaches_the_replica_with_its_encoding() -> None:
    status, body = asyncio.run(_gzip_through_the_ingress())
    assert status == 200, body
    assert json.loads(body) == {"prompt": "hi"}


async def _cancel_past_a_stalled_replica() -> tuple[float, int, dict[str, Any]]:
    stalled, stalled_url = await _stalled_replica()
    runner, url = await _job_replica("b")
    urls = [stalled_url, url]

    async def lookup(index: int) -> dict[str, object]:
        return {"url": urls[index], "pid": 1000 + index}

    path = "/v1/pipelines/summarize"
    fresh = Forwarder(ClusterSettings(replicas=2, fan_out_timeout_s=0.5), lookup)
    try:
        await fresh.start()
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{url}{path}", data=b"{}") as created,  # the job runs on b
        ):
            job_id = (await created.json())["id"]
        started = asyncio.get_running_loop().time()
        # A fresh ingress never saw the job: it finds it past the stalled replica.
        cancelled = await fresh.handle("DELETE", f"{path}/{job_id}", "", {}, b"")
        elapsed = asyncio.get_running_loop().time() - started
        return elapsed, cancelled.status_code, json.loads(bytes(cancelled.body))
    finally:
        await fresh.close()
        stalled.close()
        await runner.cleanup()


def test_a_job_is_cancelled_on_its_replica_past_a_stalled_one() -> None:
    elapsed, status, job = asyncio.run(_cancel_past_a_stalled_replica())
    assert status == 200 and job["status"] == "cancelled" and job["replica"] == "b"
    assert elapsed < 5.0  # the stalled replica is left out after 0.5 s
