"""The in-kernel Hadamard transform (``kernels/triton_hadamard.py``, under the interpreter
on the CPU) gives the torch rotation's bits (``kernels/kv_rotation.py``) in float64."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernels.kv_rotation import rotate, rotation_scale
from kernels.triton_hadamard import hadamard_rows, log_block, rotate_heads

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@triton.jit
def _rotate_kernel(
    x_ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr, COLS_PAD: tl.constexpr,
    LOG_BLOCK: tl.constexpr, SCALE: tl.constexpr,
):  # fmt: skip
    rows = tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, COLS_PAD)[None, :]
    mask = cols < COLS
    x = tl.load(x_ptr + rows * COLS + cols, mask=mask, other=0.0).to(tl.float64)
    y = hadamard_rows(x, ROWS, COLS_PAD, LOG_BLOCK) * SCALE
    tl.store(out_ptr + rows * COLS + cols, y.to(tl.float32), mask=mask)


@pytest.mark.parametrize("head_dim", [8, 20, 64, 96, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_rotation_is_bit_identical_to_torch(head_dim: int, dtype: torch.dtype) -> None:
    """Padded widths (20 in 32, 96 in 128) keep their blocks apart from the padding."""
    generator = torch.Generator().manual_seed(head_dim)
    x = torch.randn(16, head_dim, generator=generator)
    x *= torch.pow(10.0, torch.randint(-4, 5, (16, 1), generator=generator))
    x = x.to(dtype).to(DEVICE)
    out = torch.empty(x.shape, dtype=torch.float32, device=DEVICE)
    _rotate_kernel[(1,)](
        x, out, 16, head_dim, triton.next_power_of_2(head_dim), log_block(head_dim),
        rotation_scale(head_dim),
    )  # fmt: skip
    assert torch.equal(out, rotate(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotate_heads_rotates_every_token_and_head_of_a_strided_view(dtype: torch.dtype) -> None:
    """Queries arrive as a view of the packed qkv projection: token and head strides."""
    generator = torch.Generator().manual_seed(5)
    packed = torch.randn(7, 10, 24, generator=generator).to(DEVICE)
    queries = packed[:, 1:7]  # 6 heads of 24 (blocks of 8), token stride 240
    got = rotate_heads(queries, dtype)
    assert got.dtype == dtype and got.is_contiguous()
    expected = rotate(queries).to(dtype)
    torch.testing.assert_close(got, expected)  # float32 butterflies: within a few ulps
