"""Helpers every benchmark shares."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragserve import LLM, SamplingParams
from ragserve.bench.common import succeeded
from tests.model_factory import make_tiny_model


def test_a_failed_request_stops_the_benchmark(tmp_path: Path) -> None:
    llm = LLM(str(make_tiny_model(tmp_path, "llama")), dtype="float32", kv_cache_gib=0.01)
    params = SamplingParams(temperature=0.5, seed=1, max_tokens=3, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9, 10]]
    assert len(succeeded(llm.generate(prompts, params, use_tqdm=False))) == 2
    llm.engine.sampler.fail_marker = "offline-3"  # the second prompt of the next call
    with pytest.raises(RuntimeError, match="offline-3 failed: sampling failed"):
        succeeded(llm.generate(prompts, params, use_tqdm=False))
