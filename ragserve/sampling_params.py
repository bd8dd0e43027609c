"""Per-request sampling settings, validated once when they are made."""

from __future__ import annotations

from dataclasses import dataclass, field

# Bounds on what one request may ask for, so that no value can overflow the sampler's
# tensors or make the stop-string matcher slow for the whole batch.
MAX_N = 128
MAX_TOP_K = 2**31 - 1  # the engine also bounds it by the vocabulary
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_BYTES = 1024
MAX_STOP_TOKEN_IDS = 1024
SEED_RANGE = (-(2**63), 2**63 - 1)  # what a torch generator accepts, with room for n samples
GREEDY_BELOW_TEMPERATURE = 1e-5  # smaller ones overflow logits / temperature


class InvalidParameter(ValueError):
    """A sampling parameter out of its bounds; ``param`` names it (as the API spells it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """What to generate and when to stop; the common subset of vLLM's ``SamplingParams``.

    ``temperature`` below 1e-5 (0 included) is greedy. ``seed`` makes one request's samples reproducible
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
        _check_int("n", self.n, 1, MAX_N)
        _check_real("temperature", self.temperature)
        _check_real("top_p", self.top_p)
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidParameter(
                "temperature", f"temperature must be in [0, 100], got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParameter("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, -1, MAX_TOP_K)
        if self.top_k == 0:
            raise InvalidParameter("top_k", "top_k must be -1 (disabled) or >= 1, got 0")
        if self.seed is not None:
            _check_int("seed", self.seed, SEED_RANGE[0], SEED_RANGE[1] - MAX_N)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, 2**31 - 1)
        _check_int("min_tokens", self.min_tokens, 0, 2**31 - 1)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParameter(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise InvalidParameter(
                "stop",
                f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop_strings)}",
            )
        for stop in self.stop_strings:
            if not isinstance(stop, str) or not stop:
                raise InvalidParameter("stop", "stop strings must be non-empty strings")
            if len(stop.encode("utf-8", "surrogatepass")) > MAX_STOP_STRING_BYTES:
                raise InvalidParameter(
                    "stop", f"a stop string may have at most {MAX_STOP_STRING_BYTES} bytes"
                )
        stop_ids = self.stop_token_ids or []
        if len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidParameter(
                "stop_token_ids",
                f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(stop_ids)}",
            )
        for token in stop_ids:
            _check_int("stop_token_ids", token, 0, 2**31 - 1)

    @property
    def greedy(self) -> bool:
        """Temperatures this small are greedy: dividing the logits by one overflows them."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def _check_int(name: str, value: object, low: int, high: int) -> None:
    """``value`` is an int (not a bool) in ``[low, high]``, else ValueError naming both."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameter(name, f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise InvalidParameter(name, f"{name} must be in [{low}, {high}], got {value}")


def _check_real(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParameter(name, f"{name} must be a number, got {value!r}")
