"""The native element-wise layer ops against the eager torch code they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_layer_ops, cpu_native
from ragserve.models.rotary import apply_rotary

pytestmark = pytest.mark.skipif(cpu_native.load() is None, reason="no C compiler: no native ops")
DTYPES = [torch.float32, torch.bfloat16]


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 200])
def test_add_rms_norm(dtype: torch.dtype, rows: int) -> None:
    x, residual = (torch.randn(rows, 576).to(dtype) for _ in range(2))
    weight = torch.rand(576).to(dtype) + 0.5
    summed = residual + x
    out = cpu_layer_ops.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, summed), "the sum is stored in residual, rounded as torch does"
    expected = eager_rms_norm(summed, weight, 1e-5)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    assert (out.float() - expected.float()).abs().max().item() < tolerance * 4
    alone = cpu_layer_ops.add_rms_norm(None, summed.clone(), weight, 1e-5)
    assert torch.equal(alone, out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    gate_up = (torch.randn(37, 2 * 1536) * 6).to(dtype)
    gate, up = gate_up.split(1536, dim=-1)
    expected = F.silu(gate) * up
    out = cpu_layer_ops.silu_and_mul(gate_up)
    scale = expected.float().abs().clamp(min=1.0)
    tolerance = 1e-6 if dtype == torch.float32 else 8e-3
    assert ((out.float() - expected.float()).abs() / scale).max().item() < tolerance
    # extreme gates: silu tends to 0 and to the identity
    edges = torch.tensor([[-200.0, -90.0, -20.0, 0.0, 20.0, 90.0, 200.0, 1e-30] + [1.0] * 8]).to(
        dtype
    )
    both = torch.cat([edges, torch.ones_like(edges)], dim=-1)
    assert torch.allclose(
        cpu_layer_ops.silu_and_mul(both).float(), F.silu(edges).float(), atol=1e-6
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_equals_eager_bit_for_bit(dtype: torch.dtype) -> None:
    tokens, heads, dim = 11, 12, 64
    qkv = torch.randn(tokens, heads + 3, dim).to(dtype)
    view = qkv[:, :heads]  # strided rows, as the model hands q and k over
    angles = torch.rand(tokens, 1, dim // 2) * 40
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    assert cpu_layer_ops.usable(view, cos, sin)
    assert torch.equal(cpu_layer_ops.rotate(view, cos, sin), apply_rotary(view, cos, sin))
