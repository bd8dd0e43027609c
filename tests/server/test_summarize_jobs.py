"""The registry of summarization jobs on a real engine: a submit that is refused keeps
every job the tenant had."""

from __future__ import annotations

import asyncio

import pytest

from pipelines.documents import Document
from pipelines.summarize import SummarizeOptions
from ragserve.config import EngineConfig
from ragserve.engine.async_engine import AsyncEngine
from ragserve.server.admission import WorkAdmission
from ragserve.server.errors import APIError
from ragserve.server.metrics import ServerMetrics
from ragserve.server.prompts import PromptBuilder
from ragserve.server.summarize_jobs import SummarizeJobs
from ragserve.server.tenant_limits import JobLimits

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_submit_refused_as_over_capacity_drops_no_finished_job(smollm_path: str) -> None:
    async def scenario() -> None:
        engine = AsyncEngine(EngineConfig(model=smollm_path, max_model_len=512))
        clock = Clock()
        admission = WorkAdmission(1.0, window_s=1.0, min_windows=1, clock=clock)
        jobs = SummarizeJobs(
            engine,
            PromptBuilder(engine.tokenizer, max_model_len=512),
            ServerMetrics(),
            admission,
            limits=JobLimits(max_queued_jobs_per_tenant=4, max_kept_jobs_per_tenant=1),
        )
        try:
            summarizer = await jobs.summarizer(SummarizeOptions(max_summary_tokens=4))
            first = jobs.submit("tenant", [Document("a", "A note about caching.")], summarizer)
            assert first.task is not None
            await first.task
            assert first.status == "succeeded"
            # Another request's prompt work, measured at about 50 ms per token: the next
            # job would wait for it about 50 s, over the 1 s budget.
            busy = admission.admit(1000, 0, tenant="tenant")
            clock.now += 1.0
            admission.progress(busy, prompt=1, computed=1)
            with pytest.raises(APIError) as refused:
                jobs.submit("tenant", [Document("b", "A note about disks.")], summarizer)
            assert refused.value.status == 503
            assert jobs.get("tenant", first.id) is first  # still kept: nothing replaced it
            admission.release(busy)
        finally:
            await jobs.close()
            await engine.shutdown()

    asyncio.run(scenario())
