"""FP8 (e4m3) KV cache rows: ``head_dim`` FP8 bytes followed by their float32 scale.

An FP8 cache keeps the block-major layout of ``kernels/interface.py`` in ``uint8`` with a
last dim of ``head_dim + 4``: each (slot, kv head) row holds the ``head_dim`` e4m3 codes of
``x / scale`` and then ``scale = amax(|x|) / 448`` as 4 little-endian float32 bytes.

Why scales live in the rows, per token and kv head:

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
SCALE_BYTES = 4  # one float32 per row
STORAGE_DTYPE = torch.uint8
# NOTE: below float32's smallest normal a scale loses bits, and x / scale could overflow.
_MIN_SCALE = torch.finfo(torch.float32).tiny

KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class KVFormat:
    """How one KV cache stores its rows: the tensor's dtype, its last dim, and the name the
    block-hash salt binds (blocks of different formats never mix)."""

    name: str  # e.g. "float32", "bfloat16", "fp8_e4m3/row_f32_scale"
    storage_dtype: torch.dtype
    head_dim: int
    quantized: bool

    @property
    def row_width(self) -> int:
        """Elements of ``storage_dtype`` per (slot, kv head) row: the cache's last dim."""
        return self.head_dim + SCALE_BYTES if self.quantized else self.head_dim

    @property
    def row_bytes(self) -> int:
        return self.row_width * self.storage_dtype.itemsize


FP8_FORMAT_NAME = "fp8_e4m3/row_f32_scale"


def kv_format(kv_cache_dtype: str, model_dtype: torch.dtype, head_dim: int) -> KVFormat:
    """The format ``--kv-cache-dtype`` asks for: ``auto`` stores the model's dtype."""
    if kv_cache_dtype == "auto":
        name = str(model_dtype).removeprefix("torch.")
        return KVFormat(name, model_dtype, head_dim, quantized=False)
    if kv_cache_dtype == "fp8":
        if head_dim % SCALE_BYTES:
            # NOTE: the scale is read as a float32 view of the row's tail: it must be aligned.
            raise ValueError(f"an FP8 KV cache needs head_dim divisible by 4, got {head_dim}")
        return KVFormat(FP8_FORMAT_NAME, STORAGE_DTYPE, head_dim, quantized=True)
    raise ValueError(
        f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
    )


def is_fp8_cache(kv: torch.Tensor) -> bool:
    """True for a cache (or a layer or rows of one) in this module's FP8 row format."""
    return kv.dtype == STORAGE_DTYPE


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., head_dim]`` (any float dtype) -> ``[..., head_dim + 4]`` uint8 rows."""
    head_dim = x.shape[-1]
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
    out = torch.empty((*x.shape[:-1], head_dim + SCALE_BYTES), dtype=STORAGE_DTYPE, device=x.device)
    out[..., :head_dim] = codes.view(STORAGE_DTYPE)
    # A zero row keeps scale 0 (not the clamped one): it dequantizes to exact zeros.
    out[..., head_dim:] = torch.where(amax > 0, safe, 0.0).view(STORAGE_DTYPE)
    return out


def dequantize_rows(
    rows: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``[..., head_dim + 4]`` uint8 rows -> ``[..., head_dim]`` of ``dtype`` (into ``out``
    when given). The product is taken in float32 and rounded once to ``dtype``."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    codes = rows[..., :head_dim].view(FP8_DTYPE)
    scale = rows[..., head_dim:].view(torch.float32)
    values = codes.float().mul_(scale)
    if out is None:
        return values.to(dtype)
    return out.copy_(values)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` as an FP8 cache gives it back: what attention over the cache reads."""
    return dequantize_rows(quantize_rows(x), x.dtype)
