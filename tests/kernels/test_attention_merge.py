"""Merging partial attention by log-sum-exp, and the padded inputs of fused GPU attention.

Without CUDA the merge kernel runs under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import pytest
import torch

from kernels.attention_merge import merge_attention_states
from kernels.triton_backend import attention_bucket, pad_tokens

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def partial_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, H, D]`` over ``[S, H, D]`` in float64: ``(out [H, T, D], lse [H, T])``."""
    scores = torch.einsum("thd,shd->hts", query.double(), key.double()) * scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hts,shd->htd", torch.exp(scores - lse[..., None]), value.double())
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("tokens", "heads", "head_dim"), [(5, 4, 16), (3, 6, 24)])
def test_merging_two_key_sets_gives_attention_over_both(
    dtype: torch.dtype, tokens: int, heads: int, head_dim: int
) -> None:
    generator = torch.Generator().manual_seed(tokens * heads)
    query = torch.randn(tokens, heads, head_dim, generator=generator)
    key = torch.randn(40, heads, head_dim, generator=generator) * 2
    value = torch.randn(40, heads, head_dim, generator=generator)
    scale = head_dim**-0.5
    want, _ = partial_attention(query, key, value, scale)
    parts = [
        partial_attention(query, key[s], value[s], scale) for s in (slice(0, 29), slice(29, 40))
    ]
    (out_a, lse_a), (out_b, lse_b) = (
        (o.to(dtype).to(DEVICE), lse.float().to(DEVICE)) for o, lse in parts
    )
    # the output rows are a strided slice of a wider batch, as in the backend
    batch = torch.full((tokens + 4, heads, head_dim), 7.0, dtype=dtype, device=DEVICE)
    merge_attention_states(out_a, lse_a, out_b, lse_b, batch[2 : 2 + tokens])
    got = batch[2 : 2 + tokens].transpose(0, 1).double().cpu()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    assert torch.all(batch[:2] == 7.0) and torch.all(batch[2 + tokens :] == 7.0), (
        "wrote outside out"
    )


def test_merge_reads_strided_halves_and_extreme_weights() -> None:
    """Inputs laid out ``[T, H, D]`` (as cuDNN returns them) and one half that dominates."""
    tokens, heads, head_dim = 4, 3, 8
    generator = torch.Generator().manual_seed(1)
    rows_a = torch.randn(tokens, heads, head_dim, generator=generator).to(DEVICE)
    rows_b = torch.randn(tokens, heads, head_dim, generator=generator).to(DEVICE)
    lse_a = torch.tensor([[0.0, 80.0, -80.0, 1.0]] * heads, device=DEVICE)
    lse_b = torch.zeros(heads, tokens, device=DEVICE)
    out = torch.empty(tokens, heads, head_dim, device=DEVICE)
    merge_attention_states(rows_a.transpose(0, 1), lse_a, rows_b.transpose(0, 1), lse_b, out)
    weight_a = torch.sigmoid(lse_a - lse_b).transpose(0, 1)[..., None]
    torch.testing.assert_close(out, rows_a * weight_a + rows_b * (1 - weight_a))
    torch.testing.assert_close(out[1], rows_a[1])
    torch.testing.assert_close(out[2], rows_b[2])


def test_merge_rejects_mismatched_shapes() -> None:
    out = torch.empty(3, 2, 8, device=DEVICE)
    halves = torch.zeros(2, 3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="log-sum-exps"):
        merge_attention_states(halves, torch.zeros(3, 2), halves, torch.zeros(2, 3), out)
    with pytest.raises(ValueError, match="shapes differ"):
        merge_attention_states(halves, torch.zeros(2, 3), halves, torch.zeros(2, 3), out[:2])


def test_attention_buckets_are_few_and_tight() -> None:
    lengths = range(512, 16385)
    buckets = {attention_bucket(n) for n in lengths}
    assert len(buckets) <= 40
    assert all(attention_bucket(n) >= n for n in lengths)
    # under an eighth longer from 1k tokens up, under a quarter below
    assert all(attention_bucket(n) < n * 1.125 for n in range(1024, 16385))
    assert all(attention_bucket(n) < n * 1.25 for n in range(512, 1024))
    assert [attention_bucket(n) for n in (512, 8192, 8193, 16384)] == [512, 8192, 9216, 16384]


def test_padding_copies_only_what_is_not_already_a_contiguous_bucket() -> None:
    qkv = torch.randn(6, 16 * 8)
    key_view = qkv[:, 64:96].view(6, 4, 8)  # a strided view of the projection's output
    rotated = torch.randn(6, 4, 8)  # the fused rotary's contiguous output

    assert pad_tokens(rotated, 6) is rotated
    for source, length in ((key_view, 6), (rotated, 9)):
        padded = pad_tokens(source, length)
        assert padded.shape == (length, 4, 8) and padded.is_contiguous()
        assert padded.data_ptr() != source.data_ptr()
        torch.testing.assert_close(padded[:6], source, rtol=0, atol=0)
        assert not padded[6:].any()
