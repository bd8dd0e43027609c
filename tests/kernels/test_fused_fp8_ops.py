"""The fused norm/SiLU + FP8 quantization kernels (``kernels/fused_fp8_ops.py``) bit for bit
against the unfused composition they replace: ``kernels/fused_ops.py``'s kernel, then
:func:`kernels.triton_fp8_quant.quantize_rows_triton`.

Without CUDA both sides run under ``TRITON_INTERPRET=1``; on sm89+ also at Llama widths and
in a CUDA graph. The interpreter cannot see the compiled reduction order of the norm's sum of
squares, so one test compiles both norm kernels for sm_90 (no GPU needed) and compares the
layouts their sums reduce over.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.fp8_kv import FP8_DTYPE, FP8_MAX
from kernels.fused_fp8_ops import SILU_ONE_BLOCK_MAX, add_rms_norm_quant, silu_and_mul_quant
from kernels.fused_ops import rms_norm, silu_and_mul
from kernels.triton_fp8_quant import MIN_SCALE, quantize_rows_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sm89() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _assert_same_quantization(
    got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]
) -> None:
    (codes, scales), (want_codes, want_scales) = got, want
    assert codes.dtype == FP8_DTYPE and codes.shape == want_codes.shape
    assert scales.dtype == torch.float32 and scales.shape == (codes.shape[0], 1)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))


def _rows(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random rows of magnitudes 1e-15 .. 1e15, a zero row and a row of signed zeros.

    NOTE: none subnormal in bf16: triton 3.6's interpreter mishandles subnormal inputs.
    """
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator) * torch.logspace(-15, 15, rows).unsqueeze(1)
    x[1] = 0.0
    x[2] = -0.0
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("size", [64, 1000, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_quant_is_the_unfused_composition(
    dtype: torch.dtype, size: int, with_residual: bool
) -> None:
    if dtype == torch.float16 and size != 1000:
        pytest.skip("float16 covers one width")
    generator = torch.Generator().manual_seed(size)
    x = _rows(7, size, seed=size)
    if dtype == torch.float16:  # float16's range is narrow: plain rows, and the zero ones
        x = torch.randn(7, size, generator=generator) * (x != 0)
    x = x.to(dtype)
    residual = torch.randn(7, size, generator=generator).to(dtype)
    residual[1] = -x[1]  # a sum of exact zeros: scale tiny, codes zero
    weight = (torch.rand(size, generator=generator) * 2 - 0.5).to(dtype)
    x, residual, weight = x.to(DEVICE), residual.to(DEVICE), weight.to(DEVICE)
    want_residual = residual.clone() if with_residual else None
    want = quantize_rows_triton(rms_norm(x, weight, 1e-5, residual=want_residual))
    got_residual = residual.clone() if with_residual else None
    got = add_rms_norm_quant(x, weight, 1e-5, residual=got_residual)
    _assert_same_quantization(got, want)
    if with_residual:
        assert got_residual is not None and want_residual is not None
        assert torch.equal(got_residual, want_residual)
        assert not torch.equal(got_residual, residual)  # it was updated
    assert (got[0][1].float() == 0).all() and got[1][1].item() == MIN_SCALE
    assert got[0].float().abs().max() == FP8_MAX


@pytest.mark.parametrize("weight_scale", [1e-30, 1e30])
def test_add_rms_norm_quant_at_extreme_magnitudes(weight_scale: float) -> None:
    """Outputs near the ends of bf16's normal range: scales far from one either way."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(4, 576, generator=generator).to(torch.bfloat16).to(DEVICE)
    weight = (weight_scale * torch.logspace(-3, 3, 576)).to(torch.bfloat16).to(DEVICE)
    want = quantize_rows_triton(rms_norm(x, weight, 1e-6))
    _assert_same_quantization(add_rms_norm_quant(x, weight, 1e-6), want)


def _gate_up(rows: int, size: int, seed: int) -> torch.Tensor:
    gate_up = _rows(rows, 2 * size, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    gate_up[3, :size] = -1e30  # silu saturates to -0.0
    gate_up[4, size:] = torch.randn(size, generator=generator) * 1e-20
    return gate_up.to(torch.bfloat16).to(DEVICE)


@pytest.mark.parametrize("size", [64, 1000, 3000])
@pytest.mark.parametrize("block", [None, 256])
def test_silu_and_mul_quant_is_the_unfused_composition(size: int, block: int | None) -> None:
    """``block=256`` runs the two-pass loop over blocks (one pass where a block holds the row)."""
    gate_up = _gate_up(8, size, seed=size)
    want = quantize_rows_triton(silu_and_mul(gate_up))
    got = silu_and_mul_quant(gate_up, block=block)
    _assert_same_quantization(got, want)
    assert (got[0][1].float() == 0).all() and got[1][1].item() == MIN_SCALE


def test_silu_and_mul_quant_loops_past_one_block() -> None:
    """A row wider than one block (as Llama-3.1-70B's 28672) takes the loop by default."""
    size = SILU_ONE_BLOCK_MAX + 1000
    gate_up = _gate_up(5, size, seed=9)
    want = quantize_rows_triton(silu_and_mul(gate_up))
    _assert_same_quantization(silu_and_mul_quant(gate_up), want)


def test_strided_rows_empty_batches_and_bad_shapes() -> None:
    generator = torch.Generator().manual_seed(2)
    wide = torch.randn(3, 2 * 96 + 32, generator=generator).to(torch.bfloat16).to(DEVICE)
    gate_up = wide[:, : 2 * 96]  # rows of a wider buffer: only the row stride differs
    want = quantize_rows_triton(silu_and_mul(gate_up.contiguous()))
    _assert_same_quantization(silu_and_mul_quant(gate_up), want)
    x, weight = wide[:, :96], torch.ones(96, dtype=torch.bfloat16, device=DEVICE)
    want = quantize_rows_triton(rms_norm(x.contiguous(), weight, 1e-5))
    _assert_same_quantization(add_rms_norm_quant(x, weight, 1e-5), want)
    codes, scales = add_rms_norm_quant(x[:0], weight, 1e-5)
    assert codes.shape == (0, 96) and scales.shape == (0, 1)
    codes, scales = silu_and_mul_quant(gate_up[:0])
    assert codes.shape == (0, 96) and scales.shape == (0, 1)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm_quant(x, weight, 1e-5, residual=x[:1])
    with pytest.raises(ValueError, match="gate_up"):
        silu_and_mul_quant(wide[:, :7])


def _load_layout(kernel: object, signature: dict[str, str], constexprs: dict[str, object]) -> str:
    """The blocked layout of the bf16 row loads (the sum of squares reduces over it) of the
    norm ``kernel`` compiled for sm_90. Needs compiled, not interpreted, Triton."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # Aligned pointers and ints, as the JIT specializes them for Llama's rows.
    names = kernel.arg_names  # type: ignore[attr-defined]
    attrs = {
        (names.index(name),): [["tt.divisibility", 16]]
        for name, kind in signature.items()
        if kind.startswith("*") or kind == "i32"
    }
    source = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    target = GPUTarget("cuda", 90, 32)
    ttgir = triton.compile(source, target=target, options={"num_warps": 8}).asm["ttgir"]
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.blocked<.*>)$", ttgir, re.M))
    load = re.search(r"tt\.load .*tensor<\d+x!tt\.ptr<bf16>, (#\w+)>", ttgir)
    assert load is not None, ttgir
    return layouts[load.group(1)]


def norm_load_layouts() -> tuple[str, str]:
    """``(rms_norm's, add_rms_norm_quant's)`` row-load layouts at hidden size 4096."""
    from kernels.fused_fp8_ops import _add_rms_norm_quant_kernel
    from kernels.fused_ops import _add_rms_norm_kernel

    common = {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16"}
    scalars = {"size": "i32", "eps": "fp32", "HAS_RESIDUAL": "constexpr", "BLOCK": "constexpr"}
    unfused = {**common, "out_ptr": "*bf16", "stride_x": "i32", "stride_residual": "i32"}
    unfused |= {"stride_out": "i32", **scalars}
    fused = {**common, "codes_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "stride_x": "i32"}
    fused |= {"stride_residual": "i32", "stride_codes": "i32", **scalars}
    fused |= dict.fromkeys(("VECTOR", "FP8_MAX_VALUE", "MIN_SCALE_VALUE"), "constexpr")
    constexprs: dict[str, object] = {"HAS_RESIDUAL": True, "BLOCK": 4096}
    return (
        _load_layout(_add_rms_norm_kernel, unfused, constexprs),
        _load_layout(
            _add_rms_norm_quant_kernel,
            fused,
            constexprs | {"VECTOR": 8, "FP8_MAX_VALUE": FP8_MAX, "MIN_SCALE_VALUE": MIN_SCALE},
        ),
    )


def test_norm_quant_sums_in_rms_norms_layout_on_hopper() -> None:
    """Triton lays out a row's loads as wide as its widest access: 16-code e4m3 stores would
    give each thread other elements of the float32 sum of squares than rms_norm's (8 bf16
    a thread), so other rounding on the GPU. The fused kernel must keep rms_norm's layout.

    Compiled (no GPU needed) in a child process: this one may interpret Triton.
    """
    pytest.importorskip("triton.backends.nvidia")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    code = "from tests.kernels.test_fused_fp8_ops import norm_load_layouts as f; print(*f(), sep='\\n')"
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    unfused, fused = result.stdout.strip().splitlines()
    assert "sizePerThread = [8]" in unfused
    assert fused == unfused


@pytest.mark.gpu
@pytest.mark.skipif(not _sm89(), reason="FP8 kernels need compute capability >= 8.9")
@pytest.mark.parametrize("rows", [3, 256, 4096])
def test_at_llama_widths(rows: int) -> None:
    for hidden in (4096, 5120, 8192):
        x = torch.randn(rows, hidden, device="cuda").to(torch.bfloat16)
        residual = torch.randn(rows, hidden, device="cuda").to(torch.bfloat16)
        weight = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
        want_residual, got_residual = residual.clone(), residual.clone()
        want = quantize_rows_triton(rms_norm(x, weight, 1e-5, residual=want_residual))
        _assert_same_quantization(add_rms_norm_quant(x, weight, 1e-5, got_residual), want)
        assert torch.equal(got_residual, want_residual)
    for intermediate in (14336, 28672):
        gate_up = (3 * torch.randn(rows, 2 * intermediate, device="cuda")).to(torch.bfloat16)
        want = quantize_rows_triton(silu_and_mul(gate_up))
        _assert_same_quantization(silu_and_mul_quant(gate_up), want)
        _assert_same_quantization(silu_and_mul_quant(gate_up, block=2048), want)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm89(), reason="FP8 kernels need compute capability >= 8.9")
def test_both_kernels_replay_from_a_cuda_graph() -> None:
    x = torch.randn(64, 4096, device="cuda").to(torch.bfloat16)
    residual = torch.randn_like(x)
    weight = torch.rand(4096, device="cuda").to(torch.bfloat16)
    gate_up = torch.randn(64, 2 * 14336, device="cuda").to(torch.bfloat16)
    add_rms_norm_quant(x, weight, 1e-5, residual.clone())  # compile outside the capture
    silu_and_mul_quant(gate_up)
    start = residual.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        norm_out = add_rms_norm_quant(x, weight, 1e-5, residual)
        silu_out = silu_and_mul_quant(gate_up)
    x.copy_(torch.randn_like(x) * 10)
    gate_up.copy_(torch.randn_like(gate_up) * 10)
    residual.copy_(start)
    graph.replay()
    want_residual = start.clone()
    _assert_same_quantization(
        norm_out, quantize_rows_triton(rms_norm(x, weight, 1e-5, residual=want_residual))
    )
    assert torch.equal(residual, want_residual)
    _assert_same_quantization(silu_out, quantize_rows_triton(silu_and_mul(gate_up)))
