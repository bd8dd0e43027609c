"""8-bit KV cache slots: every kv head's codes (e4m3 or int8), then every head's float32 scale.

Two formats share one slot layout and differ only in what a code means:

- ``--kv-cache-dtype fp8``: e4m3 codes, ``scale = amax(|x|) / 448``, stored as ``uint8``;
- ``--kv-cache-dtype int8``: symmetric int8 codes of the row rotated by a Hadamard
  matrix ``H`` (``kernels/kv_rotation.py``, which says why), ``y = x @ H``, ``scale =
  amax(|y|) / 127``, ``code = round_half_even(y / scale)`` clamped to [-127, 127] (never
  -128: the code set is symmetric), stored as ``torch.int8``. Dequantizing multiplies by
  ``H`` again (its own inverse); readers of the codes in place rotate the query and
  unrotate the output instead (:func:`stores_rotated_rows`).

The cache tensor's storage dtype names its format (:func:`is_fp8_cache`,
:func:`is_int8_cache`; :func:`is_quantized_cache` for either), so readers and kernels tell
them apart from the tensor alone, and the block-hash salt binds each format's own name
(:data:`FP8_FORMAT_NAME`, :data:`INT8_FORMAT_NAME`): blocks of the two never mix.

Layout
------
An 8-bit cache keeps the block-major layout and shape of ``kernels/interface.py`` in its
one-byte storage dtype with a last dim of ``head_dim + 4``, but the last two dims are
reinterpreted: the ``num_kv_heads * (head_dim + 4)`` bytes of one (block, K/V, slot) are
one record,

- ``[0, num_kv_heads * head_dim)``: the codes, head ``h``'s ``head_dim`` codes of
  ``x / scale`` at byte ``h * head_dim``;
- ``[num_kv_heads * head_dim, +4 * num_kv_heads)``: the scales, head ``h``'s
  ``scale`` as little-endian float32 at byte ``num_kv_heads * head_dim + 4 * h``.

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
  Measured on Gaussian blocks of 16 tokens x 128 dims (``tests/kernels/test_fp8_kv.py``,
  e4m3): relative RMS error 0.0257 by row vs 0.0265 by block; when a block's tokens span
  five decades, its smallest tokens 0.026 vs 0.065 (the block scale pushes them to
  subnormals);
- it costs 4 bytes per row: per token ``(head_dim + 4) / (2 * head_dim)`` of bf16's bytes,
  0.52 at head_dim 128 (1.94x the tokens in the same memory). A scale per 16-token block
  would cost 0.25 bytes per row instead: 2.9% more tokens, bought with the points above.

Accuracy. e4m3 (3 mantissa bits, largest finite 448, smallest subnormal 2^-9): an element
``x`` of a row with scale ``s`` comes back within ``2^-4 * |x| + 2^-10 * s``, so within
``2^-4 * amax`` of the row. int8: within ``s / 2 = amax / 254`` of the rotated element, one
uniform step over the row (about 7 bits for the row's large elements, where e4m3 keeps 3;
fewer for its small ones, where e4m3's relative error stays 2^-4). The rotation makes the
row dense, so int8 wins: on Gaussian rows of 128 its relative RMS error is a quarter of
e4m3's (0.0065 against 0.0257, ``tests/kernels/test_fp8_kv.py``), and on keys with a few
large channels more (``kernels/kv_rotation.py`` gives SmolLM2's figures; BENCHMARKS.md
the engine's). A zero row stores scale 0 and dequantizes to exact zeros; the scale never
drops below float32's smallest normal, so tiny rows give no inf or NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.kv_rotation import rotate

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
INT8_MAX = 127.0  # NOTE: not 128: -128 would make the code set asymmetric
SCALE_BYTES = 4  # one float32 per (slot, kv head)
FP8_STORAGE_DTYPE = torch.uint8  # e4m3 codes, viewed as FP8_DTYPE to read them
INT8_STORAGE_DTYPE = torch.int8  # int8 codes: the elements themselves
# NOTE: below float32's smallest normal a scale loses bits, and x / scale could overflow.
_MIN_SCALE = torch.finfo(torch.float32).tiny

KV_CACHE_DTYPES = ("auto", "fp8", "int8")


@dataclass(frozen=True)
class KVFormat:
    """How one KV cache stores its rows: the tensor's dtype, its last dim, and the name the
    block-hash salt binds (blocks of different formats never mix)."""

    name: str  # e.g. "float32", "bfloat16", FP8_FORMAT_NAME, INT8_FORMAT_NAME
    storage_dtype: torch.dtype
    head_dim: int
    quantized: bool  # 8-bit codes and scales (either kind): this module's slot layout

    @property
    def row_width(self) -> int:
        """Elements of ``storage_dtype`` per (slot, kv head): the cache's last dim (8-bit
        formats: the bytes per head of a slot's record, codes and scale)."""
        return self.head_dim + SCALE_BYTES if self.quantized else self.head_dim

    @property
    def row_bytes(self) -> int:
        return self.row_width * self.storage_dtype.itemsize


# NOTE: the salt binds these names: blocks stored under an older layout
# ("fp8_e4m3/row_f32_scale", unrotated "int8/slot_f32_scales") or under the other 8-bit
# format are never read as this one.
FP8_FORMAT_NAME = "fp8_e4m3/slot_f32_scales"
INT8_FORMAT_NAME = "int8/hadamard/slot_f32_scales"
_QUANTIZED_FORMATS = {
    "fp8": (FP8_FORMAT_NAME, FP8_STORAGE_DTYPE),
    "int8": (INT8_FORMAT_NAME, INT8_STORAGE_DTYPE),
}


