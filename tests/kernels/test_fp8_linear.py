"""FP8 linear arithmetic (``kernels/fp8_linear.py``): the per-row quantizer's error bound, the
float32 reference against a plain matmul, and ``torch._scaled_mm`` against the reference
(on CUDA devices of compute capability 8.9 or more only)."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_kv import FP8_DTYPE, FP8_MAX
from kernels.fp8_linear import (
    ACCUMULATION_TOLERANCE,
    dequantize_rows,
    fp8_matmul_reference,
    fp8_matmul_scaled_mm,
    product_magnitudes,
    quantize_rows,
    scaled_mm_usable,
)


def rows_spanning_decades(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Gaussian rows whose magnitudes span six decades, so one shared scale would fail."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator)
    return x * torch.logspace(-3, 3, rows).unsqueeze(1)


def test_each_row_round_trips_within_the_e4m3_bound() -> None:
    x = rows_spanning_decades(64, 96, seed=0)
    x[5] = 0.0
    codes, scale = quantize_rows(x)
    assert codes.dtype == FP8_DTYPE and scale.dtype == torch.float32
    assert scale.shape == (64, 1)
    amax = x.abs().amax(dim=1, keepdim=True)
    # amax times the float32 reciprocal of 448 (the same bits on every device): within an
    # ulp of amax / 448.
    torch.testing.assert_close(scale[amax > 0], (amax * (1 / FP8_MAX))[amax > 0], rtol=0, atol=0)
    torch.testing.assert_close(scale[amax > 0], (amax / FP8_MAX)[amax > 0], rtol=2.0**-23, atol=0)
    back = dequantize_rows(codes, scale)
    # 3 mantissa bits: within 2^-4 of each element, or 2^-10 scales among the subnormals.
    bound = 2.0**-4 * x.abs() + 2.0**-10 * scale
    assert ((back - x).abs() <= bound).all()
    assert (back[5] == 0).all() and torch.isfinite(back).all()
    # Every row uses the top of the range, so no row loses its precision to another's scale.
    assert (codes.float().abs().amax(dim=1)[amax.squeeze(1) > 0] == FP8_MAX).all()


def test_reference_matmul_is_within_the_e4m3_bound_of_the_float_one() -> None:
    generator = torch.Generator().manual_seed(1)
    x = rows_spanning_decades(16, 128, seed=2)
    weight = torch.randn(48, 128, generator=generator) * 0.02
    bias = torch.randn(48, generator=generator)
    codes, scale = quantize_rows(weight)
    got = fp8_matmul_reference(x, codes, scale, bias)
    exact = x @ weight.t() + bias
    # Each product's two factors are each within 2^-4 relative (plus subnormal slack).
    bound = 2.0**-3 * (x.abs() @ weight.abs().t()) + 1e-6
    assert ((got - exact).abs() <= bound).all()
    # ...and in practice far inside it: the errors are unbiased and mostly cancel.
    relative = (got - exact).norm() / (got - bias).norm()
    assert relative < 0.05, relative
    # The reference is the GPU path's arithmetic: quantize x by row, dequantize, matmul.
    x_codes, x_scale = quantize_rows(x)
    manual = (x_codes.float() * x_scale) @ (codes.float() * scale).t() + bias
    torch.testing.assert_close(got, manual, rtol=0, atol=0)


def test_scaled_mm_is_used_only_where_it_runs() -> None:
    cpu = torch.device("cpu")
    assert not scaled_mm_usable(cpu, torch.bfloat16, 4096, 4096)
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        assert not scaled_mm_usable(cuda, torch.float32, 4096, 4096)
        assert not scaled_mm_usable(cuda, torch.bfloat16, 4096, 4104)


def _cpu_scaled_mm_error() -> str | None:
    """Why this torch cannot run row-wise ``_scaled_mm`` on the CPU (None: it can)."""
    try:
        torch._scaled_mm(
            torch.zeros(1, 16, dtype=FP8_DTYPE),
            torch.zeros(16, 16, dtype=FP8_DTYPE).t(),
            scale_a=torch.ones(1, 1),
            scale_b=torch.ones(1, 16),
            out_dtype=torch.bfloat16,
        )
    except (RuntimeError, NotImplementedError) as exc:
        return str(exc).splitlines()[0]
    return None


@pytest.mark.skipif(_cpu_scaled_mm_error() is not None, reason="no row-wise _scaled_mm on the CPU")
def test_the_scaled_mm_call_matches_the_reference_on_the_cpu() -> None:
    """The GPU path's operands (column-major weight, [M, 1] and [1, N] scales) checked where
    CI runs: torch's CPU ``_scaled_mm`` takes the same call. Swapped scales fail by far."""
    x = rows_spanning_decades(5, 64, seed=3).to(torch.bfloat16)
    codes, scale = quantize_rows(torch.randn(48, 64, generator=torch.Generator().manual_seed(4)))
    want = fp8_matmul_reference(x, codes, scale)
    got = fp8_matmul_scaled_mm(x, codes, scale)
    assert got.dtype == torch.bfloat16
    row_max = want.abs().amax(dim=1, keepdim=True)
    assert ((got.float() - want).abs() <= 2.0**-7 * row_max).all()  # bf16 output rounding
    wrong = fp8_matmul_scaled_mm(x, codes, scale.flip(0)).float()
    assert ((wrong - want).abs() > 2.0**-7 * row_max).any()


def _sm89() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm89(), reason="torch._scaled_mm needs compute capability >= 8.9")
@pytest.mark.parametrize("rows", [1, 7, 16, 256])
@pytest.mark.parametrize("with_bias", [False, True])
def test_scaled_mm_matches_the_reference(rows: int, with_bias: bool) -> None:
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(rows)
    x = torch.randn(rows, 4096, device=device, generator=generator).to(torch.bfloat16)
    weight = torch.randn(6144, 4096, device=device, generator=generator) * 0.02
    bias = torch.randn(6144, device=device, generator=generator).to(torch.bfloat16)
    codes, scale = quantize_rows(weight)
    assert scaled_mm_usable(device, torch.bfloat16, 4096, 6144)
    b = bias if with_bias else None
    got = fp8_matmul_scaled_mm(x, codes, scale, b)
    want = fp8_matmul_reference(x, codes, scale, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 6144)
    # The same products summed in fewer bits (fast FP8 accumulation), then rounded to bf16.
    magnitudes = product_magnitudes(x, codes, scale)
    tolerance = 2.0**-7 * want.abs() + ACCUMULATION_TOLERANCE * magnitudes
    assert ((got.float() - want).abs() <= tolerance).all()


@pytest.mark.gpu
@pytest.mark.skipif(not _sm89(), reason="torch._scaled_mm needs compute capability >= 8.9")
def test_scaled_mm_records_into_a_cuda_graph() -> None:
    """No host sync in the dynamic activation scale: the linear replays from a graph."""
    device = torch.device("cuda")
    codes, scale = quantize_rows(torch.randn(512, 1024, device=device) * 0.02)
    x = torch.randn(8, 1024, device=device, dtype=torch.bfloat16)
    fp8_matmul_scaled_mm(x, codes, scale)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_matmul_scaled_mm(x, codes, scale)
    x.copy_(torch.randn_like(x) * 10)
    graph.replay()
    torch.testing.assert_close(out, fp8_matmul_scaled_mm(x, codes, scale), rtol=0, atol=0)
