"""Shared fixtures (the embedded model, its transformers twin, greedy references) and the
test markers: ``gpu`` (skipped without CUDA), ``e2e`` (starts a server or a subprocess),
``slow`` (10 s or more on two cores). ``pytest -m "not e2e and not slow"`` is the fast lane."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.valkey_server import valkey  # noqa: F401 (the fixture, for every test module)

# Keep tests deterministic and polite on small machines.
torch.manual_seed(0)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # NOTE: must be set before triton decorates any kernel, i.e. before kernels/ is imported;
    # the Triton kernels then run on the CPU under triton's interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The one GPU-skip rule: a test marked ``gpu`` is skipped where CUDA is missing."""
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread: on a small shared machine it is faster and steadier than several."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm_path() -> str:
    from ragserve.models.default_model import default_model_path

    return str(default_model_path())


@pytest.fixture(scope="session")
def hf_smollm(smollm_path: str) -> Any:
    """SmolLM2 loaded by transformers from the same GGUF file, float32: the reference."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = Path(smollm_path)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_path: str) -> Any:
    from ragserve.models.tokenizer import load_gguf_tokenizer

    return load_gguf_tokenizer(smollm_path)


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one unpadded prompt, EOS ignored (not banned)."""
    from transformers import GenerationConfig

    ids = torch.tensor([prompt])
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(autouse=True)
def _no_leaked_forward_context() -> Iterator[None]:
    from ragserve.models import forward_context

    yield
    assert forward_context._current is None
