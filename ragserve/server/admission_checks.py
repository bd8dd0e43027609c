"""Admission at the HTTP edge: a request's estimated work, and 503s (with Retry-After) for
work the server should not take now (see :mod:`ragserve.server.admission`)."""

from __future__ import annotations

from ragserve.engine.async_engine import AsyncEngine
from ragserve.sampling_params import SamplingParams
from ragserve.server.admission import UNBOUNDED_ANSWER_TOKENS, WorkAdmission
from ragserve.server.config import ServerConfig
from ragserve.server.errors import APIError, bad_request


def check_admission(
    engine: AsyncEngine,
    config: ServerConfig,
    num_requests: int,
    draining: bool,
    admission: WorkAdmission | None = None,
    prompt_tokens: int = 0,
    decode_steps: int = 0,
    sequences: int = 1,
    tenant: str = "",
) -> None:
    """503 with Retry-After when shutting down, when too many requests are in flight, or
    when ``tenant``'s new request would take longer than ``config.max_queue_seconds`` to
    finish (see :mod:`ragserve.server.admission`)."""
    retry = {"Retry-After": str(config.retry_after_seconds)}
    if draining:
        raise APIError(503, "the server is shutting down", code="shutting_down", headers=retry)
    if num_requests > config.max_waiting_requests:
        raise bad_request(
            f"this request holds {num_requests} prompts; the server takes at most "
            f"{config.max_waiting_requests} requests in flight (--max-waiting-requests): "
            "send fewer at a time",
            "prompt",
            "too_many_prompts",
        )
    active = engine.num_active_requests
    if active + num_requests > config.max_waiting_requests:
        raise APIError(
            503,
            f"the server is at capacity ({active} requests in flight, limit "
            f"{config.max_waiting_requests}); retry later",
            code="overloaded",
            headers=retry,
        )
    if admission is not None:
        check_work(admission, prompt_tokens, decode_steps, sequences, tenant)


def check_work(
    admission: WorkAdmission,
    prompt_tokens: int,
    decode_steps: int,
    sequences: int = 1,
    tenant: str = "",
) -> None:
    """503 with Retry-After when ``tenant``'s new request would take too long to finish."""
    verdict = admission.check(prompt_tokens, decode_steps, sequences, tenant)
    if verdict is not None:
        own_prompt, _ = admission.tenant_outstanding(tenant)
        raise APIError(
            503,
            f"the server is at capacity: this request ({prompt_tokens} prompt tokens to compute, "
            f"up to {decode_steps} tokens to generate) would take about "
            f"{verdict.expected_s:.0f} s with the work ahead of it "
            f"({admission.prompt_outstanding} prompt tokens, {own_prompt} of them this API "
            f"key's; {admission.sequences_answering} answers being generated; "
            f"{admission.active_tenants} API keys served in turn), over the "
            f"{admission.max_queue_seconds:.0f} s budget; retry later",
            code="overloaded",
            headers={"Retry-After": str(verdict.retry_after_s)},
        )


def estimate_work(
    prompt_lengths: list[int], cached_prefix: int, params: SamplingParams, max_model_len: int
) -> tuple[list[int], list[int]]:
    """Per prompt: (prompt tokens to compute, tokens it may generate over its ``n`` choices).

    ``cached_prefix``: leading tokens expected to be cached (a document's pinned prefix).
    At least one prompt token is always computed.
    """
    prompt = [max(1, length - cached_prefix) for length in prompt_lengths]
    answer = []
    for length in prompt_lengths:
        room = max_model_len - length
        bound = UNBOUNDED_ANSWER_TOKENS if params.max_tokens is None else params.max_tokens
        answer.append(min(room, bound) * params.n)
    return prompt, answer
