"""The ingress's work, free of Ray: route a request (:mod:`ragserve.cluster.router`) and
forward it over HTTP to the chosen replica's ragserve server, streaming the answer back.

Failure contract: a request the replica never received (connection refused: the replica is
restarting) is sent to another replica; a completion or chat lost with its replica before
any answer is sent to another one, once; any other request lost with its replica (reset
mid-way) fails with an OpenAI-shaped 503, or, when its stream had started, with a final
SSE ``error`` event; no request hangs on a dead replica (the connection drops with the
process). Summarization jobs live in one replica: see ``_job_request``. A body over the
replicas' size limit is refused before it is held (``read_capped``). ``/cluster/stats``
(JSON) and ``/metrics`` (Prometheus) report the router and each replica (with the
replicas' metrics key, else any of their API keys, when they have keys).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
from starlette.responses import Response, StreamingResponse

from ragserve.cluster.affinity_key import document_key, routing_key
from ragserve.cluster.metrics_merge import merged_replica_lines, router_lines
from ragserve.cluster.router import Router
from ragserve.cluster.settings import ClusterSettings, report_keys
from ragserve.server.errors import error_body
from ragserve.timeouts import within

logger = logging.getLogger(__name__)

# Headers that belong to one connection, or that aiohttp sets again itself. NOTE: not
# Content-Encoding: bodies pass through as they came (compressed), both ways.
_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "host",
    "upgrade",
    "te",
    "trailer",
    "proxy-authorization",
    "proxy-connection",
}
# NOTE: Ray's proxy sets these on every response itself (the request id it passed on).
_PROXY_SETS = {"date", "server", "x-request-id"}
# Generations: sent again to another replica when theirs died before answering.
_RESENDABLE = {"/v1/completions", "/v1/chat/completions"}
JOBS_PATH = "/v1/pipelines/summarize"
REPLICA_HEADER = "X-Ragserve-Replica"
_RETRY_S = 0.5

# Asks replica ``i`` (through Ray) for {"url": ..., "pid": ...}.
AddressLookup = Callable[[int], Awaitable[Mapping[str, Any]]]


@dataclass
class ReplicaSlot:
    url: str | None = None
    pid: int | None = None
    in_flight: int = 0
    lookups: int = 0  # how many times its address was (re)learned: restarts + 1

    @property
    def up(self) -> bool:
        return self.url is not None


class Forwarder:
    """One per ingress; every method runs on the ingress's event loop."""

    def __init__(self, settings: ClusterSettings, lookup: AddressLookup) -> None:
        self.settings = settings
        self.router = Router(settings.replicas, settings.policy, settings.busy_threshold)
        self.slots = [ReplicaSlot() for _ in range(settings.replicas)]
        self._lookup = lookup
        self._session: aiohttp.ClientSession | None = None
        self._probes: dict[int, asyncio.Task[None]] = {}
        self._keys = report_keys(settings.serve_args)

    # -- replicas --------------------------------------------------------------------------
    async def start(self) -> None:
        """Learn every replica's address (waits up to ``start_timeout_s`` for replicas
        still starting); one whose lookup fails or does not answer in time (restarting, or
        failing to start) is looked for in the background until it answers."""
        timeout = self.settings.start_timeout_s
        learned = await asyncio.gather(*(self._learn(i, timeout) for i in range(len(self.slots))))
        for index, found in enumerate(learned):
            if not found:
                self._probes[index] = asyncio.create_task(self._probe(index))

    async def _learn(self, index: int, timeout: float | None) -> bool:
        try:
            found = await within(self._lookup(index), timeout)
        except Exception as exc:  # NOTE: restarting, or Ray not answering: try again later
            logger.info("replica %d: no address yet (%s)", index, type(exc).__name__)
            return False
        slot = self.slots[index]
        slot.url, slot.pid = str(found["url"]), int(found["pid"])
        slot.lookups += 1
        return True

    def _mark_down(self, index: int, url: str) -> None:
        """The replica at ``url`` stopped answering: route around it and look for its
        successor in the background until one answers."""
        slot = self.slots[index]
        if slot.url != url:
            return  # NOTE: already replaced by a newer address
        logger.warning("replica %d at %s is down; routing around it", index, url)
        slot.url = None
        if index not in self._probes or self._probes[index].done():
            self._probes[index] = asyncio.create_task(self._probe(index))

    async def _probe(self, index: int) -> None:
        while not await self._learn(index, self.settings.address_timeout_s):
            await asyncio.sleep(_RETRY_S)
        logger.info("replica %d is back at %s", index, self.slots[index].url)

    def _session_now(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # NOTE: no total time-out (streams last); a read that stalls this long is lost.
            timeout = aiohttp.ClientTimeout(total=None, sock_read=self.settings.forward_timeout_s)
            # NOTE: a connection per request: a request to a replica that just died then
            # fails to connect (and goes to another replica) instead of being written to a
            # kept-alive socket of the dead process and lost. Loopback or LAN connects are
            # cheap next to a generation.
            connector = aiohttp.TCPConnector(force_close=True, limit=0)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=timeout, auto_decompress=False
            )
        return self._session

    async def close(self) -> None:
        for task in self._probes.values():
            task.cancel()
        if self._session is not None:
            await self._session.close()

    # -- requests --------------------------------------------------------------------------
    async def handle(
        self, method: str, path: str, query: str, headers: Mapping[str, str], body: bytes
    ) -> Response:
        if path in ("/cluster/stats", "/metrics") and method == "GET":
            if not self._may_read_reports(headers):
                return _error(401, "a valid API key is required", "invalid_api_key")
            if path == "/metrics":
                return await self._metrics(headers)
            return Response(json.dumps(self.stats()), media_type="application/json")
        if path.startswith(JOBS_PATH):
            return await self._job_request(method, path, query, headers, body)
        return await self._route(routing_key(path, body), method, path, query, headers, body)

    async def _route(
        self,
        key: str | None,
        method: str,
        path: str,
        query: str,
        headers: Mapping[str, str],
        body: bytes,
    ) -> Response:
        """Forward to the replica the router chooses for ``key``; to another when that one
        is not reached, or lost a generation (once)."""
        tried: set[int] = set()
        lost_one = False
        while True:
            loads = [slot.in_flight for slot in self.slots]
            up = [slot.up and i not in tried for i, slot in enumerate(self.slots)]
            if not any(up):
                return _no_replica()
            index = self.router.choose(key, loads, up)
            response = await self._forward(index, method, path, query, headers, body, lost_one)
            if isinstance(response, Response):
                return response
            lost_one = lost_one or response == "lost"
            tried.add(index)

    async def _job_request(
        self, method: str, path: str, query: str, headers: Mapping[str, str], body: bytes
    ) -> Response:
        """Summarization jobs live in the replica that runs them: a new one is bound to it,
        a job's id goes there (or, not bound here, to each replica until one knows it), and
        a listing gathers every replica's."""
        if path == JOBS_PATH and method == "POST":
            created = await self._route(None, method, path, query, headers, body)
            replica = created.headers.get(REPLICA_HEADER)
            if created.status_code == 202 and replica is not None:
                with contextlib.suppress(ValueError, AttributeError):
                    self.router.bind(f"job:{json.loads(bytes(created.body))['id']}", int(replica))
            return created
        up = [i for i, slot in enumerate(self.slots) if slot.up]
        if path == JOBS_PATH:
            answers = await asyncio.gather(
                *(
                    self._fan_out(i, self._forward(i, method, path, query, headers, body))
                    for i in up
                )
            )
            replies = [a for a in answers if isinstance(a, Response)]
            lists = [a for a in replies if a.status_code == 200]
            if not lists:  # NOTE: a refusal (a bad key) is every replica's
                return replies[0] if replies else _no_replica()
            jobs = [job for a in lists for job in json.loads(bytes(a.body))["data"]]
            jobs.sort(key=lambda job: job.get("created", 0))
            listing = json.dumps({"object": "list", "data": jobs})
            return Response(listing, media_type="application/json")
        job = f"job:{path.removeprefix(JOBS_PATH + '/')}"
        owner = self.router.owner(job)
        if owner not in up:
            # NOTE: not bound here: every replica is asked at once whether it runs the job
            # (a read: a stalled replica is left out); a cancel then goes to that one alone
            # and is never given up half-way.
            reads = await asyncio.gather(
                *(self._fan_out(i, self._forward(i, "GET", path, query, headers, b"")) for i in up)
            )
            found = [(i, r) for i, r in zip(up, reads, strict=True) if r and r.status_code != 404]
            if not found:
                return next((r for r in reads if r is not None), _no_replica())
            owner, reply = found[0]
            self.router.bind(job, owner)
            if method == "GET":
                return reply
        answer = await self._forward(owner, method, path, query, headers, body)
        return answer if isinstance(answer, Response) else _no_replica()

    async def _fan_out(
        self, index: int, forwarding: Awaitable[Response | Literal["unreached", "lost"]]
    ) -> Response | None:
        """A call the ingress makes to every replica (``forwarding``: its ``_forward`` to
        replica ``index``): the replica's response, or None when it does not answer
        within ``fan_out_timeout_s``."""
        try:
            answer = await asyncio.wait_for(forwarding, self.settings.fan_out_timeout_s)
        except asyncio.TimeoutError:
            logger.warning("replica %d did not answer in time; left out", index)
            return None
        return answer if isinstance(answer, Response) else None

    async def _forward(
        self,
        index: int,
        method: str,
        path: str,
        query: str,
        headers: Mapping[str, str],
        body: bytes,
        lost_one: bool = False,
    ) -> Response | Literal["unreached", "lost"]:
        """The replica's response, or why the request may go to another replica (see
        ``_may_resend``; ``lost_one``: it was already lost with a replica once)."""
        slot = self.slots[index]
        url = slot.url
        if url is None:
            return "unreached"
        target = f"{url}{path}" + (f"?{query}" if query else "")
        send = {k: v for k, v in headers.items() if k.lower() not in _HOP}
        slot.in_flight += 1
        handed_over = False
        try:
            upstream = await self._session_now().request(method, target, headers=send, data=body)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            slot.in_flight -= 1
            self._mark_down(index, url)
            resend = _may_resend(exc, method, path, lost_one)
            return resend if resend is not None else _lost(index, exc)
        except BaseException:  # NOTE: cancelled (its client left): the count must not leak
            slot.in_flight -= 1
            raise
        try:
            out_headers = {
                k: v
                for k, v in upstream.headers.items()
                if k.lower() not in _HOP and k.lower() not in _PROXY_SETS
            }
            out_headers[REPLICA_HEADER] = str(index)
            kind = upstream.headers.get("Content-Type", "")
            if kind.startswith("text/event-stream"):
                handed_over = True
                done = _once(lambda: self._stream_ended(index, upstream))
                relay = self._relay(index, url, upstream, done)
                # NOTE: a response dropped before it streamed (its client left at once)
                # never runs the relay's ``finally``.
                weakref.finalize(relay, done)
                return StreamingResponse(relay, status_code=upstream.status, headers=out_headers)
            try:
                payload = await upstream.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                self._mark_down(index, url)
                return _lost(index, exc)
            if method == "POST" and path == "/v1/documents" and upstream.status in (200, 202):
                self._bind_upload(payload, index)
            return Response(payload, status_code=upstream.status, headers=out_headers)
        finally:
            if not handed_over:
                upstream.release()
                slot.in_flight -= 1

    async def _relay(
        self, index: int, url: str, upstream: aiohttp.ClientResponse, done: Callable[[], None]
    ) -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self._mark_down(index, url)
            body = error_body(503, _lost_message(index, exc), None, "replica_lost")
            yield f"event: error\ndata: {json.dumps(body)}\n\n".encode()
        finally:
            done()

    def _stream_ended(self, index: int, upstream: aiohttp.ClientResponse) -> None:
        upstream.release()
        self.slots[index].in_flight -= 1

    def _bind_upload(self, payload: bytes, index: int) -> None:
        """The replica an upload went to computes the document: its questions go there."""
        try:
            doc_id = json.loads(payload).get("id")
        except (ValueError, AttributeError):
            return
        key = document_key(doc_id) if isinstance(doc_id, str) else None
        if key is not None and self.router.owner(key) is None:
            self.router.bind(key, index)

    # -- reports ---------------------------------------------------------------------------
    def _may_read_reports(self, headers: Mapping[str, str]) -> bool:
        if not self._keys:
            return True
        scheme, _, token = headers.get("authorization", "").partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        # NOTE: every key compared, so the time taken does not tell which one matched.
        matches = [hmac.compare_digest(given, key.encode()) for key in self._keys]
        return any(matches)

    def stats(self) -> dict[str, Any]:
        replicas = [
            {
                "index": i,
                "url": slot.url,
                "pid": slot.pid,
                "up": slot.up,
                "in_flight": slot.in_flight,
                "starts_seen": slot.lookups,
            }
            for i, slot in enumerate(self.slots)
        ]
        return {
            "policy": self.settings.policy,
            "busy_threshold": self.settings.busy_threshold,
            "router": self.router.stats.as_json(),
            "replicas": replicas,
        }

    async def _metrics(self, headers: Mapping[str, str]) -> Response:
        send = {k: v for k, v in headers.items() if k.lower() == "authorization"}
        scrape_timeout = aiohttp.ClientTimeout(total=self.settings.fan_out_timeout_s)

        async def scrape(url: str) -> str | None:
            try:
                async with self._session_now().get(
                    f"{url}/metrics", headers=send, timeout=scrape_timeout
                ) as reply:
                    return await reply.text() if reply.status == 200 else None
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return None  # NOTE: reported as not scraped (replica_up 0)

        urls = {i: slot.url for i, slot in enumerate(self.slots) if slot.url is not None}
        texts = await asyncio.gather(*(scrape(url) for url in urls.values()))
        scraped = {i: text for i, text in zip(urls, texts, strict=True) if text is not None}
        lines = router_lines(
            self.router.stats,
            [slot.in_flight for slot in self.slots],
            [i in scraped for i in range(len(self.slots))],
        )
        lines += merged_replica_lines(scraped)
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


