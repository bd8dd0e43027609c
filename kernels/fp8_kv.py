"""FP8 (e4m3) KV cache slots: every kv head's e4m3 codes, then every head's float32 scale.

Layout
------
An FP8 cache keeps the block-major layout and shape of ``kernels/interface.py`` in
``uint8`` with a last dim of ``head_dim + 4``, but the last two dims are reinterpreted:
the ``num_kv_heads * (head_dim + 4)`` bytes of one (block, K/V, slot) are one record,

- ``[0, num_kv_heads * head_dim)``: the codes, head ``h``'s ``head_dim`` e4m3 codes of
  ``x / scale`` at byte ``h * head_dim``;
- ``[num_kv_heads * head_dim, +4 * num_kv_heads)``: the scales, head ``h``'s
  ``scale = amax(|x|) / 448`` as little-endian float32 at byte
  ``num_kv_heads * head_dim + 4 * h``.

So ``cache[..., h, :]`` is *not* head ``h``'s row (except with one kv head): only
:func:`quantize_slots`, :func:`dequantize_slots` and the Triton kernels read the bytes.
The shape stays ``[..., num_kv_heads, head_dim + 4]`` rather than ending in one
``num_kv_heads * (head_dim + 4)`` dim so that everything that moves slots and blocks
without reading them (the engine's cache spec, tiers, block copies, slot scatters, shape
checks, the ``shape[3]`` that is the kv head count everywhere) is untouched.

Why codes first: a head's codes start ``slot * num_kv_heads * (head_dim + 4) +
h * head_dim`` bytes into a block's K (or V) half, a multiple of 16 when ``head_dim`` is
and ``num_kv_heads`` is a multiple of 4 (Llama 3's 8 kv heads: 1,056-byte slots), so
attention can load them as 16-byte vectors (``kernels/triton_attention.py``); with each
scale right after its codes (the previous layout), head ``h`` started at
``h * (head_dim + 4)``, only 4-byte aligned. With 1 or 2 kv heads the slots, and so the
codes, are only 4- or 8-byte aligned: the bytes per slot are kept, not padded.

Why scales live in the slots, per token and kv head:

- a block stays one contiguous byte range, so tiers, disk and CPU records and block copies
  move it unchanged and a restored block is bit-exact (the scales travel with the codes);
- decode appends one token at a time: its row is quantized on its own, and no block is
  ever re-quantized when a later token raises its amax (a per-block scale would have to
  either re-quantize or clip);
- it is at least as accurate as a scale per block and kv head: each row's scale is at
  most the block's, so every element's error bound (below) is at most the block scheme's.
  Measured on Gaussian blocks of 16 tokens x 128 dims (``tests/kernels/test_fp8_kv.py``):
  relative RMS error 0.0257 by row vs 0.0265 by block; when a block's tokens span five
  decades, its smallest tokens 0.026 vs 0.065 (the block scale pushes them to subnormals);
- it costs 4 bytes per row: per token ``(head_dim + 4) / (2 * head_dim)`` of bf16's bytes,
  0.52 at head_dim 128 (1.94x the tokens in the same memory). A scale per 16-token block
  would cost 0.25 bytes per row instead: 2.9% more tokens, bought with the points above.

Accuracy (e4m3: 3 mantissa bits, largest finite 448, smallest subnormal 2^-9): an element
``x`` of a row with scale ``s`` comes back within ``2^-4 * |x| + 2^-10 * s``, so within
``2^-4 * amax`` of the row. A zero row stores scale 0 and dequantizes to exact zeros; the
scale never drops below float32's smallest normal, so tiny rows give no inf or NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
SCALE_BYTES = 4  # one float32 per (slot, kv head)
STORAGE_DTYPE = torch.uint8
# NOTE: below float32's smallest normal a scale loses bits, and x / scale could overflow.
_MIN_SCALE = torch.finfo(torch.float32).tiny

KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class KVFormat:
    """How one KV cache stores its rows: the tensor's dtype, its last dim, and the name the
    block-hash salt binds (blocks of different formats never mix)."""

    name: str  # e.g. "float32", "bfloat16", FP8_FORMAT_NAME
    storage_dtype: torch.dtype
    head_dim: int
    quantized: bool

    @property
    def row_width(self) -> int:
        """Elements of ``storage_dtype`` per (slot, kv head): the cache's last dim (FP8: the
        bytes per head of a slot's record, codes and scale)."""
        return self.head_dim + SCALE_BYTES if self.quantized else self.head_dim

    @property
    def row_bytes(self) -> int:
        return self.row_width * self.storage_dtype.itemsize


