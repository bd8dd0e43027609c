"""Moving cached keys to new positions: RoPE is a rotation, so ``R(b) k = R(b - a) R(a) k``.

Keys in the KV cache are stored after the half-rotation ("neox") RoPE of the Llama family.
A key stored for position ``a`` becomes the key for position ``b`` by one more rotation of
each frequency pair by ``b - a`` angles; values carry no position and stay as they are.
"""

from __future__ import annotations

import torch

from kernels.fp8_kv import (
    dequantize_slots,
    is_quantized_cache,
    quantize_slots,
    stores_rotated_rows,
)


def rotation_angles(
    inv_freq: torch.Tensor, source: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """Per-token, per-frequency angles ``[T, head_dim // 2]`` (float64) from ``source`` to
    ``target`` positions (``[T]`` integers).

    NOTE: the model builds its tables from float32 products ``position * inv_freq``; the
    difference of those two rounded angles (taken in float64) lands exactly on the table
    angle of ``target``, where ``(target - source) * inv_freq`` would be off by the
    rounding of large positions.
    """
    freq = inv_freq.to(device=source.device, dtype=torch.float32)
    at_target = target.to(torch.float32)[:, None] * freq[None, :]
    at_source = source.to(torch.float32)[:, None] * freq[None, :]
    return at_target.to(torch.float64) - at_source.to(torch.float64)


def rotation_cos_sin(
    inv_freq: torch.Tensor, source: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (float32, ``[T, head_dim // 2]``) of ``rotation_angles``."""
    angles = rotation_angles(inv_freq, source, target)
    return angles.cos().to(torch.float32), angles.sin().to(torch.float32)


def rerotate_keys(
    keys: torch.Tensor, inv_freq: torch.Tensor, source: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """Keys ``[T, kv_heads, head_dim]`` stored for positions ``source`` rotated to ``target``.

    ``inv_freq``: the model's ``[head_dim // 2]`` inverse frequencies (rope scaling applied;
    an attention scaling of cos/sin, as YaRN's, is already inside the stored keys and is
    kept, since a rotation does not change norms). Computed in float32, returned in the
    keys' dtype.
    """
    cos, sin = rotation_cos_sin(inv_freq, source, target)
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = keys.to(torch.float32).chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(keys.dtype)


def rerotate_copy(
    kv_cache: torch.Tensor,
    source: torch.Tensor,
    target: torch.Tensor,
    inv_freq: torch.Tensor,
    source_positions: torch.Tensor,
    target_positions: torch.Tensor,
) -> None:
    """Copy every layer's K/V of cache slots ``source`` to slots ``target`` (``[T]`` int64,
    not overlapping), keys rotated from ``source_positions`` to ``target_positions``.

    ``kv_cache``: ``[num_blocks, layers, 2, block_size, kv_heads, head_dim]``, or an 8-bit
    cache of either kind (``kernels/fp8_kv.py``), whose keys are dequantized, rotated and
    quantized again in the same format, each row under its own new scale. On CUDA one
    Triton launch (:mod:`kernels.triton_rerotate`) except for int8; elsewhere torch indexing.
    """
    # NOTE: int8 rows are stored in another basis (kernels/kv_rotation.py), where RoPE's
    # pairs are mixed: torch dequantizes them back first.
    if kv_cache.device.type == "cuda" and not stores_rotated_rows(kv_cache):
        from kernels.triton_rerotate import rerotate_copy_triton

        cos, sin = rotation_cos_sin(inv_freq, source_positions, target_positions)
        rerotate_copy_triton(kv_cache, source, target, cos, sin)
        return
    rerotate_copy_torch(kv_cache, source, target, inv_freq, source_positions, target_positions)


def rerotate_copy_torch(
    kv_cache: torch.Tensor,
    source: torch.Tensor,
    target: torch.Tensor,
    inv_freq: torch.Tensor,
    source_positions: torch.Tensor,
    target_positions: torch.Tensor,
) -> None:
    """``rerotate_copy`` with torch indexing (the reference, and the CPU path)."""
    size = kv_cache.shape[3]
    rows = kv_cache[source // size, :, :, source % size]  # [T, layers, 2, kv_heads, width]
    keys = rows[:, :, 0]
    quantized = is_quantized_cache(kv_cache)
    if quantized:  # NOTE: dequantize, rotate in float32, quantize under the rotated row's scale
        keys = dequantize_slots(keys, torch.float32)
    n, layers, heads, dim = keys.shape
    # NOTE: every layer of a token moves by the same angle: one rotation of all heads.
    flat = keys.reshape(n, layers * heads, dim)
    moved = rerotate_keys(flat, inv_freq, source_positions, target_positions)
    moved = moved.view(n, layers, heads, dim)
    kv_cache[target // size, :, 0, target % size] = (
        quantize_slots(moved, kv_cache.dtype) if quantized else moved
    )
    kv_cache[target // size, :, 1, target % size] = rows[:, :, 1]