def kv_format(kv_cache_dtype: str, model_dtype: torch.dtype, head_dim: int) -> KVFormat:
    """The format ``--kv-cache-dtype`` asks for: ``auto`` stores the model's dtype."""
    if kv_cache_dtype == "auto":
        name = str(model_dtype).removeprefix("torch.")
        return KVFormat(name, model_dtype, head_dim, quantized=False)
    if kv_cache_dtype in _QUANTIZED_FORMATS:
        if head_dim % SCALE_BYTES:
            # NOTE: scales are read through a float32 view of the cache: they must be aligned.
            raise ValueError(
                f"an {kv_cache_dtype.upper()} KV cache needs head_dim divisible by 4, "
                f"got {head_dim}"
            )
        name, storage = _QUANTIZED_FORMATS[kv_cache_dtype]
        return KVFormat(name, storage, head_dim, quantized=True)
    raise ValueError(
        f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
    )


def is_fp8_cache(kv: torch.Tensor) -> bool:
    """True for a cache (or a layer or slots of one) of e4m3 codes in this module's layout."""
    return kv.dtype == FP8_STORAGE_DTYPE


def is_int8_cache(kv: torch.Tensor) -> bool:
    """True for a cache (or a layer or slots of one) of int8 codes in this module's layout."""
    return kv.dtype == INT8_STORAGE_DTYPE


def is_quantized_cache(kv: torch.Tensor) -> bool:
    """True for an 8-bit cache of either kind: codes and per-row scales in slots."""
    return kv.dtype in (FP8_STORAGE_DTYPE, INT8_STORAGE_DTYPE)


def stores_rotated_rows(kv: torch.Tensor) -> bool:
    """True where the codes are of ``x @ H`` (int8): attention reading them in place takes
    ``q @ H`` and unrotates its output (``kernels/kv_rotation.py``)."""
    return is_int8_cache(kv)


def _code_max(storage: torch.dtype) -> float:
    if storage == FP8_STORAGE_DTYPE:
        return FP8_MAX
    if storage == INT8_STORAGE_DTYPE:
        return INT8_MAX
    raise ValueError(f"no 8-bit KV format is stored as {storage}")


def quantize_slots(x: torch.Tensor, storage: torch.dtype = FP8_STORAGE_DTYPE) -> torch.Tensor:
    """``[..., num_kv_heads, head_dim]`` (any float dtype) -> ``[..., num_kv_heads,
    head_dim + 4]`` slots in this module's layout, each (slot, kv head) row under its own
    scale: e4m3 codes for ``storage`` ``uint8``, int8 codes for ``torch.int8`` (pass the
    cache's dtype to write into it)."""
    *lead, heads, head_dim = x.shape
    if head_dim % SCALE_BYTES:
        raise ValueError(f"head_dim must be divisible by 4, got {head_dim}")
    code_max = _code_max(storage)
    values = rotate(x) if storage == INT8_STORAGE_DTYPE else x.float()
    amax = values.abs().amax(dim=-1, keepdim=True)
    # NOTE: divided by a tensor, not the Python number: on CUDA torch divides by a host
    # scalar as a product with its reciprocal, one rounding away from IEEE division, and
    # the bytes would depend on the device (the Triton KV write divides exactly).
    scale = amax / torch.full_like(amax, code_max)
    safe = scale.clamp(min=_MIN_SCALE)
    scaled = values / safe
    if storage == INT8_STORAGE_DTYPE:
        # NOTE: torch.round rounds half to even; x / scale may round just past 127.
        codes = scaled.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    else:
        # NOTE: clamp before the cast: x / scale may round just past 448, and casts of
        # out-of-range values to e4m3fn are NaN on some devices.
        codes = scaled.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(storage)
    code_bytes = heads * head_dim
    out = torch.empty((*lead, code_bytes + heads * SCALE_BYTES), dtype=storage, device=x.device)
    out[..., :code_bytes] = codes.flatten(-2)
    # A zero row keeps scale 0 (not the clamped one): it dequantizes to exact zeros.
    out[..., code_bytes:] = torch.where(amax > 0, safe, 0.0).view(storage).flatten(-2)
    return out.view(*lead, heads, head_dim + SCALE_BYTES)


def dequantize_slots(
    slots: torch.Tensor,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    *,
    unrotate: bool = True,
) -> torch.Tensor:
    """``[..., num_kv_heads, head_dim + 4]`` 8-bit slots (either kind, told by their dtype)
    -> ``[..., num_kv_heads, head_dim]`` of ``dtype`` (into ``out`` when given). The
    product is taken in float32 and rounded once to ``dtype``. ``unrotate=False`` leaves
    int8 rows in the basis they are stored in, for attention that rotates its queries
    instead (:func:`stores_rotated_rows`)."""
    _code_max(slots.dtype)  # refuses a tensor of neither kind
    heads, width = slots.shape[-2:]
    code_bytes = heads * (width - SCALE_BYTES)
    record = slots.flatten(-2)  # a view over a cache: a slot's bytes are contiguous
    codes = record[..., :code_bytes]
    if is_fp8_cache(slots):
        codes = codes.view(FP8_DTYPE)
    scale = record[..., code_bytes:].view(torch.float32)
    values = codes.unflatten(-1, (heads, -1)).float().mul_(scale[..., None])
    if unrotate and stores_rotated_rows(slots):
        values = rotate(values)
    if out is None:
        return values.to(dtype)
    return out.copy_(values)


def round_trip(x: torch.Tensor, storage: torch.dtype = FP8_STORAGE_DTYPE) -> torch.Tensor:
    """``x`` (``[..., num_kv_heads, head_dim]``) as an 8-bit cache of ``storage`` (see
    :func:`quantize_slots`) gives it back: what attention over the cache reads."""
    return dequantize_slots(quantize_slots(x, storage), x.dtype)
