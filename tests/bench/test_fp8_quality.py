"""The FP8 quality bench's scoring: top-1 agreement and the top-k KL estimate."""

from __future__ import annotations

import math

import torch

from ragserve.bench.fp8_quality import compare, top_kl
from ragserve.bench.shapes import compute_floor_s, linear_flops, linear_params, prefill_flops
from ragserve.models.llama import ModelShape


def _top(logprobs: torch.Tensor, k: int) -> dict[int, float]:
    values, ids = torch.topk(logprobs, k)
    return dict(zip(ids.tolist(), values.tolist(), strict=True))


def _full_kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p.exp() * (p - q)).sum())


def test_top_kl_is_zero_for_equal_distributions_and_tracks_the_full_kl() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        p = torch.log_softmax(torch.randn(500, generator=gen) * 3, dim=0)
        q = torch.log_softmax(p + torch.randn(500, generator=gen) * 0.3, dim=0)
        assert top_kl(_top(p, 20), _top(p, 20)) == 0.0
        estimate, full = top_kl(_top(p, 20), _top(q, 20)), _full_kl(p, q)
        # NOTE: merging outcomes can only lower the KL; the estimate keeps most of it.
        assert 0.3 * full <= estimate <= full * 1.05 + 1e-9


def test_compare_counts_steps_whose_top_token_is_the_baseline_answer() -> None:
    ref = [[{1: math.log(0.6), 2: math.log(0.4)}, {3: math.log(0.9), 4: math.log(0.1)}]]
    var = [[{2: math.log(0.7), 1: math.log(0.3)}, {3: math.log(0.8), 4: math.log(0.2)}]]
    scores = compare(ref, var, answers=[[1, 3]])
    agree, kl = scores.top1_agreement, scores.mean_kl
    assert agree == 0.5 and scores.top1_forced_agreement == 0.5
    expected = (
        0.6 * math.log(0.6 / 0.3) + 0.4 * math.log(0.4 / 0.7)
        + 0.9 * math.log(0.9 / 0.8) + 0.1 * math.log(0.1 / 0.2)
    ) / 2  # fmt: skip
    assert abs(kl - expected) < 1e-9


def test_forced_agreement_scores_against_the_forced_baseline_not_the_greedy_answer() -> None:
    """Where the teacher-forced baseline's own top-1 differs from its greedy answer (a
    near tie flipped by other step shapes), the baseline scores 1.0 against itself, and a
    variant that follows the forced baseline is not counted wrong there."""
    ref = [[{1: math.log(0.51), 2: math.log(0.49)}, {3: math.log(0.9), 4: math.log(0.1)}]]
    follows = [[{1: math.log(0.52), 2: math.log(0.48)}, {3: math.log(0.9), 4: math.log(0.1)}]]
    answers = [[2, 3]]  # the greedy run picked 2 at the first step
    baseline = compare(ref, ref, answers)
    assert (baseline.top1_agreement, baseline.top1_forced_agreement, baseline.mean_kl) == (
        0.5,
        1.0,
        0.0,
    )
    variant = compare(ref, follows, answers)
    assert (variant.top1_agreement, variant.top1_forced_agreement) == (0.5, 1.0)


def test_fp8_compute_floor_runs_only_the_projections_at_the_fp8_rate() -> None:
    shape = ModelShape(32, 32, 8, 128, 4096, 14336, 128256)
    flops = prefill_flops(shape, 4096)
    projections = linear_flops(shape, 4096)
    assert projections == 2.0 * linear_params(shape) * 4096 < flops
    bf16 = compute_floor_s(flops, 0.0, 800.0, None)
    assert bf16 == flops / 800e12
    fp8 = compute_floor_s(flops, projections, 800.0, 1600.0)
    assert fp8 == (flops - projections) / 800e12 + projections / 1600e12
    assert bf16 / 2 < fp8 < bf16
