"""Writes the new tokens' K/V into their slots of the paged cache, as one Triton launch.

One program per token copies its ``[num_kv_heads, head_dim]`` key and value rows to slot
``slot_mapping[t]`` (block ``slot // block_size``, offset ``slot % block_size``) of a
layer view ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``, through strides, so
the non-contiguous per-layer view of the block-major cache is written in place.
A negative slot marks a padding token (e.g. CUDA-graph padding) and is skipped.

Into an 8-bit cache (``kernels/fp8_kv.py``: per slot, every kv head's ``head_dim`` codes,
then every head's float32 scale; e4m3 codes in ``uint8``, int8 codes in ``int8``) each
(token, kv head) row is quantized in registers with the same rules as ``quantize_slots``,
and the result is bit-identical to it:

- ``scale = amax / 448`` (int8: ``/ 127``) and ``x / scale`` are IEEE divisions
  (``tl.div_rn``; Triton's ``/`` is an approximate division on the GPU), the scale
  clamped to float32's smallest normal before dividing, and stored as 0 for an all-zero
  row;
- the float32 -> e4m3 rounding (to nearest, ties to even, after clamping to +-448) is
  done on the float32 bits with integer arithmetic, not by a cast: the triton 3.6
  interpreter's float -> fp8 cast rounds wrongly (it drops the mantissa carry), and the
  integer version gives the same bytes on the GPU and in the interpreter;
- the float32 -> int8 rounding (half to even, as ``torch.round``, after clamping to
  +-127) truncates toward zero and corrects by the exact remainder: libdevice's ``rint``
  is an extern call the interpreter cannot run, and the ``(y + 1.5 * 2**23) - 1.5 * 2**23``
  trick leans on the compiler never reassociating the two additions; truncation, the
  remainder ``y - trunc(y)`` and the comparisons are exact in any order on both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_kv import _MIN_SCALE as _TORCH_MIN_SCALE
from kernels.fp8_kv import FP8_MAX, INT8_MAX, SCALE_BYTES, is_int8_cache, is_quantized_cache
from kernels.kv_rotation import rotation_scale
from kernels.triton_hadamard import hadamard_rows, log_block

# NOTE: fp8_kv's constants, as constexprs so the kernels may read them.
_FP8_MAX = tl.constexpr(FP8_MAX)
_INT8_MAX = tl.constexpr(INT8_MAX)
_MIN_SCALE = tl.constexpr(float(_TORCH_MIN_SCALE))


@triton.jit
def _e4m3_codes(v):
    """float32 ``v`` (already within +-448) -> its e4m3fn bytes (int32 0..255), rounded to
    nearest, ties to even, exactly as ``torch.Tensor.to(torch.float8_e4m3fn)``."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    mag = bits & 0x7FFFFFFF
    # Normal e4m3 (|v| >= 2**-6): keep 3 of the 23 mantissa bits, rounding on the whole
    # bit pattern so a carry moves into the exponent; then rebias 127 -> 7 (120 << 3).
    kept = (mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20
    normal = kept - (120 << 3)
    # Subnormal e4m3 (multiples of 2**-9 below 2**-6): round mantissa * 2**(exp - 23 + 9)
    # to an integer. shift >= 21 there; past 25 every mantissa rounds to 0 anyway.
    exponent = mag >> 23
    mantissa = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(127 + 14 - exponent, 1), 25)
    quotient = mantissa >> shift
    rest = mantissa & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    sub = quotient + ((rest > half) | ((rest == half) & ((quotient & 1) == 1))).to(tl.int32)
    code = tl.where(mag >= 0x3C800000, normal, sub)  # 0x3C800000: 2**-6 in float32
    return code | (sign << 7)


@triton.jit
def _int8_codes(y):
    """float32 ``y`` -> int8 codes: rounded half to even (``torch.round``), within +-127."""
    y = tl.minimum(tl.maximum(y, -_INT8_MAX), _INT8_MAX)
    # NOTE: clamped to integers first, so rounding cannot leave [-127, 127] (never -128).
    whole = y.to(tl.int32)  # toward zero, exact for |y| <= 127
    rest = tl.abs(y - whole.to(tl.float32))  # exact: y's fraction needs no more bits than y
    away = (rest > 0.5) | ((rest == 0.5) & ((whole & 1) == 1))
    step = tl.where(y < 0, -1, 1)
    return (whole + tl.where(away, step, 0)).to(tl.int8)


@triton.jit
def widen_codes(codes, dtype: tl.constexpr, INT8: tl.constexpr):
    """Loaded codes of an 8-bit cache (``int8``, or ``uint8`` e4m3 bytes) as ``dtype``,
    exactly (fp16 holds every e4m3 value and every integer up to 2048); ``dequantize_slots``
    multiplies them by the row's scale."""
    # NOTE: constexpr ternaries, not early returns: compiled, the code after a return
    # inside a constexpr branch is still generated (and must type-check).
    return (
        (_int8_as_half(codes) if dtype == tl.float16 else codes.to(dtype))
        if INT8
        else codes.to(tl.float8e4nv, bitcast=True).to(dtype)
    )


