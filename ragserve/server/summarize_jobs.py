"""Summarization jobs on the server's engine: a per-tenant registry and the async runner.

A job is the map-reduce plan of :mod:`pipelines.summarize` (``Summarizer`` /
``DocumentJob``) driven by asyncio instead of ``RequestPump``: every map and reduce call is
an ``AsyncEngine.generate`` stream, so job requests share continuous batching with live
traffic. A document's next reduce level is planned the moment its last call of the
current level finishes.

Bounds: at most ``max_running`` jobs run at once, a freed place going to the tenants
with queued jobs in turn; each job has at most ``concurrency`` engine requests in flight
(calls of earlier documents enter first, so documents finish roughly in order). At most
``max_queued`` jobs wait in all (503 past it: the server is busy). Per tenant
(:class:`~ragserve.server.tenant_limits.JobLimits`, 429 past them): at most
``max_queued_jobs_per_tenant`` wait, and at most ``max_kept_jobs_per_tenant`` are kept,
the tenant's own oldest finished one dropped to make room, so one tenant's jobs never
push out another's results. Cancelling a job (or closing the registry on shutdown)
cancels its tasks; each closed stream aborts its engine request, which frees its blocks.

Tokenizer work (planning, recording each call's summary) runs on the prompt builder's
tokenizer thread; a ``DocumentJob`` is only ever touched there, one call at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from pipelines.documents import Document
from pipelines.summarize import Call, DocumentJob, SummarizeOptions, Summarizer
from ragserve.engine.async_engine import AsyncEngine, EngineRequestError
from ragserve.server.admission import Ticket, WorkAdmission
from ragserve.server.admission_checks import check_work
from ragserve.server.config import ServerConfig
from ragserve.server.errors import APIError, bad_request
from ragserve.server.fair_slots import TenantSlots
from ragserve.server.metrics import ServerMetrics
from ragserve.server.prompts import PromptBuilder
from ragserve.server.tenant_limits import (
    IN_FLIGHT_RETRY_AFTER_S,
    QUOTA_RETRY_AFTER_S,
    JobLimits,
    over_limit,
)

logger = logging.getLogger(__name__)

ENDPOINT = "/v1/pipelines/summarize"
PIPELINE = "summarize"
JOB_ID_LENGTH = 32
Status = Literal["queued", "running", "succeeded", "failed", "cancelled"]
PENDING: tuple[Status, ...] = ("queued", "running")
_OPTION_NAMES = ("max_summary_tokens", "chunk_tokens", "overlap_tokens", "temperature")


@dataclass(eq=False)
class SummarizeJob:
    """One request's documents, its plan settings, progress and per-document results.

    Counters are updated on the event loop as calls finish; ``calls_total`` counts the calls
    planned so far and grows as reduce levels are planned. ``results`` has one slot per
    input document, filled as documents finish.
    """

    id: str
    namespace: str
    documents: list[Document]
    summarizer: Summarizer
    created: int
    status: Status = "queued"
    error: str | None = None
    started_at: int | None = None
    finished_at: int | None = None
    documents_done: int = 0
    chunks: int = 0
    calls_done: int = 0
    calls_total: int = 0
    generated_tokens: int = 0
    results: list[dict[str, Any] | None] = field(default_factory=list)
    cancel_reason: str | None = None
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        summarizer = self.summarizer
        options = summarizer.options
        return {
            "id": self.id,
            "object": "pipeline.summarize",
            "created": self.created,
            "status": self.status,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "options": {
                "max_summary_tokens": summarizer.max_summary_tokens,
                "chunk_tokens": summarizer.chunk_tokens,
                "overlap_tokens": summarizer.overlap_tokens,
                "temperature": options.temperature,
                "seed": options.seed,
            },
            "progress": {
                "documents_done": self.documents_done,
                "documents_total": len(self.results),
                "chunks": self.chunks,
                "calls_done": self.calls_done,
                "calls_total": self.calls_total,
                "generated_tokens": self.generated_tokens,
            },
            "results": [result for result in self.results if result is not None],
            "error": self.error,
        }


class CallRejectedError(RuntimeError):
    """The engine refused one of a job's calls (``ValueError`` from ``generate``)."""


