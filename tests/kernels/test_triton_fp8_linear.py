"""The Triton FP8 linear kernels (under the interpreter on the CPU): the weight-only GEMV
against its float32 reference, and the fused per-token quantizer bit for bit against
:func:`kernels.fp8_linear.quantize_rows`. On CUDA sm89+ also at Llama shapes and in a graph."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_kv import FP8_DTYPE, FP8_MAX
from kernels.fp8_linear import fp8_matmul_reference, quantize_rows
from kernels.triton_fp8_gemv import fp8_gemv, fp8_gemv_reference
from kernels.triton_fp8_quant import quantize_rows_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sm89() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _operands(
    rows: int, k: int, n: int, seed: int, device: torch.device = DEVICE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
    weight = torch.randn(n, k, generator=generator) * torch.logspace(-3, 0, n).unsqueeze(1)
    codes, scale = quantize_rows(weight)
    bias = torch.randn(n, generator=generator).to(torch.bfloat16)
    return x.to(device), codes.to(device), scale.to(device), bias.to(device)


def _assert_within_bound(
    got: torch.Tensor, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, want: torch.Tensor
) -> None:
    """The module's bound: bf16 rounding of y plus float32 summation, K * 2^-23 * sum |x w|.

    NOTE: one bf16 ulp (2^-7), not half: triton 3.6's interpreter truncates float32 to bf16.
    """
    k = x.shape[1]
    magnitude = x.float().abs() @ (codes.float().abs() * scale).t()
    bound = 2.0 ** (-8 if got.is_cuda else -7) * want.abs() + k * 2.0**-23 * magnitude + 1e-30
    assert ((got.float() - want).abs() <= bound).all(), (got.float() - want).abs().max()


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_its_float32_reference(rows: int, with_bias: bool) -> None:
    # Odd sizes: neither is a multiple of any block, so every mask is exercised.
    x, codes, scale, bias = _operands(rows, 100, 37, seed=rows)
    b = bias if with_bias else None
    got = fp8_gemv(x, codes, scale, b)
    want = fp8_gemv_reference(x, codes, scale, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 37)
    _assert_within_bound(got, x, codes, scale, want)
    # The activation is not quantized: the quantized-activation reference is much further.
    quantized = fp8_matmul_reference(x, codes, scale, b)
    assert (got.float() - want).norm() * 4 < (quantized - want).norm()


def test_gemv_takes_a_row_strided_view() -> None:
    x, codes, scale, _ = _operands(2, 48, 24, seed=7)
    wide = torch.zeros(2, 64, dtype=x.dtype, device=x.device)
    wide[:, :48] = x
    got = fp8_gemv(wide[:, :48], codes, scale)
    torch.testing.assert_close(got, fp8_gemv(x, codes, scale), rtol=0, atol=0)


def _rows_to_quantize(device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(8, 75, generator=generator) * torch.logspace(-6, 4, 8).unsqueeze(1)
    x[2] = 0.0  # a zero row: scale tiny, codes all zero
    # A tiny row: amax / 448 is below float32's smallest normal, so the scale is clamped.
    # NOTE: not subnormal itself: triton 3.6's interpreter mishandles subnormal bf16 inputs.
    x[3] = 1e-36 * torch.randn(75, generator=generator)
    x[4, :5] = torch.tensor([-0.0, 1.0, -1e-30, 3.0, -3.0])  # signed zeros and underflow
    x[5] = torch.linspace(-448, 448, 75)  # exact halves between codes
    return x.to(torch.bfloat16).to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_quantizer_is_bit_identical(dtype: torch.dtype) -> None:
    x = _rows_to_quantize(DEVICE).to(dtype)
    want_codes, want_scale = quantize_rows(x)
    codes, scale = quantize_rows_triton(x)
    assert codes.dtype == FP8_DTYPE and scale.shape == (8, 1) and scale.dtype == torch.float32
    assert torch.equal(scale, want_scale)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert (codes[2].float() == 0).all() and codes.float().abs().max() == FP8_MAX


def test_e4m3_rounding_is_to_nearest_even_at_every_exponent() -> None:
    """Every e4m3 value and every midpoint between neighbours, in one row with a 448 so
    the scale is exactly one: midpoints must go to the even code, as torch's cast does."""
    values = torch.arange(0, 127, dtype=torch.uint8).view(FP8_DTYPE).float()  # 0 .. 448
    midpoints = (values[1:] + values[:-1]) / 2
    row = torch.cat([values, midpoints, -values, -midpoints, torch.tensor([448.0])])
    x = (row * 448.0).unsqueeze(0).to(DEVICE)  # amax 448 * 448: scale 448 exactly (ish)
    want_codes, want_scale = quantize_rows(x)
    codes, scale = quantize_rows_triton(x)
    assert torch.equal(scale, want_scale)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not _sm89(), reason="FP8 kernels need compute capability >= 8.9")
@pytest.mark.parametrize("rows", [1, 2, 4, 7, 16, 64])
@pytest.mark.parametrize(("k", "n"), [(4096, 6144), (14336, 4096), (4096, 28672)])
def test_gemv_at_llama_shapes(rows: int, k: int, n: int) -> None:
    x, codes, scale, bias = _operands(rows, k, n, seed=rows)
    got = fp8_gemv(x, codes, scale, bias)
    _assert_within_bound(got, x, codes, scale, fp8_gemv_reference(x, codes, scale, bias))


@pytest.mark.gpu
@pytest.mark.skipif(not _sm89(), reason="FP8 kernels need compute capability >= 8.9")
@pytest.mark.parametrize("cols", [4096, 14336])
def test_fused_quantizer_at_llama_widths(cols: int) -> None:
    x = torch.randn(512, cols, device="cuda").to(torch.bfloat16) * 3
    x[7] = 0.0
    want_codes, want_scale = quantize_rows(x)
    codes, scale = quantize_rows_triton(x)
    assert torch.equal(scale, want_scale)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not _sm89(), reason="FP8 kernels need compute capability >= 8.9")
def test_both_kernels_replay_from_a_cuda_graph() -> None:
    x, codes, scale, bias = _operands(4, 1024, 768, seed=5)
    big = torch.randn(32, 1024, device="cuda").to(torch.bfloat16)
    fp8_gemv(x, codes, scale, bias)  # compile outside the capture
    quantize_rows_triton(big)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemv(x, codes, scale, bias)
        big_codes, big_scale = quantize_rows_triton(big)
    x.copy_(torch.randn_like(x) * 10)
    big.copy_(torch.randn_like(big) * 10)
    graph.replay()
    torch.testing.assert_close(out, fp8_gemv(x, codes, scale, bias), rtol=0, atol=0)
    want_codes, want_scale = quantize_rows(big)
    assert torch.equal(big_scale, want_scale)
    assert torch.equal(big_codes.view(torch.uint8), want_codes.view(torch.uint8))
