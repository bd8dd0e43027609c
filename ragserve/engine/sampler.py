"""Turns last-token logits into next tokens: greedy, temperature, top-k, top-p, seeds.

The whole batch is sampled on the logits' device; the host reads the chosen ids once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import cpu_argmax
from ragserve.outputs import Logprob
from ragserve.sampling_params import SamplingParams


@dataclass
class SampleRequest:
    """What the sampler needs of one sequence."""

    params: SamplingParams
    generator: torch.Generator | None
    banned_token_ids: list[int]  # e.g. EOS and stop tokens before min_tokens is reached
    request_id: str = ""  # whose draw this is, for error reports


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None  # of the sampled token, when logprobs were asked for
    top_logprobs: dict[int, Logprob] | None
    error: str | None = None  # this row's logprobs could not be read; the others are valid


def to_device_async(
    values: list[int] | list[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``values`` as a tensor on ``device``, copied without waiting for work already queued.

    NOTE: a copy from pageable host memory waits for the device's stream to drain, which
    would undo the overlap of a step launched ahead (see ``LLMEngine.step``); a pinned
    source does not.
    """
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _filter_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
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
    temperature = to_device_async([p.temperature for p in params], torch.float32, device)
    scaled = logits / temperature[:, None]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_k = to_device_async([p.top_k for p in params], torch.int64, device)
        top_p = to_device_async([p.top_p for p in params], torch.float32, device)
        scaled = _filter_top_k_top_p(scaled, top_k, top_p)
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs)
    for row, request in enumerate(requests):
        noise[row].exponential_(generator=request.generator)
    return (probs / noise).argmax(dim=-1)


@dataclass
class DeviceSamples:
    """Tokens drawn on the device, on their way to a host buffer; read them with ``read_samples``."""

    token_ids: torch.Tensor  # [rows] int64 on the logits' device
    requests: list[SampleRequest]
    logprobs: torch.Tensor | None  # [rows, vocab] float32, when a request asked for logprobs
    host_token_ids: torch.Tensor  # their host copy (pinned on CUDA), valid once ``ready`` is
    ready: torch.cuda.Event | None


def sample_on_device(logits: torch.Tensor, requests: list[SampleRequest]) -> DeviceSamples:
    """Queue the draws of one token per row of ``logits`` ([rows, vocab]) without a host sync.

    The ids' copy to the host is queued right behind the draws, so a later ``read_samples``
    waits for this step alone, not for work queued after it (the next step's forward).
    """
    logits = logits.float()
    banned_rows = [row for row, r in enumerate(requests) for _ in r.banned_token_ids]
    if banned_rows:
        banned_ids = [token for r in requests for token in r.banned_token_ids]
        device = logits.device
        rows = to_device_async(banned_rows, torch.int64, device)
        logits[rows, to_device_async(banned_ids, torch.int64, device)] = float("-inf")
    tokens = cpu_argmax.argmax_rows(logits) if cpu_argmax.usable(logits) else logits.argmax(dim=-1)
    sampled = [row for row, r in enumerate(requests) if not r.params.greedy]
    if sampled:
        rows = to_device_async(sampled, torch.int64, logits.device)
        tokens[rows] = _sample_rows(logits[rows], [requests[row] for row in sampled])
    want_logprobs = any(r.params.logprobs is not None for r in requests)
    logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    on_cuda = tokens.device.type == "cuda"
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=on_cuda)
    host.copy_(tokens, non_blocking=on_cuda)
    ready = None
    if on_cuda:
        ready = torch.cuda.Event()
        ready.record()
    return DeviceSamples(tokens, requests, logprobs, host, ready)


def read_samples(samples: DeviceSamples) -> list[SampleResult]:
    """Wait for the draws and return one result per row: the step's one host sync.

    A row whose logprobs cannot be read gets ``error`` set; the other rows are unaffected.
    """
    if samples.ready is not None:
        samples.ready.synchronize()
    token_ids = samples.host_token_ids.tolist()
    logprobs = samples.logprobs
    results = []
    for row, request in enumerate(samples.requests):
        params = request.params
        token = int(token_ids[row])
        if logprobs is None or params.logprobs is None:
            results.append(SampleResult(token, None, None))
            continue
        try:
            chosen, top = _row_logprobs(logprobs[row], token, params.logprobs)
        except Exception as exc:
            results.append(SampleResult(token, None, None, f"{type(exc).__name__}: {exc}"))
            continue
        results.append(SampleResult(token, chosen, top))
    return results


def _row_logprobs(
    row_logprobs: torch.Tensor, token: int, num_top: int
) -> tuple[float, dict[int, Logprob]]:
    """The sampled token's logprob, and the top ``num_top`` plus the sampled token ranked."""
    top = {}
    if num_top > 0:
        values, ids = torch.topk(row_logprobs, num_top)
        top = {
            int(i): Logprob(float(v), rank + 1)
            for rank, (v, i) in enumerate(zip(values.tolist(), ids.tolist(), strict=True))
        }
    chosen = float(row_logprobs[token])
    if token not in top:
        rank = int((row_logprobs > row_logprobs[token]).sum()) + 1
        top[token] = Logprob(chosen, rank)
    return chosen, top


def sample(logits: torch.Tensor, requests: list[SampleRequest]) -> list[SampleResult]:
    """One token per row of ``logits`` ([num_seqs, vocab], float32); one host sync in all."""
    if not requests:
        return []
    return read_samples(sample_on_device(logits, requests))