# NOTE: the salt binds this name: blocks stored under the old per-row layout
# ("fp8_e4m3/row_f32_scale") are never read as this one.
FP8_FORMAT_NAME = "fp8_e4m3/slot_f32_scales"


def kv_format(kv_cache_dtype: str, model_dtype: torch.dtype, head_dim: int) -> KVFormat:
    """The format ``--kv-cache-dtype`` asks for: ``auto`` stores the model's dtype."""
    if kv_cache_dtype == "auto":
        name = str(model_dtype).removeprefix("torch.")
        return KVFormat(name, model_dtype, head_dim, quantized=False)
    if kv_cache_dtype == "fp8":
        if head_dim % SCALE_BYTES:
            # NOTE: scales are read through a float32 view of the cache: they must be aligned.
            raise ValueError(f"an FP8 KV cache needs head_dim divisible by 4, got {head_dim}")
        return KVFormat(FP8_FORMAT_NAME, STORAGE_DTYPE, head_dim, quantized=True)
    raise ValueError(
        f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
    )


def is_fp8_cache(kv: torch.Tensor) -> bool:
    """True for a cache (or a layer or slots of one) in this module's FP8 format."""
    return kv.dtype == STORAGE_DTYPE


def quantize_slots(x: torch.Tensor) -> torch.Tensor:
    """``[..., num_kv_heads, head_dim]`` (any float dtype) -> ``[..., num_kv_heads,
    head_dim + 4]`` uint8 slots in this module's layout, each (slot, kv head) row under
    its own scale."""
    *lead, heads, head_dim = x.shape
    if head_dim % SCALE_BYTES:
        raise ValueError(f"head_dim must be divisible by 4, got {head_dim}")
    values = x.float()
    amax = values.abs().amax(dim=-1, keepdim=True)
    # NOTE: divided by a tensor, not the Python number: on CUDA torch divides by a host
    # scalar as a product with its reciprocal, one rounding away from IEEE division, and
    # the bytes would depend on the device (the Triton KV write divides exactly).
    scale = amax / torch.full_like(amax, FP8_MAX)
    safe = scale.clamp(min=_MIN_SCALE)
    # NOTE: clamp before the cast: x / scale may round just past 448, and casts of
    # out-of-range values to e4m3fn are NaN on some devices.
    codes = (values / safe).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    code_bytes = heads * head_dim
    out = torch.empty(
        (*lead, code_bytes + heads * SCALE_BYTES), dtype=STORAGE_DTYPE, device=x.device
    )
    out[..., :code_bytes] = codes.view(STORAGE_DTYPE).flatten(-2)
    # A zero row keeps scale 0 (not the clamped one): it dequantizes to exact zeros.
    out[..., code_bytes:] = torch.where(amax > 0, safe, 0.0).view(STORAGE_DTYPE).flatten(-2)
    return out.view(*lead, heads, head_dim + SCALE_BYTES)


def dequantize_slots(
    slots: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``[..., num_kv_heads, head_dim + 4]`` uint8 slots -> ``[..., num_kv_heads, head_dim]``
    of ``dtype`` (into ``out`` when given). The product is taken in float32 and rounded
    once to ``dtype``."""
    heads, width = slots.shape[-2:]
    code_bytes = heads * (width - SCALE_BYTES)
    record = slots.flatten(-2)  # a view over a cache: a slot's bytes are contiguous
    codes = record[..., :code_bytes].view(FP8_DTYPE).unflatten(-1, (heads, -1))
    scale = record[..., code_bytes:].view(torch.float32)
    values = codes.float().mul_(scale[..., None])
    if out is None:
        return values.to(dtype)
    return out.copy_(values)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` (``[..., num_kv_heads, head_dim]``) as an FP8 cache gives it back: what
    attention over the cache reads."""
    return dequantize_slots(quantize_slots(x), x.dtype)
