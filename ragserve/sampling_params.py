"""Per-request sampling settings, validated once when they are made."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """What to generate and when to stop; the common subset of vLLM's ``SamplingParams``.

    ``temperature == 0`` is greedy. ``seed`` makes one request's samples reproducible
    regardless of what else runs in the batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strings = (self.stop,)
        else:
            self.stop_strings = tuple(self.stop or ())
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids or ()):
            raise ValueError(f"stop_token_ids must be non-negative, got {self.stop_token_ids}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
