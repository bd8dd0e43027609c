"""Re-rotation is exact: keys computed at one position and rotated to another equal the
keys transformers computes at that other position, in every layer (float32)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from kernels.rerotate import rerotate_keys
from ragserve.models.rotary import compute_inv_freq, rope_parameters
from tests.model_factory import make_tiny_hf_model

ARCHS = ["llama", "llama-llama3-rope", "llama-yarn-rope", "llama-linear-rope", "qwen3"]


@torch.inference_mode()
def hf_keys(model: Any, tokens: list[int], start: int) -> list[torch.Tensor]:
    """Each layer's cached keys ``[T, kv_heads, head_dim]`` of ``tokens`` at ``start..``."""
    ids = torch.tensor([tokens])
    positions = torch.arange(start, start + len(tokens))[None, :]
    out = model(input_ids=ids, position_ids=positions, use_cache=True)
    return [layer.keys[0].transpose(0, 1) for layer in out.past_key_values.layers]


@functools.cache
def tiny(arch: str) -> Any:
    return make_tiny_hf_model(arch)


def inv_freq_of(model: Any) -> torch.Tensor:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq, _ = compute_inv_freq(
        rope_parameters(config), head_dim, int(config.max_position_embeddings)
    )
    return inv_freq


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("source", "target"), [(0, 37), (5, 90), (60, 3)])
def test_rotated_keys_equal_keys_computed_there(arch: str, source: int, target: int) -> None:
    model = tiny(arch)
    tokens = torch.randint(3, 128, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    at_source, at_target = hf_keys(model, tokens, source), hf_keys(model, tokens, target)
    n = len(tokens)
    src = torch.arange(source, source + n)
    dst = torch.arange(target, target + n)
    inv_freq = inv_freq_of(model)
    for keys, expected in zip(at_source, at_target, strict=True):
        assert not torch.allclose(keys, expected, atol=1e-3)  # the positions do matter
        moved = rerotate_keys(keys, inv_freq, src, dst)
        torch.testing.assert_close(moved, expected, rtol=1e-5, atol=1e-5)


def test_rotation_keeps_dtype_and_identity_at_zero_shift() -> None:
    keys = torch.randn(6, 2, 16, dtype=torch.bfloat16)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    positions = torch.arange(10, 16)
    moved = rerotate_keys(keys, inv_freq, positions, positions)
    assert moved.dtype == torch.bfloat16
    assert torch.equal(moved, keys)
