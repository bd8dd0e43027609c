"""Installs cached K/V rows at new positions in one Triton launch: gather, rotate, scatter.

One program per (token, layer) reads the key and value rows ``[kv_heads, head_dim]`` of
slot ``source[t]`` of the block-major cache ``[num_blocks, layers, 2, block_size,
kv_heads, head_dim]``, rotates the key's frequency pairs by the token's angles (float32),
and writes both rows to slot ``target[t]``. Source and target slots must not overlap.

In an e4m3 cache (``kernels/fp8_kv.py``: per slot all heads' codes, then their scales)
each key row is dequantized (codes times its scale, float32), rotated, and quantized again
under its own new scale exactly as the KV write does (``kernels/triton_kv_write.py``); the
value rows move as they are, scales included. An int8 cache stores its rows Hadamard-rotated
(``kernels/kv_rotation.py``), which mixes RoPE's pairs: ``kernels/rerotate.py`` moves
those with torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_kv import SCALE_BYTES, is_quantized_cache, stores_rotated_rows
from kernels.triton_kv_write import (
    fp8_scale_index,
    fp8_scale_view,
    quantized_codes,
    quantized_safe_scale,
    widen_codes,
)


@triton.jit
def _rerotate_copy_kernel(
    kv_ptr,
    scale_ptr,
    src_ptr,
    dst_ptr,
    cos_ptr,
    sin_ptr,
    stride_block,
    stride_layer,
    stride_kind,
    stride_slot,
    stride_head,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    src = tl.load(src_ptr + tok).to(tl.int64)
    dst = tl.load(dst_ptr + tok).to(tl.int64)
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HALF)
    if QUANT:
        rows = offs_h[:, None] * (2 * HALF) + offs_d[None, :]  # codes first, head after head
    else:
        rows = offs_h[:, None] * stride_head + offs_d[None, :]
    src_off = (
        (src // BLOCK_SIZE) * stride_block + layer * stride_layer + (src % BLOCK_SIZE) * stride_slot
    )
    dst_off = (
        (dst // BLOCK_SIZE) * stride_block + layer * stride_layer + (dst % BLOCK_SIZE) * stride_slot
    )
    src_base = kv_ptr + src_off
    dst_base = kv_ptr + dst_off
    cos = tl.load(cos_ptr + tok * HALF + offs_d, mask=offs_d < HALF)[None, :]
    sin = tl.load(sin_ptr + tok * HALF + offs_d, mask=offs_d < HALF)[None, :]
    x1 = tl.load(src_base + rows, mask=mask)
    x2 = tl.load(src_base + rows + HALF, mask=mask)
    if QUANT:
        head_valid = offs_h < NUM_KV_HEADS
        src_scale = fp8_scale_index(src_off, offs_h, NUM_KV_HEADS, 2 * HALF)
        dst_scale = fp8_scale_index(dst_off, offs_h, NUM_KV_HEADS, 2 * HALF)
        key_scale = tl.load(scale_ptr + src_scale, mask=head_valid, other=0.0)[:, None]
        x1 = widen_codes(x1, tl.float32, False) * key_scale
        x2 = widen_codes(x2, tl.float32, False) * key_scale
        r1 = tl.where(mask, x1 * cos - x2 * sin, 0.0)
        r2 = tl.where(mask, x2 * cos + x1 * sin, 0.0)
        amax = tl.maximum(tl.max(tl.abs(r1), 1), tl.max(tl.abs(r2), 1))
        safe = quantized_safe_scale(amax, False)
        tl.store(dst_base + rows, quantized_codes(r1, safe[:, None], False), mask=mask)
        tl.store(dst_base + rows + HALF, quantized_codes(r2, safe[:, None], False), mask=mask)
        tl.store(scale_ptr + dst_scale, tl.where(amax > 0, safe, 0.0), mask=head_valid)
        value_scale = tl.load(scale_ptr + src_scale + stride_kind // 4, mask=head_valid)
        tl.store(scale_ptr + dst_scale + stride_kind // 4, value_scale, mask=head_valid)
    else:
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
        out_ty = kv_ptr.dtype.element_ty
        tl.store(dst_base + rows, (x1 * cos - x2 * sin).to(out_ty), mask=mask)
        tl.store(dst_base + rows + HALF, (x2 * cos + x1 * sin).to(out_ty), mask=mask)
    v1 = tl.load(src_base + stride_kind + rows, mask=mask)
    v2 = tl.load(src_base + stride_kind + rows + HALF, mask=mask)
    tl.store(dst_base + stride_kind + rows, v1, mask=mask)
    tl.store(dst_base + stride_kind + rows + HALF, v2, mask=mask)


def rerotate_copy_triton(
    kv_cache: torch.Tensor,
    source: torch.Tensor,
    target: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """``source``/``target``: ``[T]`` int64 slots; ``cos``/``sin``: ``[T, head_dim // 2]``
    float32 of each token's rotation (see :func:`kernels.rerotate.rotation_angles`)."""
    if stores_rotated_rows(kv_cache):
        raise ValueError("int8 rows are stored rotated: move them with rerotate_copy_torch")
    _, num_layers, _, block_size, num_kv_heads, row_width = kv_cache.shape
    if source.numel() == 0:
        return
    quantized = is_quantized_cache(kv_cache)
    head_dim = row_width - SCALE_BYTES if quantized else row_width
    half = head_dim // 2
    _rerotate_copy_kernel[(source.numel(), num_layers)](
        kv_cache,
        fp8_scale_view(kv_cache) if quantized else kv_cache,
        source,
        target,
        cos.contiguous(),
        sin.contiguous(),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_cache.stride(4),
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF_PAD=triton.next_power_of_2(half),
        BLOCK_SIZE=block_size,
        QUANT=quantized,
    )
