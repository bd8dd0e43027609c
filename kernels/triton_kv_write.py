"""Writes the new tokens' K/V into their slots of the paged cache, as one Triton launch.

One program per token copies its ``[num_kv_heads, head_dim]`` key and value rows to slot
``slot_mapping[t]`` (block ``slot // block_size``, offset ``slot % block_size``) of a
layer view ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``, through strides, so
the non-contiguous per-layer view of the block-major cache is written in place.
A negative slot marks a padding token (e.g. CUDA-graph padding) and is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    kv_ptr,
    slot_ptr,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kv_block,
    stride_kv_kind,
    stride_kv_slot,
    stride_kv_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    dst = (
        kv_ptr
        + (slot // BLOCK_SIZE) * stride_kv_block
        + (slot % BLOCK_SIZE) * stride_kv_slot
        + offs_h[:, None] * stride_kv_head
        + offs_d[None, :]
    )
    k = tl.load(
        key_ptr + tok * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :], mask=mask
    )
    v = tl.load(
        value_ptr + tok * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :],
        mask=mask,
    )
    tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_kv_kind, v.to(kv_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``key``/``value`` (``[T, num_kv_heads, head_dim]``) at ``slot_mapping`` (``[T]``).

    Same contract as ``kernels.interface.write_kv``, plus: negative slots are skipped.
    Values are cast to the cache dtype. Slots must be distinct (no ordering between tokens).
    """
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ in shape")
    num_tokens, num_kv_heads, head_dim = key.shape
    if kv_layer.dim() != 5 or tuple(kv_layer.shape[3:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"kv_layer {tuple(kv_layer.shape)} does not hold [*, 2, block_size, {num_kv_heads}, {head_dim}] rows"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"slot_mapping has shape {tuple(slot_mapping.shape)}, expected ({num_tokens},)"
        )
    if key.stride(-1) != 1 or value.stride(-1) != 1 or kv_layer.stride(-1) != 1:
        raise ValueError("key, value and kv_layer need a unit stride on head_dim")
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, kv_layer, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_layer.shape[2],
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )  # fmt: skip
