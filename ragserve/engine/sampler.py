"""Turns last-token logits into next tokens: greedy, temperature, top-k, top-p, seeds."""

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


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Keep the smallest set whose probability reaches top_p (always the top token).
        remove = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def sample(logits: torch.Tensor, requests: list[SampleRequest]) -> list[SampleResult]:
    """One token per row of ``logits`` ([num_seqs, vocab], float32)."""
    if not requests:
        return []
    logits = logits.float()
    for row, request in enumerate(requests):
        if request.banned_token_ids:
            logits[row, request.banned_token_ids] = float("-inf")
    greedy_tokens = logits.argmax(dim=-1).tolist()
    want_logprobs = any(r.params.logprobs is not None for r in requests)
    logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

    results = []
    for row, request in enumerate(requests):
        params = request.params
        if params.greedy:
            token = int(greedy_tokens[row])
        else:
            filtered = _filter_top_k_top_p(logits[row] / params.temperature, params.top_k, params.top_p)
            probs = torch.softmax(filtered, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=request.generator).item())
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
