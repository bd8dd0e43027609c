"""The Hadamard rotation of ``kernels/kv_rotation.py`` in Triton: the int8 KV write and
the context gather rotate rows in registers, attention over int8 unrotates its outputs
in registers, and :func:`rotate_heads` rotates its queries in one launch before it.

A fast Walsh-Hadamard transform: ``log2(block)`` butterfly stages, each adding and
subtracting element pairs ``2^s`` apart, give ``x`` times the Sylvester ``+-1`` matrix of
``kv_rotation.hadamard_signs`` (block-diagonal where ``block < COLS``: a stage never pairs
elements of different blocks, and zero padding past ``head_dim`` stays apart the same way).
In float64 the sums of bf16 or float32 rows are exact or far below float32's last bit, so
the write stores the codes ``fp8_kv.quantize_slots`` does, bit for bit.

NOTE: a tensor-core dot with the matrix built in registers instead was measured 1.3-1.7x
slower for decode over int8 on an NVIDIA H200 (128 x 128 float32 entries a program).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_rotation import rotation_block, rotation_scale


@triton.jit
def hadamard_rows(x, ROWS: tl.constexpr, COLS: tl.constexpr, LOG_BLOCK: tl.constexpr):
    """``x`` ``[ROWS, COLS]`` times the unscaled ``+-1`` matrix, in ``x``'s dtype."""
    for stage in tl.static_range(LOG_BLOCK):
        pairs = tl.reshape(x, (ROWS, COLS // (2 << stage), 2, 1 << stage))
        first, second = tl.split(tl.permute(pairs, (0, 1, 3, 2)))
        pairs = tl.permute(tl.join(first + second, first - second), (0, 1, 3, 2))
        x = tl.reshape(pairs, (ROWS, COLS))
    return x


def log_block(head_dim: int) -> int:
    """``log2`` of ``rotation_block(head_dim)``: the kernels' ``LOG_BLOCK``."""
    return rotation_block(head_dim).bit_length() - 1


@triton.jit
def _rotate_heads_kernel(
    x_ptr, out_ptr, stride_tok, stride_head,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, LOG_BLOCK: tl.constexpr, ROTATION_SCALE: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HEAD_DIM)
    x = tl.load(x_ptr + tok * stride_tok + heads * stride_head + dims, mask=mask, other=0.0)
    rotated = hadamard_rows(x.to(tl.float32), HEADS_PAD, HEAD_DIM_PAD, LOG_BLOCK) * ROTATION_SCALE
    out = out_ptr + (tok * NUM_HEADS + heads) * HEAD_DIM + dims
    tl.store(out, rotated.to(out_ptr.dtype.element_ty), mask=mask)


def rotate_heads(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` ``[T, heads, head_dim]`` (any token and head strides, unit last stride) times
    ``H``, in float32, as a new contiguous tensor of ``dtype``: queries for attention over
    int8 rows, in one launch.

    NOTE: rotating the queries inside the attention kernel instead made decode over int8
    1.10-1.16x slower at batch 64 (8k and 32k of context) on an NVIDIA H200, more with more
    tiles: most likely their register layout converted again for every tile's dot.
    """
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if num_tokens:
        _rotate_heads_kernel[(num_tokens,)](
            x, out, x.stride(0), x.stride(1), NUM_HEADS=num_heads, HEAD_DIM=head_dim,
            HEADS_PAD=triton.next_power_of_2(num_heads),
            HEAD_DIM_PAD=triton.next_power_of_2(head_dim), LOG_BLOCK=log_block(head_dim),
            ROTATION_SCALE=rotation_scale(head_dim),
        )  # fmt: skip
    return out