@triton.jit
def _int8_as_half(codes):
    """int8 ``codes`` as fp16, exactly, by bits: ``0x6400 | (c + 128)`` is the fp16
    ``1024 + c + 128``, so subtracting 1152 leaves ``c``.

    NOTE: integer ops and one fp16 subtraction, where ``codes.to(tl.float16)`` compiles
    to two conversions an element (``cvt.s16.s8``, ``cvt.rn.f16.s16``); e4m3 widens a pair
    in one instruction.
    """
    biased = (codes.to(tl.uint8, bitcast=True).to(tl.uint16) ^ 0x80) | 0x6400
    return biased.to(tl.uint16).to(tl.float16, bitcast=True) - 1152.0


@triton.jit
def fp8_scale_index(slot_off, head, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Index into ``fp8_scale_view`` of ``head``'s scale in the FP8 slot at byte offset
    ``slot_off``: past the slot's ``NUM_KV_HEADS * HEAD_DIM`` codes, one float32 per head."""
    return (slot_off + NUM_KV_HEADS * HEAD_DIM) // 4 + head


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    kv_ptr,
    scale_ptr,
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
    QUANT: tl.constexpr,
    INT8: tl.constexpr,
    LOG_BLOCK: tl.constexpr,
    ROTATION_SCALE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    slot_off = (slot // BLOCK_SIZE) * stride_kv_block + (slot % BLOCK_SIZE) * stride_kv_slot
    # NOTE: an 8-bit slot holds its heads' codes first, head after head (fp8_kv.py).
    head_off = offs_h * HEAD_DIM if QUANT else offs_h * stride_kv_head
    dst = kv_ptr + slot_off + head_off[:, None] + offs_d[None, :]
    # NOTE: padding lanes read 0: an 8-bit row's amax must see only its own elements.
    k = tl.load(
        key_ptr + tok * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :],
        mask=mask,
        other=0.0,
    )
    v = tl.load(
        value_ptr + tok * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :],
        mask=mask,
        other=0.0,
    )
    if INT8:  # NOTE: int8 codes are of the rows times H (kernels/kv_rotation.py)
        k = hadamard_rows(k.to(tl.float64), HEADS_PAD, HEAD_DIM_PAD, LOG_BLOCK) * ROTATION_SCALE
        v = hadamard_rows(v.to(tl.float64), HEADS_PAD, HEAD_DIM_PAD, LOG_BLOCK) * ROTATION_SCALE
    if QUANT:
        head_valid = offs_h < NUM_KV_HEADS
        k_scale = scale_ptr + fp8_scale_index(slot_off, offs_h, NUM_KV_HEADS, HEAD_DIM)
        v_scale = scale_ptr + fp8_scale_index(
            slot_off + stride_kv_kind, offs_h, NUM_KV_HEADS, HEAD_DIM
        )
        _store_quantized_rows(k.to(tl.float32), dst, k_scale, mask, head_valid, INT8)
        _store_quantized_rows(
            v.to(tl.float32), dst + stride_kv_kind, v_scale, mask, head_valid, INT8
        )
    else:
        tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + stride_kv_kind, v.to(kv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_quantized_rows(x, code_ptrs, scale_ptrs, mask, head_valid, INT8: tl.constexpr):
    """Quantize ``x`` ``[heads, head_dim]`` row by row (``fp8_kv.quantize_slots``) and store."""
    amax = tl.max(tl.abs(x), 1)
    safe = quantized_safe_scale(amax, INT8)
    tl.store(code_ptrs, quantized_codes(x, safe[:, None], INT8), mask=mask)
    tl.store(scale_ptrs, tl.where(amax > 0, safe, 0.0), mask=head_valid)


@triton.jit
def quantized_safe_scale(amax, INT8: tl.constexpr):
    """``amax / 448`` (int8: ``/ 127``; IEEE division), at least float32's smallest normal."""
    return tl.maximum(tl.div_rn(amax, _INT8_MAX if INT8 else _FP8_MAX), _MIN_SCALE)


@triton.jit
def quantized_codes(x, safe, INT8: tl.constexpr):
    """The codes of ``x / safe``: ``int8`` ones, or e4m3 bytes (``uint8``) clamped to
    +-448 first."""
    scaled = tl.div_rn(x, safe)
    # NOTE: one return: compiled, both branches' returns must have one type otherwise.
    if INT8:
        codes = _int8_codes(scaled)
    else:
        codes = _e4m3_codes(tl.minimum(tl.maximum(scaled, -_FP8_MAX), _FP8_MAX)).to(tl.uint8)
    return codes


def write_kv_triton(
    key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``key``/``value`` (``[T, num_kv_heads, head_dim]``) at ``slot_mapping`` (``[T]``).

    Same contract as ``kernels.interface.write_kv``, plus: negative slots are skipped.
    Values are cast to the cache dtype, or quantized into an 8-bit cache (``uint8`` e4m3 or
    ``int8`` codes, last dim ``head_dim + 4``: ``kernels/fp8_kv.py``). Slots must be
    distinct (no ordering between tokens).
    """
    quantized = is_quantized_cache(kv_layer)
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ in shape")
    num_tokens, num_kv_heads, head_dim = key.shape
    row_width = head_dim + SCALE_BYTES if quantized else head_dim
    if kv_layer.dim() != 5 or tuple(kv_layer.shape[3:]) != (num_kv_heads, row_width):
        raise ValueError(
            f"kv_layer {tuple(kv_layer.shape)} does not hold [*, 2, block_size, {num_kv_heads}, {row_width}] rows"
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
        key, value, kv_layer, fp8_scale_view(kv_layer) if quantized else kv_layer, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_layer.shape[2], QUANT=quantized, INT8=is_int8_cache(kv_layer),
        LOG_BLOCK=log_block(head_dim), ROTATION_SCALE=rotation_scale(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )  # fmt: skip


def fp8_scale_view(kv_layer: torch.Tensor) -> torch.Tensor:
    """The 8-bit layer's (or cache's) bytes as float32, the kernels' handle on the scales,
    indexed by :func:`fp8_scale_index`."""
    if kv_layer.stride(-2) != kv_layer.shape[-1] or kv_layer.stride(-1) != 1:
        raise ValueError("an 8-bit KV layer needs each slot's bytes contiguous")
    offset = kv_layer.storage_offset()
    if offset % 4 or any(stride % 4 for stride in kv_layer.stride()[:-1]):
        raise ValueError("an 8-bit KV layer needs 4-byte aligned slots (head_dim divisible by 4)")
    span = 1 + sum(
        (size - 1) * stride for size, stride in zip(kv_layer.shape, kv_layer.stride(), strict=True)
    )
    return kv_layer.as_strided((span,), (1,), offset).view(torch.float32)


@triton.jit
def _gather_fp8_kernel(
    kv_ptr,
    scale_ptr,
    table_ptr,
    key_ptr,
    value_ptr,
    stride_kv_block,
    stride_kv_kind,
    stride_kv_slot,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    INT8: tl.constexpr,
    LOG_BLOCK: tl.constexpr,
    ROTATION_SCALE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    block = tl.load(table_ptr + tok // BLOCK_SIZE).to(tl.int64)
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    head_valid = offs_h < NUM_KV_HEADS
    mask = head_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
    slot_off = block * stride_kv_block + (tok % BLOCK_SIZE) * stride_kv_slot
    # NOTE: a slot's codes are [NUM_KV_HEADS, HEAD_DIM] dense, like the output's token rows.
    dense = offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    out = tok * NUM_KV_HEADS * HEAD_DIM + dense
    for kind in tl.static_range(2):
        base = slot_off + kind * stride_kv_kind
        codes = tl.load(kv_ptr + base + dense, mask=mask, other=0)
        scale = tl.load(
            scale_ptr + fp8_scale_index(base, offs_h, NUM_KV_HEADS, HEAD_DIM), mask=head_valid
        )
        values = widen_codes(codes, tl.float32, INT8) * scale[:, None]
        if INT8:  # the rows back from H's basis (H is its own inverse), as dequantize_slots
            values = hadamard_rows(values.to(tl.float64), HEADS_PAD, HEAD_DIM_PAD, LOG_BLOCK)
            values = (values * ROTATION_SCALE).to(tl.float32)
        dst = key_ptr if kind == 0 else value_ptr
        tl.store(dst + out, values.to(dst.dtype.element_ty), mask=mask)


def gather_fp8_context(
    kv_layer: torch.Tensor, block_table: torch.Tensor, num_tokens: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a sequence's first ``num_tokens`` tokens from an 8-bit layer of either
    kind, dequantized (``dequantize_slots``' values) into two new contiguous ``[num_tokens,
    kv_heads, head_dim]`` tensors of ``dtype``: the working copy fused attention reads, as
    ``triton_backend`` gathers a plain cache's context."""
    _, _, block_size, num_kv_heads, row_width = kv_layer.shape
    head_dim = row_width - SCALE_BYTES
    shape = (num_tokens, num_kv_heads, head_dim)
    key = torch.empty(shape, dtype=dtype, device=kv_layer.device)
    value = torch.empty(shape, dtype=dtype, device=kv_layer.device)
    if num_tokens == 0:
        return key, value
    _gather_fp8_kernel[(num_tokens,)](
        kv_layer, fp8_scale_view(kv_layer), block_table, key, value,
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        INT8=is_int8_cache(kv_layer), LOG_BLOCK=log_block(head_dim),
        ROTATION_SCALE=rotation_scale(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )  # fmt: skip
    return key, value
