"""The Hadamard rotation of int8 KV rows (``kernels/kv_rotation.py``): orthogonal, its own
inverse, the same bits for a row in any batch, and what it buys on keys with a few large
channels."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_kv import round_trip
from kernels.kv_rotation import (
    hadamard_signs,
    rotate,
    rotate_queries,
    rotation_block,
    rotation_scale,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize("head_dim", [4, 20, 64, 96, 128])
def test_the_matrix_is_orthogonal_symmetric_and_mixes_each_block(head_dim: int) -> None:
    matrix = hadamard_signs(head_dim, CPU, torch.float64) * rotation_scale(head_dim)
    torch.testing.assert_close(matrix @ matrix, torch.eye(head_dim, dtype=torch.float64))
    assert torch.equal(matrix, matrix.T)
    block = rotation_block(head_dim)
    assert block == {4: 4, 20: 4, 64: 64, 96: 32, 128: 128}[head_dim]
    assert bool((matrix[:block, :block].abs() > 0).all())  # every channel of a block mixes
    if block < head_dim:
        assert bool((matrix[:block, block:] == 0).all())


def test_rotating_twice_gives_the_rows_back_and_keeps_dot_products() -> None:
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 7, 3, 128, generator=generator)
    torch.testing.assert_close(rotate(rotate(k)), k, rtol=0, atol=1e-5)
    torch.testing.assert_close((rotate(q) * rotate(k)).sum(-1), (q * k).sum(-1))
    assert rotate(q.bfloat16()).dtype == torch.float32
    # Queries and outputs: float32 products, back in their own dtype.
    torch.testing.assert_close(rotate_queries(q), rotate(q))
    assert rotate_queries(q.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_stored_row_has_the_same_bits_in_any_batch(dtype: torch.dtype) -> None:
    """The torch quantizer and the Triton write rotate different batches (a decode's one
    row, a chunk's thousands): a row's codes must not depend on which."""
    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(300, 4, 64, generator=generator).to(dtype)
    rows *= torch.pow(10.0, torch.randint(-3, 4, (300, 4, 1), generator=generator)).to(dtype)
    whole = rotate(rows)
    for start, stop in [(0, 1), (5, 6), (17, 100), (299, 300)]:
        assert torch.equal(rotate(rows[start:stop]), whole[start:stop])
    exact = (rows.double() @ hadamard_signs(64, CPU, torch.float64) / 8).float()  # 1/8: exact
    assert torch.equal(whole, exact)


def test_rotation_cuts_int8_error_on_keys_with_a_few_large_channels() -> None:
    """Keys after RoPE carry most of their size in a few channels. One int8 scale per row
    then rounds the other channels on a coarse grid; rotated, every element is alike.

    Measured (relative RMS error of the small channels, 2,048 rows of 64 with 4 channels
    20x the rest): unrotated 0.071, rotated 0.022."""
    generator = torch.Generator().manual_seed(2)
    keys = torch.randn(2048, 1, 64, generator=generator)
    keys[..., [5, 6, 37, 38]] *= 20.0
    small = torch.ones(64, dtype=torch.bool)
    small[[5, 6, 37, 38]] = False

    def error(back: torch.Tensor) -> float:
        return float((back - keys)[..., small].norm() / keys[..., small].norm())

    scale = keys.abs().amax(dim=-1, keepdim=True) / 127
    unrotated = error((keys / scale).round().clamp(-127, 127) * scale)
    rotated = error(round_trip(keys, torch.int8))
    assert rotated < unrotated / 3, (rotated, unrotated)