class PrioritySlots:
    """At most ``size`` holders; waiters get a slot lowest ``priority`` first, then FIFO."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self._free = size
        self._order = itertools.count()
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []

    async def acquire(self, priority: int) -> None:
        if self._free and not self._waiters:
            self._free -= 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (priority, next(self._order), future))
        try:
            await future
        except asyncio.CancelledError:
            # NOTE: a slot handed over just before the cancellation landed must go back.
            if future.done() and not future.cancelled():
                self.release()
            raise

    def release(self) -> None:
        while self._waiters:
            _, _, future = heapq.heappop(self._waiters)
            if not future.done():  # cancelled waiters are skipped
                future.set_result(None)
                return
        self._free += 1


async def run_all(awaitables: Iterable[Awaitable[None]]) -> None:
    """Run concurrently; the first failure (or our cancellation) cancels and awaits the rest."""
    tasks = [asyncio.ensure_future(item) for item in awaitables]
    try:
        if tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class SummarizeJobs:
    """Every tenant's summarization jobs and their tasks. Event-loop only."""

    def __init__(
        self,
        engine: AsyncEngine,
        prompts: PromptBuilder,
        metrics: ServerMetrics,
        admission: WorkAdmission | None = None,
        *,
        limits: JobLimits | None = None,
        max_queued: int = 64,
        max_running: int = 4,
        concurrency: int = 16,
    ) -> None:
        if min(max_queued, max_running, concurrency) < 1:
            raise ValueError(
                f"job limits must be >= 1, got max_queued={max_queued}, "
                f"max_running={max_running}, concurrency={concurrency}"
            )
        self.engine = engine
        self.prompts = prompts
        self.metrics = metrics
        self.admission = admission
        self._tickets: dict[str, Ticket] = {}  # job id -> its work in ``admission``
        self.limits = limits or JobLimits.from_config(ServerConfig())
        self.max_queued = max_queued
        self.concurrency = min(concurrency, engine.info.max_num_seqs)
        self._running = TenantSlots(max_running)
        self._jobs: dict[str, SummarizeJob] = {}  # creation order: oldest first
        self._request_ids = itertools.count()
        self._closed = False

    # -- planning (validation at the edge) ---------------------------------------------------
    async def summarizer(self, options: SummarizeOptions) -> Summarizer:
        """The resolved plan settings, or a 400 naming the option and the numbers involved.

        One call may use the model's context or the whole KV cache, whichever is smaller
        (the engine refuses larger requests), so the default chunk fits both.
        """
        max_model_len = self.engine.max_model_len
        cache_tokens = self.engine.info.kv_cache_tokens
        context = min(max_model_len, cache_tokens)
        try:
            prompts = self.prompts
            return await prompts.run(
                Summarizer, prompts.tokenizer, context, options, prompts.plain_tokenizer
            )
        except ValueError as exc:
            message = str(exc)
            param = next((name for name in _OPTION_NAMES if message.startswith(name)), None)
            if options.chunk_tokens is None and param == "chunk_tokens":
                message = (
                    f"max_summary_tokens {options.max_summary_tokens} leaves too little room in "
                    f"the context of {context} tokens: {message}"
                )
                param = "max_summary_tokens"
            if context < max_model_len and "context" in message:
                message += (
                    f" (one call's context is {context} tokens: all the KV cache holds, "
                    f"less than max_model_len {max_model_len})"
                )
            raise bad_request(message, param, "invalid_summarize_options") from None

    # -- the registry ------------------------------------------------------------------------
    def submit(
        self, namespace: str, documents: list[Document], summarizer: Summarizer
    ) -> SummarizeJob:
        """Register a job and start its task. 503 (Retry-After) when the server is shutting
        down or ``max_queued`` jobs wait in all; 429 (Retry-After) past the tenant's limits."""
        assert documents, "a job needs at least one document"
        retry = {"Retry-After": "1"}
        if self._closed:
            raise APIError(503, "the server is shutting down", code="shutting_down", headers=retry)
        own = self.list_for(namespace)
        own_queued = sum(job.status == "queued" for job in own)
        limits = self.limits
        if own_queued >= limits.max_queued_jobs_per_tenant:
            raise over_limit(
                f"this API key has {own_queued} summarization jobs queued; the limit is "
                f"{limits.max_queued_jobs_per_tenant} per API key (--max-queued-jobs-per-tenant); "
                "retry when some have started",
                IN_FLIGHT_RETRY_AFTER_S,
            )
        queued = sum(job.status == "queued" for job in self._jobs.values())
        if queued >= self.max_queued:
            raise APIError(
                503,
                f"{queued} summarization jobs are queued (limit {self.max_queued}); retry later",
                code="too_many_jobs",
                headers=retry,
            )
        dropped = None
        if len(own) >= limits.max_kept_jobs_per_tenant:
            dropped = next((job for job in own if job.status not in PENDING), None)
            if dropped is None:
                raise over_limit(
                    f"all {len(own)} summarization jobs kept for this API key are unfinished; "
                    f"the limit is {limits.max_kept_jobs_per_tenant} per API key "
                    "(--max-kept-jobs-per-tenant); retry when one has finished",
                    QUOTA_RETRY_AFTER_S,
                )
        prompt_work, answer_work = estimate_job_work(documents, summarizer)
        if self.admission is not None:
            # NOTE: a job's calls answer in parallel, then each reduce after its inputs:
            # two summaries one after the other, as one sequence's steps.
            check_work(
                self.admission, prompt_work, 2 * summarizer.max_summary_tokens, tenant=namespace
            )
        if dropped is not None:  # NOTE: only once nothing can refuse the new job
            del self._jobs[dropped.id]
        job = SummarizeJob(
            id=uuid.uuid4().hex,
            namespace=namespace,
            documents=documents,
            summarizer=summarizer,
            created=int(time.time()),
            results=[None] * len(documents),
        )
        self._jobs[job.id] = job
        if self.admission is not None:
            self._tickets[job.id] = self.admission.admit(prompt_work, answer_work, tenant=namespace)
        self.metrics.pipeline_jobs_active.labels(PIPELINE, "queued").inc()
        job.task = asyncio.create_task(self._run(job), name=f"summarize-{job.id}")
        logger.info("summarize job %s: %d documents queued", job.id, len(documents))
        return job

    def get(self, namespace: str, job_id: str) -> SummarizeJob:
        job = self._jobs.get(job_id)
        if job is None or job.namespace != namespace:
            raise APIError(
                404, f"summarization job {job_id[:64]} not found", param="id", code="job_not_found"
            )
        return job

    def list_for(self, namespace: str) -> list[SummarizeJob]:
        return [job for job in self._jobs.values() if job.namespace == namespace]

    async def cancel(self, namespace: str, job_id: str) -> SummarizeJob:
        """Cancel an unfinished job and wait until its engine requests are aborted."""
        job = self.get(namespace, job_id)
        await self._cancel(job, "cancelled by the client")
        return job

    async def close(self) -> None:
        """Cancel every unfinished job (server shutdown); new jobs are refused from now on."""
        self._closed = True
        jobs = [job for job in self._jobs.values() if job.status in PENDING]
        await asyncio.gather(*(self._cancel(job, "the server shut down") for job in jobs))
        if jobs:
            logger.info("cancelled %d unfinished summarization jobs", len(jobs))

    async def _cancel(self, job: SummarizeJob, reason: str) -> None:
        if job.status not in PENDING:
            return
        job.cancel_reason = reason
        if job.task is not None and not job.task.done():
            job.task.cancel()
            await asyncio.gather(job.task, return_exceptions=True)
        # NOTE: a task cancelled before its first step never ran its own handler.
        self._finish(job, "cancelled", reason)

    def _finish(self, job: SummarizeJob, status: Status, error: str | None) -> None:
        if job.status not in PENDING:
            return
        self.metrics.pipeline_jobs_active.labels(PIPELINE, job.status).dec()
        self.metrics.pipeline_jobs.labels(PIPELINE, status).inc()
        job.status, job.error, job.finished_at = status, error, int(time.time())
        job.documents = []  # NOTE: kept jobs hold results only, never their (large) inputs
        ticket = self._tickets.pop(job.id, None)
        if self.admission is not None and ticket is not None:
            self.admission.release(ticket)  # what the estimate left over was never work

    # -- running -----------------------------------------------------------------------------
    async def _run(self, job: SummarizeJob) -> None:
        try:
            async with self._running.hold(job.namespace):
                self.metrics.pipeline_jobs_active.labels(PIPELINE, "queued").dec()
                self.metrics.pipeline_jobs_active.labels(PIPELINE, "running").inc()
                job.status, job.started_at = "running", int(time.time())
                started = time.perf_counter()
                slots = PrioritySlots(self.concurrency)
                await run_all(
                    self._summarize(job, index, slots) for index in range(len(job.documents))
                )
        except asyncio.CancelledError:
            self._finish(job, "cancelled", job.cancel_reason or "cancelled")
            raise
        except (CallRejectedError, EngineRequestError) as exc:
            logger.warning("summarize job %s failed: %s", job.id, exc)
            self._finish(job, "failed", str(exc))
        except Exception as exc:  # a bug: the job records it, the server goes on
            logger.exception("summarize job %s failed", job.id)
            self._finish(job, "failed", f"internal error: {type(exc).__name__}: {exc}")
        else:
            self._finish(job, "succeeded", None)
            logger.info(
                "summarize job %s: %d documents, %d calls in %.2fs",
                job.id,
                len(job.results),
                job.calls_done,
                time.perf_counter() - started,
            )

    async def _summarize(self, job: SummarizeJob, index: int, slots: PrioritySlots) -> None:
        """One document: its map calls, then each reduce level as soon as it is planned."""
        run = self.prompts.run
        plan: DocumentJob = await run(job.summarizer.start, job.documents[index], index)
        job.chunks += len(plan.chunks)
        calls = plan.first_calls()
        job.calls_total += len(calls)
        pending = {asyncio.create_task(self._call(job, call, slots)) for call in calls}
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    call, text, num_tokens, finish_reason = task.result()
                    following = await run(plan.complete, call, text, num_tokens, finish_reason)
                    job.calls_total += len(following)
                    pending |= {asyncio.create_task(self._call(job, c, slots)) for c in following}
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        assert plan.summary is not None, "every call finished, so the plan is complete"
        result = await run(plan.result)
        job.results[index] = {"index": index, **result}
        job.documents_done += 1

    async def _call(
        self, job: SummarizeJob, call: Call, slots: PrioritySlots
    ) -> tuple[Call, str, int, str | None]:
        """One engine request; closing its stream (cancellation) aborts it in the engine."""
        await slots.acquire(call.job.priority)
        try:
            request_id = f"summarize-{job.id[:12]}-{next(self._request_ids)}"
            stream = self.engine.generate(call.prompt, call.params, request_id, job.namespace)
            final = None
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for output in stream:
                    final = output
        except ValueError as exc:
            raise CallRejectedError(f"the engine rejected a summarization call: {exc}") from None
        finally:
            slots.release()
        assert final is not None and final.finished, "a stream ends with its finished output"
        completion = final.outputs[0]
        self.metrics.record_finished(ENDPOINT, final)
        ticket = self._tickets.get(job.id)
        if self.admission is not None and ticket is not None:
            computed = len(final.prompt_token_ids) - final.num_cached_tokens
            generated = len(completion.token_ids)
            self.admission.progress(ticket, prompt=computed, computed=computed, generated=generated)
        job.calls_done += 1
        job.generated_tokens += len(completion.token_ids)
        return call, completion.text, len(completion.token_ids), completion.finish_reason


def estimate_job_work(documents: list[Document], summarizer: Summarizer) -> tuple[int, int]:
    """(prompt tokens, answer tokens) a job is expected to take, for admission: every
    document's tokens prefilled once by its map calls, and a summary per chunk plus one
    per reduce (whose prompts, the summaries, are counted too).

    NOTE: tokens are guessed from characters (about 4 a token in English) so that the
    estimate costs nothing; the real counts are reported call by call as they finish.
    """
    prompt = answer = 0
    for document in documents:
        tokens = len(document.text) // 4 + 1
        chunks = -(-tokens // max(1, summarizer.chunk_tokens))
        summaries = summarizer.max_summary_tokens * (chunks + 1)
        prompt += tokens + summaries
        answer += summaries
    return prompt, answer
