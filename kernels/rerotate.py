"""Moving cached keys to new positions: RoPE is a rotation, so ``R(b) k = R(b - a) R(a) k``.

Keys in the KV cache are stored after the half-rotation ("neox") RoPE of the Llama family.
A key stored for position ``a`` becomes the key for position ``b`` by one more rotation of
each frequency pair by ``b - a`` angles; values carry no position and stay as they are.
"""

from __future__ import annotations

import torch


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


def rerotate_keys(
    keys: torch.Tensor, inv_freq: torch.Tensor, source: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """Keys ``[T, kv_heads, head_dim]`` stored for positions ``source`` rotated to ``target``.

    ``inv_freq``: the model's ``[head_dim // 2]`` inverse frequencies (rope scaling applied;
    an attention scaling of cos/sin, as YaRN's, is already inside the stored keys and is
    kept, since a rotation does not change norms). Computed in float32, returned in the
    keys' dtype.
    """
    angles = rotation_angles(inv_freq, source, target)
    cos = angles.cos().to(torch.float32)[:, None, :]
    sin = angles.sin().to(torch.float32)[:, None, :]
    x1, x2 = keys.to(torch.float32).chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(keys.dtype)
