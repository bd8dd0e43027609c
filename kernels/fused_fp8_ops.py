"""The decoder's fused element-wise kernels with an FP8 output: the input of an FP8 linear.

Before a ``torch._scaled_mm`` projection, the add + RMSNorm (input of qkv_proj and
gate_up_proj) and silu_and_mul (input of down_proj) of ``kernels/fused_ops.py`` would write
their bf16 rows only for :func:`kernels.triton_fp8_quant.quantize_rows_triton` to read them
back. These kernels quantize in the same program instead and write just the e4m3 codes and
the float32 row scales.

Bit for bit the unfused composition: each value is rounded to the model dtype first, exactly
as the unfused kernel stores it (the same ``@triton.jit`` helpers compute it), then quantized
by the helpers of the fused quantizer (same amax, reciprocal multiply and rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_kv import FP8_DTYPE, FP8_MAX
from kernels.fused_ops import (
    add_rms_norm_row,
    check_gate_up,
    check_norm_operands,
    norm_launch,
    silu_and_mul_cols,
)
from kernels.triton_fp8_quant import MIN_SCALE, row_scale, scaled_e4m3

# NOTE: silu_and_mul_quant keeps a row in one block up to this width (Llama-3.1-8B's 14336
# fits); a wider row loops over blocks twice, recomputing the values to quantize them.
SILU_ONE_BLOCK_MAX = 16384
SILU_LOOP_BLOCK = 4096


@triton.jit
def _add_rms_norm_quant_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    codes_ptr,
    scale_ptr,
    stride_x,
    stride_residual,
    stride_codes,
    size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    VECTOR: tl.constexpr,
    FP8_MAX_VALUE: tl.constexpr,
    MIN_SCALE_VALUE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    out = add_rms_norm_row(x_ptr, residual_ptr, weight_ptr, row, stride_x, stride_residual,
                           size, eps, HAS_RESIDUAL, BLOCK).to(tl.float32)  # fmt: skip
    scale, inverse = row_scale(tl.max(tl.abs(out), axis=0), FP8_MAX_VALUE, MIN_SCALE_VALUE)
    codes = scaled_e4m3(out, inverse, FP8_MAX_VALUE).to(codes_ptr.dtype.element_ty)
    # NOTE: stored at most VECTOR (8) codes a thread, as rms_norm stores its bf16 values:
    # Triton lays out a row's loads as wide as its widest access, and 16-code stores would
    # give each thread other elements of the float32 sum of squares, so other rounding.
    offs = tl.max_contiguous(tl.arange(0, BLOCK), VECTOR)
    tl.store(codes_ptr + row * stride_codes + offs, codes, mask=offs < size)
    tl.store(scale_ptr + row, scale)


def add_rms_norm_quant(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows_triton(rms_norm(x, weight, eps, residual))`` in one kernel: e4m3
    ``codes [T, size]`` and float32 ``scales [T, 1]``; ``residual`` (when given) is updated
    in place exactly as :func:`kernels.fused_ops.rms_norm` updates it. No host syncs."""
    check_norm_operands(x, residual)
    num_tokens, size = x.shape
    codes = torch.empty((num_tokens, size), device=x.device, dtype=FP8_DTYPE)
    scales = torch.empty((num_tokens, 1), device=x.device, dtype=torch.float32)
    if num_tokens:
        _add_rms_norm_quant_kernel[(num_tokens,)](
            x, residual if residual is not None else x, weight, codes, scales,
            x.stride(0), residual.stride(0) if residual is not None else 0, codes.stride(0),
            size, eps,
            HAS_RESIDUAL=residual is not None, VECTOR=16 // x.element_size(),
            FP8_MAX_VALUE=FP8_MAX, MIN_SCALE_VALUE=MIN_SCALE, **norm_launch(size),
        )  # fmt: skip
    return codes, scales


@triton.jit
def _silu_and_mul_quant_kernel(
    gate_up_ptr,
    codes_ptr,
    scale_ptr,
    stride_in,
    stride_codes,
    SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
    FP8_MAX_VALUE: tl.constexpr,
    MIN_SCALE_VALUE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    codes_row = codes_ptr + row * stride_codes
    if ONE_BLOCK:
        mask = offs < SIZE
        out = silu_and_mul_cols(gate_up_ptr, row, stride_in, SIZE, offs, mask).to(tl.float32)
        scale, inverse = row_scale(tl.max(tl.abs(out), axis=0), FP8_MAX_VALUE, MIN_SCALE_VALUE)
        codes = scaled_e4m3(out, inverse, FP8_MAX_VALUE).to(codes_ptr.dtype.element_ty)
        tl.store(codes_row + offs, codes, mask=mask)
    else:
        # NOTE: SIZE is a constexpr so the loops have static bounds (the interpreter needs
        # them). The second pass recomputes the values rather than storing them: its loads
        # mostly hit L2 (the row was read a moment ago), where a bf16 copy would cost a
        # write and a read of DRAM.
        magnitudes = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, SIZE, BLOCK):
            cols = start + offs
            out = silu_and_mul_cols(gate_up_ptr, row, stride_in, SIZE, cols, cols < SIZE)
            magnitudes = tl.maximum(magnitudes, tl.abs(out.to(tl.float32)))
        scale, inverse = row_scale(tl.max(magnitudes, axis=0), FP8_MAX_VALUE, MIN_SCALE_VALUE)
        for start in range(0, SIZE, BLOCK):
            cols = start + offs
            mask = cols < SIZE
            out = silu_and_mul_cols(gate_up_ptr, row, stride_in, SIZE, cols, mask)
            codes = scaled_e4m3(out.to(tl.float32), inverse, FP8_MAX_VALUE)
            tl.store(codes_row + cols, codes.to(codes_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def silu_and_mul_quant(
    gate_up: torch.Tensor, block: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows_triton(silu_and_mul(gate_up))`` in one kernel: e4m3 ``codes [T, size]``
    and float32 ``scales [T, 1]`` of ``gate_up [T, 2 * size]`` (gate first). No host syncs.

    One program per row: the row in one block up to :data:`SILU_ONE_BLOCK_MAX` wide, else
    two passes over blocks of :data:`SILU_LOOP_BLOCK`. ``block`` (a power of two) forces
    blocks of that width (tests, benchmarks); a block covering the row is one pass.
    """
    check_gate_up(gate_up)
    num_tokens, size = gate_up.shape[0], gate_up.shape[1] // 2
    codes = torch.empty((num_tokens, size), device=gate_up.device, dtype=FP8_DTYPE)
    scales = torch.empty((num_tokens, 1), device=gate_up.device, dtype=torch.float32)
    if block is None:
        whole = triton.next_power_of_2(size)
        block = whole if whole <= SILU_ONE_BLOCK_MAX else SILU_LOOP_BLOCK
    assert block > 0 and block & (block - 1) == 0, block
    if num_tokens:
        _silu_and_mul_quant_kernel[(num_tokens,)](
            gate_up, codes, scales, gate_up.stride(0), codes.stride(0),
            SIZE=size, BLOCK=block, ONE_BLOCK=block >= size, FP8_MAX_VALUE=FP8_MAX,
            MIN_SCALE_VALUE=MIN_SCALE, num_warps=max(1, min(16, block // 512)),
        )  # fmt: skip
    return codes, scales
