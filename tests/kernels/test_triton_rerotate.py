"""The fused re-rotation copy (Triton; under the interpreter on the CPU) equals the torch
path, on a block-major cache with odd head counts and positions across blocks."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_kv import dequantize_slots, quantize_slots
from kernels.rerotate import rerotate_copy_torch, rotation_angles
from kernels.triton_rerotate import rerotate_copy_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(("kv_heads", "head_dim"), [(2, 16), (3, 8)])
def test_fused_copy_matches_torch(kv_heads: int, head_dim: int) -> None:
    generator = torch.Generator().manual_seed(0)
    shape = (6, 3, 2, 4, kv_heads, head_dim)  # blocks, layers, k/v, block size, heads, dim
    cache = torch.randn(shape, generator=generator).to(DEVICE)
    got, expected = _copy_both_ways(cache, head_dim)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert not torch.equal(got, cache)


@pytest.mark.parametrize(("kv_heads", "head_dim"), [(2, 16), (3, 8)])
def test_fused_copy_over_fp8_matches_torch(kv_heads: int, head_dim: int) -> None:
    """Keys dequantized, rotated and quantized again under their new scales; values move
    byte for byte. Bit-identical under the interpreter; on a GPU the rotation's fused
    multiply-adds may round a product differently, which moves a code by one step."""
    storage = torch.uint8
    generator = torch.Generator().manual_seed(1)
    shape = (6, 3, 2, 4, kv_heads, head_dim)
    values = torch.randn(shape, generator=generator)
    values[0, :, :, 2] = 0.0  # zero rows keep scale 0
    cache = quantize_slots(values, storage).to(DEVICE)
    got, expected = _copy_both_ways(cache, head_dim)
    assert not torch.equal(got, cache)
    assert torch.equal(got[:, :, 1], expected[:, :, 1]), "values must move unchanged"
    if DEVICE.type == "cpu":
        assert torch.equal(got, expected)
    else:
        got_keys = dequantize_slots(got[:, :, 0], torch.float32)
        expected_keys = dequantize_slots(expected[:, :, 0], torch.float32)
        torch.testing.assert_close(got_keys, expected_keys, rtol=2**-3, atol=1e-4)


def test_fused_copy_refuses_rotated_int8_rows() -> None:
    """int8 rows live in the Hadamard basis, where RoPE's pairs are mixed: the fused copy
    refuses them (``rerotate_copy`` takes torch's path for them on every device)."""
    cache = quantize_slots(torch.randn(2, 1, 2, 4, 1, 8), torch.int8).to(DEVICE)
    slots = torch.tensor([0], device=DEVICE)
    angles = torch.zeros(1, 4, device=DEVICE)
    with pytest.raises(ValueError, match="rotated"):
        rerotate_copy_triton(cache, slots, slots + 4, angles, angles)


def _copy_both_ways(cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots 1-6 (blocks 0-1) re-rotated from positions 5-10 into slots 13-17 and 22
    (blocks 3-5) at 40-45: ``(Triton's result, torch's)`` on copies of ``cache``."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    source = torch.tensor([1, 2, 3, 4, 5, 6], device=DEVICE)
    target = torch.tensor([13, 14, 15, 16, 17, 22], device=DEVICE)
    src_pos = torch.arange(5, 11, device=DEVICE)
    dst_pos = torch.arange(40, 46, device=DEVICE)
    expected = cache.clone()
    rerotate_copy_torch(expected, source, target, inv_freq.to(DEVICE), src_pos, dst_pos)
    angles = rotation_angles(inv_freq.to(DEVICE), src_pos, dst_pos)
    got = cache.clone()
    rerotate_copy_triton(got, source, target, angles.cos().float(), angles.sin().float())
    return got, expected
