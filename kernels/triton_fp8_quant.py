"""Per-token FP8 activation quantization in one Triton launch (large-M FP8 linears).

One program per row loads the row once and writes what :func:`kernels.fp8_linear.quantize_rows`
writes, bit for bit: ``scale = max(amax(|row|) * (1 / 448), tiny)`` and the e4m3 codes of
``clamp(row * (1 / scale), -448, 448)`` rounded to nearest even. It replaces five torch kernels
(abs, amax, scale, multiply-clamp, cast) and their float32 temporaries. Its ``@triton.jit``
helpers also quantize inside the kernels that make the activation (``kernels/fused_fp8_ops.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_kv import FP8_DTYPE, FP8_MAX

MIN_SCALE = torch.finfo(torch.float32).tiny
# NOTE: one row is one block; rows longer than this would spill registers (Llama's largest
# activation row, down_proj's input, is 14336 wide).
MAX_ROW = 32768


@triton.jit
def round_to_e4m3(q):
    """``q`` (float32, |q| <= 448) rounded to the nearest e4m3 value, ties to even, sign kept.

    NOTE: triton 3.6's interpreter rounds float32 -> e4m3 casts neither to nearest nor to
    even, so the rounding is done here in float32 and the cast that follows is exact on
    every backend: the e4m3 step at |q| is 2^(max(exponent(q), -6) - 3) (3 mantissa bits,
    subnormals below 2^-6), and adding then subtracting 1.5 * 2^23 steps rounds to a
    multiple of it in float32's round-to-nearest-even.
    """
    bits = q.to(tl.int32, bitcast=True)
    sign = bits & -2147483648
    magnitude = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3
    step = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    magic = step * 12582912.0  # 1.5 * 2^23 steps: its ulp is one step
    rounded = (magnitude + magic) - magic
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def row_scale(amax, FP8_MAX_VALUE: tl.constexpr, MIN_SCALE_VALUE: tl.constexpr):
    """``(scale, 1 / scale)`` of a row whose largest magnitude is ``amax`` (float32).

    NOTE: times the float32 reciprocal, as torch computes ``amax / 448`` on CUDA; the
    row's reciprocal is an IEEE division (``/`` is an approximate one on the GPU).
    """
    scale = tl.maximum(amax * (1.0 / FP8_MAX_VALUE), MIN_SCALE_VALUE)
    return scale, tl.math.div_rn(1.0, scale)


@triton.jit
def scaled_e4m3(x, inverse, FP8_MAX_VALUE: tl.constexpr):
    """The e4m3 values (float32, exact in e4m3) of ``x`` (float32) times its row's
    ``inverse`` scale: what :func:`kernels.fp8_linear.quantize_rows` casts to e4m3."""
    q = tl.minimum(tl.maximum(x * inverse, -FP8_MAX_VALUE), FP8_MAX_VALUE)
    return round_to_e4m3(q)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    codes_ptr,
    scale_ptr,
    stride_x,
    stride_codes,
    COLS: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8_MAX_VALUE: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < COLS
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    scale, inverse = row_scale(tl.max(tl.abs(x), axis=0), FP8_MAX_VALUE, MIN_SCALE)
    codes = scaled_e4m3(x, inverse, FP8_MAX_VALUE).to(codes_ptr.dtype.element_ty)
    tl.store(codes_ptr + row * stride_codes + offs, codes, mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [R, C] e4m3, scales [R, 1] float32)`` of ``x [R, C]`` (rows contiguous),
    equal to :func:`kernels.fp8_linear.quantize_rows`. No host syncs (graph-safe)."""
    rows, cols = x.shape
    assert x.stride(1) == 1 and cols <= MAX_ROW, (x.shape, x.stride())
    codes = torch.empty(rows, cols, device=x.device, dtype=FP8_DTYPE)
    scale = torch.empty(rows, 1, device=x.device, dtype=torch.float32)
    if rows == 0:
        return codes, scale
    block = triton.next_power_of_2(cols)
    _quantize_rows_kernel[(rows,)](
        x,
        codes,
        scale,
        x.stride(0),
        codes.stride(0),
        COLS=cols,
        BLOCK=block,
        FP8_MAX_VALUE=FP8_MAX,
        MIN_SCALE=MIN_SCALE,
        num_warps=max(1, min(16, block // 512)),
    )
    return codes, scale
