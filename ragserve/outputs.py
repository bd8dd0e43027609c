"""What a finished (or streaming) request hands back; field names follow vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None
    # One dict per generated token: token id -> Logprob for the top-N and the sampled token.
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the KV cache
    # Of those, per place: "device" (already there) and each tier they were loaded from.
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    # Blend (never counted as cached): prompt tokens whose KV was reused from a document's
    # segment at a new position, and tokens of such documents computed instead.
    num_blended_tokens: int = 0
    num_recomputed_tokens: int = 0
    error: str | None = None  # set when the engine gave up on the request
    # Why: None (no room: pinned documents hold the KV cache) or "request_failed" (a fault
    # of this request alone, e.g. while sampling or detokenizing; the others went on).
    error_code: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
