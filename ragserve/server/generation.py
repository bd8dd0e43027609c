"""Running engine requests for one HTTP request: admission, streams, timing, SSE.

Every engine stream is closed (``aclosing``) however the handler ends, so a client that
goes away, or a handler cancelled on disconnect, aborts its engine requests at once and
frees their blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from ragserve.document_reuse import DocumentReuse
from ragserve.engine.async_engine import AsyncEngine
from ragserve.outputs import RequestOutput
from ragserve.sampling_params import SamplingParams
from ragserve.server.admission import Ticket, WorkAdmission
from ragserve.server.errors import bad_request
from ragserve.server.metrics import ServerMetrics

_Item = tuple[int, RequestOutput | BaseException | None]


@dataclass
class GenerationJob:
    """Prompts (already token ids) that share one set of sampling settings."""

    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    namespace: str
    # Per prompt: (prompt tokens to compute, answer tokens), for the server's WorkAdmission.
    work: tuple[list[int], list[int]] | None = None
    # Called as each prompt's engine request is queued (see ``DocumentReaders``).
    on_queued: Callable[[], None] | None = None
    # The documents' spans in every prompt (they lead it) and how to reuse their KV.
    reuse: DocumentReuse | None = None


def make_sampling_params(**kwargs: Any) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise bad_request(str(exc), param=getattr(exc, "param", None)) from None


def check_context(
    prompt_lengths: list[int],
    max_tokens: int | None,
    max_model_len: int,
    what: str,
    max_tokens_param: str = "max_tokens",
) -> None:
    """Reject, with the numbers, prompts that leave no room for what was asked."""
    for length in prompt_lengths:
        if length == 0:
            raise bad_request("the prompt is empty: it needs at least one token", what)
        if length >= max_model_len:
            raise bad_request(
                f"this model's maximum context length is {max_model_len} tokens, but the "
                f"{what} have {length} tokens (at least one new token must fit)",
                what,
                "context_length_exceeded",
            )
        if max_tokens is not None and length + max_tokens > max_model_len:
            raise bad_request(
                f"this model's maximum context length is {max_model_len} tokens, but "
                f"{length + max_tokens} were requested ({length} in the {what}, {max_tokens} "
                f"in the completion); lower {max_tokens_param} or shorten the prompt",
                max_tokens_param,
                "context_length_exceeded",
            )


async def run_job(
    engine: AsyncEngine,
    job: GenerationJob,
    metrics: ServerMetrics,
    endpoint: str,
    admission: WorkAdmission | None = None,
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Cumulative outputs of every prompt, tagged with the prompt's index.

    Engine rejections (ValueError) come out as 400s. The caller must close this iterator
    (``contextlib.aclosing``); closing it aborts every unfinished engine request and
    releases the job's ticket from ``admission``.
    """
    started = time.perf_counter()
    last_seen: dict[int, tuple[float, list[int]]] = {}
    ticket = None
    if admission is not None and job.work is not None:
        sequences = len(job.prompts) * job.params.n
        ticket = admission.admit(sum(job.work[0]), sum(job.work[1]), sequences, job.namespace)
    counted = Progress()
    streams = [
        engine.generate(
            prompt,
            job.params,
            f"{job.request_id}-{index}",
            job.namespace,
            job.on_queued,
            job.reuse,
        )
        for index, prompt in enumerate(job.prompts)
    ]
    try:
        # NOTE: closed with this generator (its client left), not later by the garbage
        # collector: the engine's requests are aborted before the work counts as done.
        async with contextlib.aclosing(_merge(streams)) as outputs:
            async for index, output in outputs:
                now = time.perf_counter()
                counts = [len(c.token_ids) for c in output.outputs]
                num_tokens = sum(counts)
                previous_time, previous = last_seen.get(index, (started, [0] * len(counts)))
                # NOTE: the choices of a prompt advance together, one token a step each,
                # until some finish: the latency is per step of the choice furthest on.
                steps = max(
                    (count - was for count, was in zip(counts, previous, strict=True)), default=0
                )
                if steps > 0:
                    if index not in last_seen:
                        metrics.time_to_first_token.labels(endpoint).observe(now - started)
                    else:
                        per_token = (now - previous_time) / steps
                        metrics.inter_token_latency.labels(endpoint).observe(per_token)
                    last_seen[index] = (now, counts)
                if output.finished:
                    metrics.record_finished(endpoint, output)
                if admission is not None and ticket is not None and job.work is not None:
                    counted.update(admission, ticket, job.work[0][index], index, output, num_tokens)
                yield index, output
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    finally:
        if admission is not None and ticket is not None:
            admission.release(ticket)


@dataclass
class Progress:
    """What a job has already reported to admission, per prompt index."""

    prompt_seen: set[int] = field(default_factory=set)
    generated: dict[int, int] = field(default_factory=dict)

    def update(
        self,
        admission: WorkAdmission,
        ticket: Ticket,
        prompt_estimate: int,
        index: int,
        output: RequestOutput,
        num_tokens: int,
    ) -> None:
        computed = 0
        estimate_done = 0
        if (num_tokens or output.finished) and index not in self.prompt_seen:
            self.prompt_seen.add(index)
            computed = len(output.prompt_token_ids) - output.num_cached_tokens
            estimate_done = prompt_estimate
        new = num_tokens - self.generated.get(index, 0)
        self.generated[index] = num_tokens
        if computed or estimate_done or new:
            admission.progress(ticket, prompt=estimate_done, computed=computed, generated=new)


async def _merge(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as stream:  # type: ignore[type-var]
            async for output in stream:
                yield 0, output
        return
    queue: asyncio.Queue[_Item] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for output in stream:
                    queue.put_nowait((index, output))
        except Exception as exc:
            queue.put_nowait((index, exc))
        else:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class SSEWriter:
    """Server-sent events: ``data: {json}\\n\\n`` per chunk, then ``data: [DONE]``."""

    def __init__(self, request: web.Request, request_id: str) -> None:
        self.request = request
        self.response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Request-Id": request_id,
            }
        )

    async def start(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, payload: dict[str, Any]) -> None:
        await self.response.write(b"data: " + dumps(payload) + b"\n\n")

    async def done(self) -> None:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()


def dumps(payload: Any) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
