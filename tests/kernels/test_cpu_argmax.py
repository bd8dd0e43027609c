"""The native greedy argmax against torch.argmax, ties and NaNs included."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_argmax, cpu_native

pytestmark = pytest.mark.skipif(cpu_native.load() is None, reason="no C compiler: no native ops")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 49152), (32, 49152), (5, 37), (3, 1), (2, 15)])
def test_random_rows_match_torch(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    logits = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert torch.equal(cpu_argmax.argmax_rows(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_nans_infinities_and_signed_zeros_match_torch(dtype: torch.dtype) -> None:
    nan, inf = float("nan"), float("inf")
    cols = 40  # two vectors and a tail: every case lands in each part below
    rows = []
    for at in (3, 17, 31, 38):  # 31: maxima either side of the vector part's end
        tie = torch.zeros(cols)
        tie[at], tie[at + 1] = 2.0, 2.0  # equal maxima: the first wins
        rows.append(tie)
        with_nan = torch.randn(cols)
        with_nan[at], with_nan[cols - 1] = nan, nan  # a NaN beats any number: the first NaN
        rows.append(with_nan)
        top = torch.full((cols,), -inf)
        top[at] = inf
        rows.append(top)
    rows.append(torch.full((cols,), -inf))  # nothing larger than -inf: index 0
    signed = torch.full((cols,), -1.0)
    signed[5], signed[20] = -0.0, 0.0  # equal as numbers: the first
    rows.append(signed)
    logits = torch.stack(rows).to(dtype)
    assert torch.equal(cpu_argmax.argmax_rows(logits), logits.argmax(dim=-1))


def test_strided_rows_and_refusals() -> None:
    wide = torch.randn(6, 100)
    view = wide[::2, 10:90]  # rows 200 elements apart, starting mid-row
    assert cpu_argmax.usable(view)
    assert torch.equal(cpu_argmax.argmax_rows(view), view.argmax(dim=-1))
    assert cpu_argmax.argmax_rows(torch.empty(0, 8)).shape == (0,)
    assert not cpu_argmax.usable(torch.randn(4, 8).half())
    assert not cpu_argmax.usable(torch.randn(8, 4).t())  # columns not contiguous
    assert not cpu_argmax.usable(torch.randn(8))
