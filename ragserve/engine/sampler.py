"""Turns last-token logits into next tokens: greedy, temperature, top-k, top-p, seeds.

The whole batch is sampled on the logits' device; the host reads the chosen ids once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragserve.outputs import Logprob
from ragserve.sampling_params import SamplingParams


@dataclass
class SampleRequest:
    """What the sampler needs of one sequence."""

    params: SamplingParams
    generator: torch.Generator | None
    banned_token_ids: list[int]  # e.g. EOS and stop tokens before min_tokens is reached


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None  # of the sampled token, when logprobs were asked for
    top_logprobs: dict[int, Logprob] | None


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Rows of ``logits`` with everything outside each row's top-k and top-p set to -inf.

    ``top_k [rows]`` (0: off) and ``top_p [rows]`` (1.0: off). Top-p keeps the smallest set
    of most likely tokens whose probability reaches ``top_p``, always the top token.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    keep_k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    remove = ranks[None, :] >= keep_k[:, None]
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    remove |= probs.cumsum(dim=-1) - probs >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _sample_rows(logits: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
    """One draw per row (all non-greedy), as token ids on the device: no host sync.

    Exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` per token is a draw from ``p``;
    each row's noise comes from its own generator, so a seeded request draws the same
    tokens whatever else shares its batch.
    """
    device = logits.device
    params = [r.params for r in requests]
    temperature = torch.tensor([p.temperature for p in params], device=device)
    scaled = logits / temperature[:, None]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_k = torch.tensor([p.top_k for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        scaled = _filter_top_k_top_p(scaled, top_k, top_p)
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs)
    for row, request in enumerate(requests):
        noise[row].exponential_(generator=request.generator)
    return (probs / noise).argmax(dim=-1)


def sample(logits: torch.Tensor, requests: list[SampleRequest]) -> list[SampleResult]:
    """One token per row of ``logits`` ([num_seqs, vocab], float32); one host sync in all."""
    if not requests:
        return []
    logits = logits.float()
    banned_rows = [row for row, r in enumerate(requests) for _ in r.banned_token_ids]
    if banned_rows:
        banned_ids = [token for r in requests for token in r.banned_token_ids]
        logits[banned_rows, banned_ids] = float("-inf")
    tokens = logits.argmax(dim=-1)
    sampled = [row for row, r in enumerate(requests) if not r.params.greedy]
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)
        tokens[rows] = _sample_rows(logits[rows], [requests[row] for row in sampled])
    token_ids = tokens.tolist()
    want_logprobs = any(r.params.logprobs is not None for r in requests)
    logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

    results = []
    for row, request in enumerate(requests):
        params = request.params
        token = int(token_ids[row])
        if logprobs is None or params.logprobs is None:
            results.append(SampleResult(token, None, None))
            continue
        row_logprobs = logprobs[row]
        top = {}
        if params.logprobs > 0:
            values, ids = torch.topk(row_logprobs, params.logprobs)
            top = {
                int(i): Logprob(float(v), rank + 1)
                for rank, (v, i) in enumerate(zip(values.tolist(), ids.tolist(), strict=True))
            }
        chosen = float(row_logprobs[token])
        if token not in top:
            rank = int((row_logprobs > row_logprobs[token]).sum()) + 1
            top[token] = Logprob(chosen, rank)
        results.append(SampleResult(token, chosen, top))
    return results
