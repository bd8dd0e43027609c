"""The batched sampler draws from the right distribution, honours bans, and is seed-stable."""

from __future__ import annotations

import pytest
import torch

from ragserve.engine.sampler import SampleRequest, sample
from ragserve.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0, -8.0])


def _draws(params: SamplingParams, count: int, seed: int = 0) -> torch.Tensor:
    """``count`` draws of one row, made as one batch of ``count`` rows with their own seeds."""
    generators = [torch.Generator().manual_seed(seed * 100_000 + i) for i in range(count)]
    requests = [SampleRequest(params, g, []) for g in generators]
    results = sample(LOGITS.repeat(count, 1), requests)
    return torch.tensor([r.token_id for r in results])


def _expected(params: SamplingParams) -> torch.Tensor:
    """The distribution by definition: temperature, then top-k, then top-p on what is left."""
    probs = torch.softmax(LOGITS / params.temperature, dim=-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    top_k = params.top_k if params.top_k > 0 else len(probs)
    kept = probs[order[:top_k]] / probs[order[:top_k]].sum()
    mass = 0.0
    for rank, token in enumerate(order[:top_k].tolist()):
        keep[token] = True
        mass += float(kept[rank])
        if mass >= params.top_p:
            break
    filtered = torch.where(keep, probs, torch.zeros_like(probs))
    return filtered / filtered.sum()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.3, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=2.0, top_k=5, top_p=0.9),
    ],
    ids=["plain", "cold", "top-k", "top-p", "both"],
)
def test_draws_follow_the_filtered_softmax(params: SamplingParams) -> None:
    count = 20_000
    draws = _draws(params, count)
    frequencies = torch.bincount(draws, minlength=len(LOGITS)).float() / count
    expected = _expected(params)
    assert torch.all(frequencies[expected == 0] == 0), "a filtered-out token was drawn"
    # Binomial standard error at 20k draws is at most 0.0036: allow five of them.
    assert torch.allclose(frequencies, expected, atol=0.018), (frequencies, expected)


def test_banned_tokens_are_never_drawn_or_chosen_greedily() -> None:
    banned = [0, 1]
    greedy = SampleRequest(SamplingParams(temperature=0.0), None, banned)
    random = [
        SampleRequest(SamplingParams(temperature=1.0), torch.Generator().manual_seed(i), banned)
        for i in range(500)
    ]
    results = sample(LOGITS.repeat(501, 1), [greedy, *random])
    assert results[0].token_id == 2
    assert {r.token_id for r in results[1:]}.isdisjoint(banned)


def test_a_seeded_row_draws_the_same_whatever_its_neighbours() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95)
    alone = sample(LOGITS[None], [SampleRequest(params, torch.Generator().manual_seed(7), [])])
    neighbours = [
        SampleRequest(
            SamplingParams(temperature=0.7, top_k=2), torch.Generator().manual_seed(i), []
        )
        for i in range(5)
    ]
    batch = (
        neighbours[:2]
        + [SampleRequest(params, torch.Generator().manual_seed(7), [])]
        + neighbours[2:]
    )
    together = sample(LOGITS.repeat(6, 1), batch)
    assert together[2].token_id == alone[0].token_id
    different_seed = [
        sample(LOGITS[None], [SampleRequest(params, torch.Generator().manual_seed(s), [])])[
            0
        ].token_id
        for s in range(40)
    ]
    assert len(set(different_seed)) > 1


def test_logprobs_are_those_of_the_unscaled_distribution() -> None:
    params = SamplingParams(temperature=0.0, logprobs=2)
    result = sample(LOGITS[None], [SampleRequest(params, None, [])])[0]
    logprobs = torch.log_softmax(LOGITS, dim=-1)
    assert result.token_id == 0
    assert result.logprob == pytest.approx(float(logprobs[0]))
    assert result.top_logprobs is not None and set(result.top_logprobs) == {0, 1}
    assert result.top_logprobs[1].rank == 2
