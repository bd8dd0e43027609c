"""Rotary position embeddings (half-rotation/"neox" style, as HF Llama) with rope scaling.

Supported ``rope_type``s: ``default``, ``linear``, ``llama3``, ``yarn``. Inverse frequencies
are computed on the host in float32 exactly like transformers does; the cos/sin tables are
then computed once on the model's device for every position up to ``max_positions`` so a
forward pass only gathers rows by position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kernels import cpu_layer_ops
from ragserve.models.layers import fused_ops, use_fused_kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings of ``config`` as one flat dict holding ``rope_type`` and ``rope_theta``.

    transformers 5 keeps them in ``config.rope_parameters``; older config objects keep
    ``rope_theta`` plus an optional ``rope_scaling`` dict whose type key may be ``type``.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
    if "rope_type" not in params:
        params["rope_type"] = params.pop("type", "default")
    if params.get("rope_theta") is None:
        params["rope_theta"] = float(getattr(config, "rope_theta", None) or 10000.0)
    return params


def compute_inv_freq(
    params: dict[str, Any], head_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim // 2] float32 on the host, attention scaling of cos/sin)``."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported (only 1.0)")
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(params, base, head_dim, max_position_embeddings)
    return inv_freq, 1.0


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency smoothing: long wavelengths slowed by ``factor``, a ramp in between."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    params: dict[str, Any], base: float, dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, keep high ones, scale attention by ``mscale``."""
    original = params.get("original_max_position_embeddings") or max_position_embeddings
    factor = params.get("factor") or max_position_embeddings / original

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # NOTE: avoids a zero-width ramp, as transformers does
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables, gathered once per forward pass and shared by all layers.

    ``cos``/``sin`` are ``[max_positions, head_dim // 2]`` in the model dtype (transformers
    also casts its float32 cos/sin to the activation dtype before rotating).
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(
        self,
        inv_freq: torch.Tensor,
        attention_scaling: float,
        max_positions: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.inv_freq = inv_freq.to(torch.float32)
        self.attention_scaling = attention_scaling
        self.max_positions = max_positions
        cos, sin = self._tables(device, dtype)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(
        self, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq.to(device)[None, :]
        cos = (freqs.cos() * self.attention_scaling).to(dtype)
        sin = (freqs.sin() * self.attention_scaling).to(dtype)
        return cos, sin

    def divide_frequencies(self, factors: torch.Tensor) -> None:
        """Divide each inverse frequency by ``factors`` (llama.cpp's ``rope_freqs``) and rebuild."""
        if factors.shape != self.inv_freq.shape:
            raise ValueError(
                f"rope frequency factors have shape {tuple(factors.shape)}, "
                f"expected {tuple(self.inv_freq.shape)}"
            )
        self.inv_freq = self.inv_freq / factors.to(torch.float32).cpu()
        cos, sin = self._tables(self.cos.device, self.cos.dtype)
        self.cos, self.sin = cos, sin

    def forward(self, positions: torch.Tensor) -> Rotation:
        """The rotation of a batch's tokens at ``positions [T]``, shared by every layer."""
        if use_fused_kernels(self.cos):
            return Rotation(positions, self.cos, self.sin, fused=True)
        # Eager: gather the rows once per forward, not once per layer.
        return Rotation(
            positions, self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        )


@dataclass(frozen=True)
class Rotation:
    """cos/sin rows ``[T, 1, head_dim // 2]`` (eager), or the whole tables (``fused``)."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    fused: bool = False

    def rotate(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated ``query [T, H, D]`` and ``key [T, H_kv, D]`` (contiguous when fused)."""
        if self.fused:
            return fused_ops().rotary(query, key, self.cos, self.sin, self.positions)
        return apply_rotary(query, self.cos, self.sin), apply_rotary(key, self.cos, self.sin)

    def rotate_heads(self, heads: torch.Tensor) -> torch.Tensor:
        """Rotated copy of ``heads [T, any heads, D]`` (eager only): q and k heads in one call."""
        assert not self.fused, "the fused rotation takes q and k apart"
        if heads.stride(1) == heads.shape[2] and cpu_layer_ops.usable(heads, self.cos, self.sin):
            return cpu_layer_ops.rotate(heads, self.cos, self.sin)
        return apply_rotary(heads, self.cos, self.sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate heads ``x [T, heads, head_dim]`` by the tables from ``RotaryEmbedding.forward``."""
    # NOTE: equals HF's ``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)`` bit for bit:
    # a + (-b) * s and a - b * s round identically.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
