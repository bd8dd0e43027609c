"""Weight-only FP8 linear for few rows (decode): ``y = x @ dequant(w).T + bias``, one launch.

``y[m, n] = ws[n] * sum_k x[m, k] * float(wq[n, k]) (+ bias[n])`` with ``x`` in bf16/fp16
as it comes (no activation quantization: at a few rows those extra kernels cost more
than the GEMM), ``wq [N, K]`` e4m3 and ``ws [N, 1]`` float32. At few rows a linear is a
read of its weights, so the kernel streams each weight byte once: one program per
``BLOCK_N`` output channels over the whole of K (no split-K, so no second pass and no
atomics; small tiles give even N = 4096 hundreds of programs for the 132 SMs of an H200).

Two forms of the inner product, chosen by the row count:

- up to :data:`MAX_FMA_ROWS` rows, float32 multiply-adds on the CUDA cores, the weight
  tile widened once and reused by every row;
- more rows, ``tl.dot`` on the tensor cores with the e4m3 tile widened to ``x``'s dtype
  (its loads software-pipelined by Triton, ``num_stages`` deep).

Accuracy: e4m3 widens exactly to bf16/fp16, and a bf16 times a widened e4m3 is exact in
float32, so against the float32 reference ``x.float() @ dequant(w).T`` only the summation
order (float32), the place of the scale multiply and the rounding of ``y`` to ``x``'s
dtype differ: ``|y - ref| <= 2^-8 |ref| + K * 2^-23 * ws[n] * sum_k |x[m, k] wq[n, k]|``.
No host syncs, so it records into CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_FMA_ROWS = 4
# NOTE: the dot form holds all rows in one tile; the layer switches to quantized
# activations and ``torch._scaled_mm`` well before this (kernels/fp8_linear.py).
MAX_ROWS = 64


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    stride_x,
    stride_out,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # NOTE: K is a constexpr: the loop bound is static (fine for the interpreter too) and
    # the row stride of the contiguous weight is known to the compiler (vector loads).
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * K
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # NOTE: one row (batch-1 decode) sums along K only after the loop: the steps are then
    # loads and multiply-adds alone, no cross-lane reduction or barrier between them.
    acc_1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        if USE_DOT:
            x = tl.load(x_rows + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            if DOT_FP32:
                acc = tl.dot(
                    x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee"
                )
            else:
                acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        elif BLOCK_M == 1:
            x1 = tl.load(x_ptr + ks, mask=mask_k, other=0.0)
            acc_1 += w.to(tl.float32) * x1.to(tl.float32)[None, :]
        else:
            # NOTE: the weight tile is widened once and used by every row; each row's dot
            # products are summed along K right away, so registers hold one tile, not
            # BLOCK_M, and more programs fit on an SM (more weight bytes in flight).
            wf = w.to(tl.float32)
            for m in tl.static_range(BLOCK_M):
                xm = tl.load(x_ptr + m * stride_x + ks, mask=mask_k & (m < M), other=0.0)
                part = tl.sum(wf * xm.to(tl.float32)[None, :], axis=1)
                acc += tl.where(offs_m[:, None] == m, part[None, :], 0.0)
    if not USE_DOT and BLOCK_M == 1:
        acc = tl.sum(acc_1, axis=1)[None, :]
    scale = tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)
    y = acc * scale[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def gemv_config(rows: int, out_features: int) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)`` for ``rows`` rows.

    NOTE: memory-bound, so what counts is weight bytes in flight per SM. A program holds
    one ``BLOCK_N x BLOCK_K`` e4m3 tile (8 KB) per step; at one row narrow N tiles give
    even N = 4096 512 programs (about four per SM on an H200, all resident at once) and
    wide layers 16 channels a program, still thousands of programs. The dot form pipelines its loads
    instead. ``python -m kernels.bench_fp8_linear --sweep`` times the alternatives.
    """
    if rows == 1:
        # NOTE: measured on an H200 (8B shape): N <= 8192 fastest at 8 x 1024 (16 x 512
        # within 1 us), gate_up (N = 28672) at 4 x 4096, 18% faster than 16 x 512.
        return (1, 8, 1024, 4, 1) if out_features <= 8192 else (1, 4, 4096, 4, 1)
    if rows <= MAX_FMA_ROWS:
        # NOTE: 512 wide in K is one warp's vector load, so each per-step row sum stays
        # within a warp (no shared-memory round trip).
        return triton.next_power_of_2(rows), 16, 512, 4, 1
    block_m = max(16, triton.next_power_of_2(rows))
    # NOTE: each stage holds a BLOCK_M x 512 bf16 tile and a 32 x 512 e4m3 one: at 64 rows
    # (80 KB a stage) three stages ask 256 KB of shared memory, more than an H200's 227.
    return block_m, 32, 512, 4, 3 if block_m <= 32 else 2


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """``x @ dequant(weight).T + bias`` in ``x``'s dtype for ``x [M, K]`` bf16/fp16 with
    ``M <= MAX_ROWS``, ``weight [N, K]`` e4m3 (contiguous), ``weight_scale [N, 1]`` float32.
    ``config`` overrides :func:`gemv_config` (benchmarks)."""
    rows, in_features = x.shape
    out_features = weight.shape[0]
    assert x.dtype in (torch.bfloat16, torch.float16) and x.stride(1) == 1, (x.dtype, x.stride())
    assert weight.shape[1] == in_features and weight.is_contiguous(), weight.shape
    assert 0 < rows <= MAX_ROWS, rows
    out = torch.empty(rows, out_features, device=x.device, dtype=x.dtype)
    block_m, block_n, block_k, num_warps, num_stages = config or gemv_config(rows, out_features)
    _fp8_gemv_kernel[(triton.cdiv(out_features, block_n),)](
        x,
        weight,
        weight_scale,
        bias if bias is not None else weight_scale,  # NOTE: never read without HAS_BIAS
        out,
        rows,
        out_features,
        x.stride(0),
        out.stride(0),
        K=in_features,
        HAS_BIAS=bias is not None,
        USE_DOT=block_m >= 16,
        # NOTE: triton 3.6's interpreter gets bf16 dots wrong; on the CPU the dot takes
        # float32 operands (exact here too: both widen exactly, their products fit float32).
        DOT_FP32=x.device.type == "cpu",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def fp8_gemv_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 ``x @ dequant(weight).T + bias``: what :func:`fp8_gemv` computes, in float32."""
    out = x.to(torch.float32) @ (weight.to(torch.float32) * weight_scale).t()
    return out if bias is None else out + bias.to(torch.float32)
