"""FP8 (e4m3) linear layers: per-output-channel weight scales, per-token activation scales.

``y = x @ w.T`` becomes ``y[m, n] = xs[m] * ws[n] * sum_k xq[m, k] * wq[n, k]`` where
``wq [N, K]`` holds the e4m3 codes of ``w / ws`` (``ws = amax(|w[n]|) / 448``, fixed at load)
and ``xq`` those of ``x * (1 / xs)`` (``xs = amax(|x[m]|) / 448``, computed per call on the
device).

Two paths compute it (and, for few rows, :func:`fp8_linear_cuda` skips the activation
quantization: ``kernels/triton_fp8_gemv.py``):

- :func:`fp8_matmul_scaled_mm`: ``torch._scaled_mm`` with row-wise scales, on CUDA devices
  of compute capability 8.9 or more (Ada, Hopper), bf16 out. No host syncs, so it records
  into CUDA graphs.
- :func:`fp8_matmul_reference`: the same arithmetic in float32 anywhere (the CPU, tests):
  the activation fake-quantized exactly as the GPU path quantizes it, the weight
  dequantized, one float32 matmul. The GPU path is checked against it.

Accuracy: each e4m3 element is within ``2^-4`` of itself (relative, 3 mantissa bits) or
``2^-10 * scale`` (subnormals) of the original, so each product is within about ``2^-3``
relative of exact, and ``|y - y_exact| <= 2^-3 * sum_k |x[m, k] * w[n, k]|`` (plus bf16
rounding of the output on the GPU). Against the reference's float32 sum of the same codes,
the GPU path is within ``2^-7 * |y| + ACCUMULATION_TOLERANCE * sum_k |xq * wq|``: Hopper's
fast FP8 accumulation (:data:`FAST_ACCUM`) keeps fewer bits in the running sum than float32.
"""

from __future__ import annotations

import torch

from kernels.fp8_kv import FP8_DTYPE, FP8_MAX

# NOTE: the row count up to which the weight-only GEMV beats quantize + ``_scaled_mm``
# (kernels/bench_fp8_linear.py times both). A captured decode graph has a fixed row count,
# so the choice is made once per graph, at trace time.
WEIGHT_ONLY_MAX_ROWS = (
    2  # measured on an H200: at 4 rows quantize + mm is faster in every projection
)

# NOTE: Hopper's tensor cores sum FP8 products in fewer bits than float32; without fast
# accumulation cuBLAS adds each partial sum into float32 registers. vLLM's FP8 GEMMs take
# the fast form too. Measured on an NVIDIA H200 (8B shape, BENCHMARKS.md, FP8 weights):
# `_scaled_mm` 0.85-0.95x the time at 256 and 4,096 rows; the engine's 32k-token prompt
# 0.894 s and 256 x (512, 128) 10,245 tok/s (before: 0.915 s, 9,631 tok/s); the error
# against float32 sums of the same codes, over sum_k |xq * wq|, at most 1.0e-3 (float32
# accumulation: 0.3e-3), far under the codes' own rounding (2^-3 of the same sum).
FAST_ACCUM = True
ACCUMULATION_TOLERANCE = 2.0**-9