async def read_capped(
    chunks: AsyncIterator[bytes], declared: str | None, limit: int
) -> bytes | Response:
    """A request body of at most ``limit`` bytes, or the 413 that refuses it, before more
    than that is held: the ingress reads bodies before any replica checks the key, so an
    unauthenticated client must not make it hold more than a replica would."""
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        return _too_large(limit)
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            return _too_large(limit)
        parts.append(chunk)
    return b"".join(parts)


def _no_replica() -> Response:
    return _error(503, "no replica is available; try again shortly", "no_replica")


def _too_large(limit: int) -> Response:
    return _error(413, f"the request body is over {limit} bytes", "request_too_large")


def _may_resend(
    exc: BaseException, method: str, path: str, lost_one: bool
) -> Literal["unreached", "lost"] | None:
    """Whether a request whose forwarding failed with ``exc`` may go to another replica:
    when it never reached its replica (connection refused), or when the connection broke
    before any response and the request is a generation (its replica died with it; a
    generation sent again changes nothing a client sees twice), once: a request that
    itself brings replicas down must not take them all. A time-out may mean a replica
    still at work, so it is never resent."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "unreached"
    disconnected = isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError)
    if disconnected and method == "POST" and path in _RESENDABLE and not lost_one:
        return "lost"
    return None


def _lost_message(index: int, exc: BaseException) -> str:
    return f"replica {index} was lost while serving this request ({type(exc).__name__}); retry it"


def _lost(index: int, exc: BaseException) -> Response:
    return _error(503, _lost_message(index, exc), "replica_lost")


def _error(status: int, message: str, code: str) -> Response:
    return Response(
        json.dumps(error_body(status, message, None, code)),
        status_code=status,
        media_type="application/json",
    )


def _once(action: Callable[[], None]) -> Callable[[], None]:
    """``action`` on the first call only."""
    pending = [action]

    def run() -> None:
        if pending:
            pending.pop()()

    return run
