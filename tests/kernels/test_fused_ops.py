"""Fused element-wise kernels against the eager torch code they replace.

Without CUDA the kernels run under ``TRITON_INTERPRET=1``; on a GPU, on the device. The
eager code is the model's own (layers.py, rotary.py) run on the CPU in the same dtype.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.fused_ops import rms_norm, rotary, silu_and_mul
from ragserve.models.layers import RMSNorm
from ragserve.models.rotary import apply_rotary

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HALF_DTYPES = [torch.bfloat16, torch.float16]


def _cast_ulps(dtype: torch.dtype, casts: int = 2) -> float:
    """Allowed units of difference after ``casts`` roundings to ``dtype``.

    One when casts round to nearest as torch does (the GPU; float16 everywhere); the CPU
    interpreter truncates float32 to bf16, which may cost up to a unit per cast.
    """
    return 1.0 if DEVICE.type == "cuda" or dtype != torch.bfloat16 else float(casts)


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference in units of the dtype's spacing at each expected value."""
    spacing = torch.finfo(want.dtype).eps * want.float().abs().clamp_min(1e-3)
    return float(((got.float().cpu() - want.float().cpu()).abs() / spacing).max())


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("size", [64, 576, 1000])
def test_rms_norm_matches_the_eager_norm(dtype: torch.dtype, size: int) -> None:
    generator = torch.Generator().manual_seed(size)
    x = torch.randn(7, size, generator=generator).to(dtype)
    norm = RMSNorm(size, 1e-5, device=torch.device("cpu"), dtype=dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(size, generator=generator)).to(dtype)
    want = norm(x)
    got = rms_norm(x.to(DEVICE), norm.weight.to(DEVICE), 1e-5)
    # Only the float32 sum of squares may add in another order: at most one rounding step.
    assert _ulps(got, want) <= _cast_ulps(dtype)
    if _cast_ulps(dtype) == 1.0:
        assert (got.cpu() == want).float().mean() > 0.99


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_add_rms_norm_updates_the_residual_in_place(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    size = 256
    x = torch.randn(5, size, generator=generator).to(dtype)
    residual = torch.randn(5, size, generator=generator).to(dtype)
    norm = RMSNorm(size, 1e-6, device=torch.device("cpu"), dtype=dtype)
    norm.weight.data = torch.rand(size, generator=generator).to(dtype)
    # The CPU's native add writes the sum into its residual argument: give each side a copy.
    want_out, want_sum = norm.add_forward(x, residual.clone())
    device_residual = residual.clone().to(DEVICE)
    got_out = rms_norm(x.to(DEVICE), norm.weight.to(DEVICE), 1e-6, residual=device_residual)
    if _cast_ulps(dtype) == 1.0:
        assert torch.equal(device_residual.cpu(), want_sum)  # the add rounds as torch does
    else:
        assert _ulps(device_residual, want_sum) <= _cast_ulps(dtype)
    assert _ulps(got_out, want_out) <= _cast_ulps(dtype, casts=3)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_silu_and_mul_matches_eager(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(4)
    size = 3000  # not a power of two, more than one program per row
    gate_up = (2 * torch.randn(6, 2 * size, generator=generator)).to(dtype)
    gate, up = gate_up.split(size, dim=-1)
    want = F.silu(gate) * up
    got = silu_and_mul(gate_up.to(DEVICE))
    assert got.shape == (6, size)
    assert _ulps(got, want) <= _cast_ulps(dtype)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("heads", [(4, 2), (9, 3), (32, 8)])
def test_rotary_copies_match_apply_rotary(dtype: torch.dtype, heads: tuple[int, int]) -> None:
    generator = torch.Generator().manual_seed(heads[0])
    num_heads, num_kv_heads, head_dim, positions_total = *heads, 64, 50
    tokens = 9
    # q and k as views into one fused projection output, as the model produces them.
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator).to(
        dtype
    )
    angles = torch.rand(positions_total, head_dim // 2, generator=generator) * 6.0
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    positions = torch.randint(0, positions_total, (tokens,), generator=generator)

    def split(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = tensor.split(
            [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1
        )
        return (
            q.view(tokens, num_heads, head_dim),
            k.view(tokens, num_kv_heads, head_dim),
            v.view(tokens, num_kv_heads, head_dim),
        )

    q, k, _ = split(qkv)
    rows_cos, rows_sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    want_q, want_k = apply_rotary(q, rows_cos, rows_sin), apply_rotary(k, rows_cos, rows_sin)

    device_qkv = qkv.to(DEVICE)
    got_q, got_k, _ = split(device_qkv)
    got_q, got_k = rotary(got_q, got_k, cos.to(DEVICE), sin.to(DEVICE), positions.to(DEVICE))
    assert got_q.is_contiguous() and got_k.is_contiguous()
    if DEVICE.type == "cpu" and dtype == torch.float16:  # every rounding step repeated
        assert torch.equal(got_q.cpu(), want_q)
        assert torch.equal(got_k.cpu(), want_k)
    else:  # a few units of the inputs' scale (the interpreter truncates bf16 casts)
        tolerance = 4 * torch.finfo(dtype).eps
        torch.testing.assert_close(got_q.cpu(), want_q, atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(got_k.cpu(), want_k, atol=tolerance, rtol=tolerance)
    assert torch.equal(device_qkv.cpu(), qkv)  # the projection's output is left alone


def test_bad_shapes_are_refused() -> None:
    x = torch.zeros(2, 8, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(8, dtype=torch.bfloat16, device=DEVICE), 1e-5, residual=x[:1])
    with pytest.raises(ValueError, match="gate_up"):
        silu_and_mul(torch.zeros(2, 7, dtype=torch.bfloat16, device=DEVICE))
    q = torch.zeros(2, 4, 12, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="power of two"):
        rotary(q, q, x[:, :6].contiguous(), x[:, :6].contiguous(), torch.zeros(2, dtype=torch.long))