# NOTE: below float32's smallest normal a scale loses bits and x / scale can overflow;
# an all-zero row gets this scale and quantizes to exact zeros.
_MIN_SCALE = torch.finfo(torch.float32).tiny


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [R, C] e4m3, scales [R, 1] float32)`` of ``x [R, C]``: one scale per row,
    ``amax(|row|) / 448``, so every row uses e4m3's whole range without clipping."""
    # NOTE: the amax is exact in x's own dtype, so only one float32 temporary is made.
    amax = x.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    # NOTE: times the float32 reciprocal, not divided: torch's CUDA division by a scalar
    # multiplies by its reciprocal while its CPU one divides, so this is the one form that
    # gives the same bits everywhere (within one ulp of amax / 448).
    scale = (amax * (1.0 / FP8_MAX)).clamp_min(_MIN_SCALE)
    # NOTE: times the row's reciprocal (one IEEE division a row), not divided element by
    # element: a product rounds the same on every backend and costs the GPU kernel a tenth
    # of a division. The clamp only guards rounding at the edge (at most 448 in theory).
    inverse = 1.0 / scale
    codes = (x.to(torch.float32) * inverse).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``codes * scale`` (``scale`` broadcast over each row)."""
    return codes.to(torch.float32) * scale


def product_magnitudes(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, quantized: bool = True
) -> torch.Tensor:
    """float32 ``sum_k |x[m, k] * w[n, k]|`` of what the path multiplies (``x``'s e4m3 codes
    times their scales when ``quantized``, else ``x`` itself, as the GEMV does): the scale
    :data:`ACCUMULATION_TOLERANCE` applies to."""
    operand = dequantize_rows(*quantize_rows(x)) if quantized else x.to(torch.float32)
    return operand.abs() @ dequantize_rows(weight, weight_scale).abs().t()


def fp8_matmul_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 ``quant(x) @ dequant(weight).T + bias`` for ``x [M, K]``, ``weight [N, K]``
    e4m3 and ``weight_scale [N, 1]`` float32: the arithmetic of the GPU path, exactly."""
    x_codes, x_scale = quantize_rows(x)
    return fp8_matmul_reference_quantized(x_codes, x_scale, weight, weight_scale, bias)


def fp8_matmul_reference_quantized(
    x_codes: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`fp8_matmul_reference` on an activation already quantized by row."""
    out = dequantize_rows(x_codes, x_scale) @ dequantize_rows(weight, weight_scale).t()
    return out if bias is None else out + bias.to(torch.float32)


def fp8_matmul_scaled_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``quant(x) @ dequant(weight).T + bias`` by ``torch._scaled_mm``, in ``x``'s dtype (bf16).

    ``weight [N, K]`` is row-major, so ``weight.t()`` is the column-major ``[K, N]`` operand
    ``_scaled_mm`` wants; no copy. Both scales stay on the device (graph-safe).
    """
    x_codes, x_scale = quantize_rows(x)
    return scaled_mm_quantized(x_codes, x_scale, weight, weight_scale, x.dtype, bias)


def scaled_mm_quantized(
    x_codes: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``torch._scaled_mm`` call of :func:`fp8_matmul_scaled_mm` on an activation
    already quantized (by :func:`quantize_rows` or its fused Triton twin)."""
    out = torch._scaled_mm(
        x_codes,
        weight.t(),
        scale_a=x_scale,
        scale_b=weight_scale.view(1, -1),
        out_dtype=out_dtype,
        use_fast_accum=FAST_ACCUM,
    )
    return out if bias is None else out + bias


def fp8_linear_cuda(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The FP8 linear where :func:`scaled_mm_usable`, by row count: up to
    :data:`WEIGHT_ONLY_MAX_ROWS` rows ``x @ dequant(weight).T + bias`` by the weight-only
    GEMV (no activation quantization), more rows :func:`fp8_matmul_scaled_mm` with the
    activation quantized by one fused kernel. ``x [M, K]`` bf16, out bf16."""
    # NOTE: imported on first use: Triton is needed on CUDA only (the CPU path and CPU-only
    # installs do without it), and importing Triton kernels fixes their mode (compiled, or
    # interpreted in tests).
    from kernels.triton_fp8_gemv import fp8_gemv
    from kernels.triton_fp8_quant import MAX_ROW, quantize_rows_triton

    x = x.contiguous()
    if x.shape[0] <= WEIGHT_ONLY_MAX_ROWS:
        return fp8_gemv(x, weight, weight_scale, bias)
    quantize = quantize_rows_triton if x.shape[1] <= MAX_ROW else quantize_rows
    x_codes, x_scale = quantize(x)
    return scaled_mm_quantized(x_codes, x_scale, weight, weight_scale, x.dtype, bias)


def scaled_mm_usable(
    device: torch.device, dtype: torch.dtype, in_features: int, out_features: int
) -> bool:
    """Whether :func:`fp8_matmul_scaled_mm` runs here: CUDA with compute capability >= 8.9,
    bf16 activations (row-wise scaling writes bf16 only), and both matrix dims multiples of
    16 (a ``_scaled_mm`` layout rule)."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False
    if in_features % 16 or out_features % 16:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)
