"""A job's generations on a real engine: closing the job (its client left) aborts its
engine requests at once, before admission counts its work as done."""

from __future__ import annotations

import asyncio

import pytest

from ragserve import SamplingParams
from ragserve.config import EngineConfig
from ragserve.engine.async_engine import AsyncEngine
from ragserve.server.generation import GenerationJob, run_job
from ragserve.server.metrics import ServerMetrics

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("prompts", [1, 2], ids=["one prompt", "a batch"])
def test_closing_a_job_aborts_its_engine_requests_at_once(smollm_path: str, prompts: int) -> None:
    async def scenario() -> None:
        engine = AsyncEngine(EngineConfig(model=smollm_path, max_model_len=256))
        try:
            params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            job = GenerationJob("job", [[1, 2, 3, 4]] * prompts, params, "")
            outputs = run_job(engine, job, ServerMetrics(), "/v1/completions")
            await anext(outputs)
            assert engine.num_active_requests == prompts
            await outputs.aclose()
            assert engine.num_active_requests == 0  # NOTE: no loop turn in between
        finally:
            await engine.shutdown()

    asyncio.run(scenario())
