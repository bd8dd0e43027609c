"""Fused element-wise kernels of the decoder layer for half-precision GPU runs.

Eagerly, a Llama layer spends about forty small kernels on element-wise work (the
RMSNorm's float32 round trip, rotary's halves and concatenation, SiLU and the gate
product, the residual adds), each reading and writing the whole activation. At a decode
batch that is a third of the GPU time, and in prefill about a fifth. These kernels do
each group in one pass.

Each one repeats the rounding steps of the eager torch code it replaces (every
intermediate the eager code stores in the model dtype is rounded to it here too). On an
H200 results stay within one unit of the dtype's spacing of eager torch, not bit for bit
(about a quarter of rotary's outputs differ by that unit), so these kernels serve half
precision only; float32 keeps the eager code as the exact reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def add_rms_norm_row(
    x_ptr,
    residual_ptr,
    weight_ptr,
    row,
    stride_x,
    stride_residual,
    size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Row ``row`` of RMSNorm(x [+ residual]) in the model dtype, zero past ``size``; with
    ``HAS_RESIDUAL`` the sum is stored into ``residual``. One block holds the whole row."""
    offs = tl.arange(0, BLOCK)
    mask = offs < size
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(dtype)
        tl.store(residual_ptr + row * stride_residual + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / size
    normed = (x32 * tl.math.rsqrt(variance + eps)).to(dtype)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    return (weight.to(tl.float32) * normed.to(tl.float32)).to(dtype)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    out = add_rms_norm_row(x_ptr, residual_ptr, weight_ptr, row, stride_x, stride_residual,
                           size, eps, HAS_RESIDUAL, BLOCK)  # fmt: skip
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + row * stride_out + offs, out, mask=offs < size)


def check_norm_operands(x: torch.Tensor, residual: torch.Tensor | None) -> None:
    """ValueError unless ``x`` is ``[tokens, size]`` with rows of unit stride, as is
    ``residual`` when given."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [tokens, size] with a unit last stride, got {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")


def norm_launch(size: int) -> dict[str, int]:
    """The block and warps of a norm of rows of ``size``.

    NOTE: the float32 sum of squares adds in an order set by the block and warps, so every
    kernel that must match :func:`rms_norm` bit for bit launches with these.
    """
    return {"BLOCK": triton.next_power_of_2(size), "num_warps": 8 if size >= 4096 else 4}


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of ``x [T, size]``; with ``residual``, of ``x + residual``, stored into ``residual``.

    The in-place update of ``residual`` is what lets a layer carry its residual stream
    without a separate add kernel.
    """
    check_norm_operands(x, residual)
    out = torch.empty_like(x)
    num_tokens, size = x.shape
    if num_tokens:
        _add_rms_norm_kernel[(num_tokens,)](
            x, residual if residual is not None else x, weight, out,
            x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
            size, eps,
            HAS_RESIDUAL=residual is not None, **norm_launch(size),
        )  # fmt: skip
    return out


@triton.jit
def silu_and_mul_cols(gate_up_ptr, row, stride_in, size, offs, mask):
    """``silu(gate) * up`` of columns ``offs`` of row ``row``, in the model dtype (zero where
    not ``mask``)."""
    gate = tl.load(gate_up_ptr + row * stride_in + offs, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + size + offs, mask=mask, other=0.0)
    gate32 = gate.to(tl.float32)
    activated = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype)
    return (activated.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, size, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    out = silu_and_mul_cols(gate_up_ptr, row, stride_in, size, offs, mask)
    tl.store(out_ptr + row * stride_out + offs, out, mask=mask)


def check_gate_up(gate_up: torch.Tensor) -> None:
    """ValueError unless ``gate_up`` is ``[tokens, 2 * size]`` with rows of unit stride."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"gate_up must be [tokens, 2 * size], got {tuple(gate_up.shape)}")


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [T, 2 * size]`` (gate first): ``[T, size]``."""
    check_gate_up(gate_up)
    num_tokens, size = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_tokens, size), dtype=gate_up.dtype, device=gate_up.device)
    block = min(2048, triton.next_power_of_2(size))
    if num_tokens:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(size, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), size, BLOCK=block, num_warps=4
        )
    return out


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    tok,
    stride_src_tok,
    stride_src_head,
    stride_dst_tok,
    stride_dst_head,
    cos,
    sin,
    num_heads,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
):
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < num_heads)[:, None]
    first = src_ptr + tok * stride_src_tok + offs_h[:, None] * stride_src_head + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    # NOTE: each product rounded to the model dtype before the sum, as eager torch rounds it.
    a = (x1 * cos).to(dtype).to(tl.float32)
    b = (x2 * sin).to(dtype).to(tl.float32)
    c = (x2 * cos).to(dtype).to(tl.float32)
    d = (x1 * sin).to(dtype).to(tl.float32)
    out = dst_ptr + tok * stride_dst_tok + offs_h[:, None] * stride_dst_head + offs_d[None, :]
    tl.store(out, (a - b).to(dtype), mask=mask)
    tl.store(out + HALF, (c + d).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    positions_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    num_q_heads,
    num_k_heads,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    offs_d = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * HALF + offs_d).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * HALF + offs_d).to(tl.float32)[None, :]
    q_row, k_row = num_q_heads * 2 * HALF, num_k_heads * 2 * HALF
    _rotate_heads(q_ptr, q_out_ptr, tok, stride_q_tok, stride_q_head, q_row, 2 * HALF,
                  cos, sin, num_q_heads, Q_HEADS_PAD, HALF)  # fmt: skip
    _rotate_heads(k_ptr, k_out_ptr, tok, stride_k_tok, stride_k_head, k_row, 2 * HALF,
                  cos, sin, num_k_heads, K_HEADS_PAD, HALF)  # fmt: skip


def rotary(
    query: torch.Tensor,
    key: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated contiguous copies of ``query [T, H, D]`` and ``key [T, H_kv, D]`` (HF's
    half-split RoPE).

    ``cos_table``/``sin_table`` are ``[max_positions, D // 2]`` in the model dtype, rows
    picked by ``positions [T]``. Any token and head strides on input; unit stride on ``D``.
    The outputs are contiguous because fused attention runs fastest on contiguous inputs
    (cuDNN on an NVIDIA H200: 646 against 590 TFLOP/s for views of the qkv projection at
    32k tokens): writing them here costs what rotating in place did, and saves a copy.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    half = head_dim // 2
    if key.shape[0] != num_tokens or key.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} do not pair up")
    if cos_table.shape[-1] != half or cos_table.stride(0) != half or sin_table.stride(0) != half:
        raise ValueError(f"rotary tables must be contiguous [positions, {half}]")
    if half & (half - 1):
        raise ValueError(f"head_dim {head_dim} must be twice a power of two")
    if query.stride(-1) != 1 or key.stride(-1) != 1:
        raise ValueError("query and key need a unit stride on head_dim")
    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    key_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            query, key, query_out, key_out, cos_table, sin_table, positions,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1),
            num_q_heads, key.shape[1],
            Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
            K_HEADS_PAD=triton.next_power_of_2(key.shape[1]),
            HALF=half, num_warps=4,
        )  # fmt: skip
    return query_out, key_out
