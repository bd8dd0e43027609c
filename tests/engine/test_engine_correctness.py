"""Greedy outputs equal transformers', token for token, however the engine batches them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from kernels import cpu_native
from ragserve import LLM, SamplingParams
from tests.conftest import hf_greedy
from tests.model_factory import TINY_ARCHS, make_tiny_model

MAX_NEW = 10
# RAGSERVE_TEST_DEVICE=cuda runs the same float32 comparison through the GPU kernels.
DEVICE = os.environ.get("RAGSERVE_TEST_DEVICE", "cpu")
TEXTS = [
    "Hi",
    "The capital of France is",
    "Paged attention stores the key-value cache in fixed-size blocks so that",
    "List three prime numbers:",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who "
    "every morning walked down to the harbour before sunrise. One day he found",
    "Question: What is 12 times 12?\nAnswer:",
    "A long document about serving engines. " * 6,
    "Translate to French: good morning",
]


@pytest.fixture(scope="module")
def prompts(smollm_tokenizer: Any) -> list[list[int]]:
    ids = [list(smollm_tokenizer.encode(text)) for text in TEXTS]
    return [[ids[0][0]], *ids]  # a one-token prompt too


@pytest.fixture(scope="module")
def expected(hf_smollm: Any, prompts: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(hf_smollm, prompt, MAX_NEW) for prompt in prompts]


def assert_engine_clean(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    engine.block_pool.check_invariants()
    assert engine.block_pool.num_used == 0, "blocks leaked"


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.mark.parametrize(
    "engine_args",
    [
        pytest.param({}, id="one-continuous-batch"),
        pytest.param({"max_num_batched_tokens": 24}, id="chunked-prefill"),
        pytest.param(
            {"enable_prefix_caching": False, "max_num_seqs": 3},
            id="no-cache-few-seqs",
            marks=pytest.mark.slow,
        ),
        # 8 blocks of 16 tokens: room for the longest request alone, not for all of them
        pytest.param(
            {"kv_cache_gib": 8 * 16 * 46080 / 2**30}, id="preemption", marks=pytest.mark.slow
        ),
    ],
)
def test_greedy_matches_transformers(
    smollm_path: str,
    prompts: list[list[int]],
    expected: list[list[int]],
    engine_args: dict[str, Any],
) -> None:
    llm = LLM(smollm_path, device=DEVICE, dtype="float32", **engine_args)
    if DEVICE == "cpu":  # the default CPU backend, on its native kernels where they build
        backend = llm.engine.runner.backend
        assert backend.name == "cpu"
        assert getattr(backend, "is_native", False) == (cpu_native.load() is not None)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outputs]
    assert got == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    if "kv_cache_gib" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0, "the KV budget did not force preemption"
    assert_engine_clean(llm)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_models_of_each_architecture_match_transformers(tmp_path: Path, arch: str) -> None:
    """Random-weight HF directories, loaded by our loader, batched by our engine."""
    directory = make_tiny_model(tmp_path, arch)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    lengths = [1, 3, 15, 16, 17, 33, 40, 64]  # around block boundaries (block size 16)
    prompts = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in lengths]
    expected = [hf_greedy(reference, prompt, 12) for prompt in prompts]
    llm = LLM(str(directory), device=DEVICE, dtype="float32", max_num_batched_tokens=48)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_engine_clean(llm)
