"""Decode steps launched ahead of the host give exactly the outputs of step-by-step serving.

Asynchronous scheduling is on by default only on CUDA (on the CPU it adds work and no
overlap), but its bookkeeping is the same everywhere, so it is checked here on the CPU
against the same engine with it off: stops of every kind, sampling, aborts, no leaks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ragserve import LLM, SamplingParams
from ragserve.engine.llm_engine import LLMEngine
from tests.model_factory import make_tiny_model

pytestmark = pytest.mark.slow  # every test drives two SmolLM2 engines


@pytest.fixture(scope="module")
def engines(smollm_path: str) -> tuple[LLM, LLM]:
    # NOTE: a fixed KV budget each: on a GPU the first engine would otherwise take the
    # device's free memory and leave the second none.
    ahead = LLM(smollm_path, max_model_len=512, kv_cache_gib=0.5, async_scheduling=True)
    in_step = LLM(smollm_path, max_model_len=512, kv_cache_gib=0.5, async_scheduling=False)
    return ahead, in_step


def assert_no_leak(engine: LLMEngine) -> None:
    engine.block_pool.check_invariants()
    assert engine.block_pool.num_used == 0


def summary(outputs: list) -> list[tuple]:
    return [
        (c.token_ids, c.text, c.finish_reason, c.stop_reason)
        for out in outputs
        for c in out.outputs
    ]


def test_mixed_stops_and_sampling_match_step_by_step_serving(engines: tuple[LLM, LLM]) -> None:
    ahead, in_step = engines
    prompts = [
        "Count: 1, 2, 3,",
        "The alphabet: a b c",
        "Write a short poem about the sea.",
        "What is the capital of France? Answer:",
        "def fibonacci(n):",
        "Once upon a time",
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reference = in_step.generate(prompts[:1], greedy, use_tqdm=False)[0].outputs[0]
    stop_token = reference.token_ids[9]  # stops a sequence in the middle of the run
    params = [
        greedy,
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=20, n=2),
        SamplingParams(temperature=0.0, max_tokens=40, stop=["."]),
        SamplingParams(temperature=0.0, max_tokens=7, min_tokens=5),
        SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=16),
    ]
    before = ahead.engine.stats.steps_ahead
    got = ahead.generate(prompts, params, use_tqdm=False)
    expected = in_step.generate(prompts, params, use_tqdm=False)
    assert summary(got) == summary(expected)
    assert [o.num_cached_tokens for o in got] == [o.num_cached_tokens for o in expected]
    assert ahead.engine.stats.steps_ahead - before >= 10  # the decode phase really ran ahead
    assert in_step.engine.stats.steps_ahead == 0
    assert_no_leak(ahead.engine)


def test_eos_stop_inside_a_step_ahead_drops_its_row(engines: tuple[LLM, LLM]) -> None:
    """Sequences that stop on a sampled token leave a step already launched for them."""
    ahead, in_step = engines
    chat = [
        [{"role": "user", "content": question}]
        for question in ("Say hi.", "Name a colour.", "What is 2+2?")
    ]
    params = SamplingParams(temperature=0.0, max_tokens=64)
    got = ahead.chat(chat, params, use_tqdm=False)
    expected = in_step.chat(chat, params, use_tqdm=False)
    assert summary(got) == summary(expected)
    assert all(c.finish_reason == "stop" for out in got for c in out.outputs)
    assert_no_leak(ahead.engine)


def test_logprobs_and_new_arrivals_fall_back_to_plain_steps(engines: tuple[LLM, LLM]) -> None:
    ahead, in_step = engines
    logprobs = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    engine = ahead.engine
    before = engine.stats.steps_ahead
    got = ahead.generate(["The sky is"], logprobs, use_tqdm=False)[0].outputs[0]
    assert engine.stats.steps_ahead == before  # logprobs are read every step
    expected = in_step.generate(["The sky is"], logprobs, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == expected.token_ids
    assert got.logprobs == expected.logprobs

    # A request arriving while a step runs ahead joins at the next step.
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("first", "Count: 1, 2, 3,", greedy)
    outputs: dict[str, list[int]] = {}
    for _ in range(4):
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
    assert engine._lookahead is not None
    engine.add_request("second", "The alphabet: a b c", greedy)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
    reference = in_step.generate(["Count: 1, 2, 3,", "The alphabet: a b c"], greedy, use_tqdm=False)
    assert outputs["first"] == reference[0].outputs[0].token_ids
    assert outputs["second"] == reference[1].outputs[0].token_ids
    assert_no_leak(engine)


def test_abort_while_a_step_runs_ahead(engines: tuple[LLM, LLM]) -> None:
    ahead, in_step = engines
    engine = ahead.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request("kept", "Once upon a time", greedy)
    engine.add_request("dropped", "def fibonacci(n):", greedy)
    for _ in range(5):
        engine.step()
    assert engine._lookahead is not None and len(engine._lookahead.seqs) == 2
    assert engine.abort_request("dropped")
    kept: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "kept"
            kept = out.outputs[0].token_ids
    expected = in_step.generate(["Once upon a time"], greedy, use_tqdm=False)[0].outputs[0]
    assert kept == expected.token_ids
    assert_no_leak(engine)


@pytest.mark.gpu
def test_steps_ahead_in_cuda_graphs_match_plain_steps(tmp_path: Path) -> None:
    directory = make_tiny_model(tmp_path, "llama")
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 128, (int(n),), generator=generator).tolist() for n in (5, 17, 40, 9)
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30),  # the tiny model's EOS may stop it
        SamplingParams(temperature=1.0, seed=5, max_tokens=25),
        SamplingParams(temperature=0.0, max_tokens=12, min_tokens=10),
    ]
    results = {}
    for ahead in (True, False):
        llm = LLM(
            str(directory),
            device="cuda",
            dtype="float32",
            kv_cache_gib=0.25,
            async_scheduling=ahead,
        )
        results[ahead] = summary(llm.generate(prompts, params, use_tqdm=False))
        assert (llm.engine.stats.steps_ahead > 0) == ahead
        assert_no_leak(llm.engine)
        llm.close()
    assert results[True] == results[False]
