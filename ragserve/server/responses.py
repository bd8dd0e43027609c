"""OpenAI response bodies and stream chunks built from the engine's cumulative outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ragserve.outputs import CompletionOutput, Logprob, RequestOutput
from ragserve.server.token_text import TextOffsets, TokenText

# JSON has no -inf; OpenAI reports impossible tokens as -9999.0.
_LOGPROB_FLOOR = -9999.0
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def usage(
    outputs: list[RequestOutput], documents: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """OpenAI's usage, plus the ``ragserve_cache`` extension (see
    :mod:`ragserve.server.cache_report`); ``documents``: its notes on named documents."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    by_tier: dict[str, int] = {}
    for output in outputs:
        for name, tokens in output.cached_tokens_by_tier.items():
            by_tier[name] = by_tier.get(name, 0) + tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "ragserve_cache": {
            "cached_tokens_by_tier": by_tier,
            # Reused at a new position (never counted as cached), and tokens of those
            # documents recomputed instead.
            "blended_tokens": sum(o.num_blended_tokens for o in outputs),
            "recomputed_tokens": sum(o.num_recomputed_tokens for o in outputs),
            "documents": documents or [],
        },
    }


def _value(logprob: float) -> float:
    return max(logprob, _LOGPROB_FLOOR)


def _ranked(entries: dict[int, Logprob], top_n: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(entries.items(), key=lambda item: item[1].rank)
    return [(token, lp) for token, lp in ranked if lp.rank <= top_n][:top_n]


def chat_logprobs(
    output: CompletionOutput, start: int, end: int, top_n: int, text_of: TokenText
) -> dict[str, Any] | None:
    """OpenAI's chat ``logprobs.content`` for generated tokens [start, end)."""
    if output.logprobs is None:
        return None
    content = []
    for position in range(start, min(end, len(output.logprobs))):
        token = output.token_ids[position]
        entries = output.logprobs[position]
        text = text_of(token)
        content.append(
            {
                "token": text,
                "logprob": _value(entries[token].logprob),
                "bytes": list(text_of.bytes_of(token)),
                "top_logprobs": [
                    {
                        "token": text_of(t),
                        "logprob": _value(lp.logprob),
                        "bytes": list(text_of.bytes_of(t)),
                    }
                    for t, lp in _ranked(entries, top_n)
                ],
            }
        )
    return {"content": content}


def completion_logprobs(
    output: CompletionOutput,
    start: int,
    end: int,
    top_n: int,
    text_of: TokenText,
    offsets: TextOffsets,
) -> dict[str, Any] | None:
    """Legacy completions ``logprobs`` for tokens [start, end); ``offsets`` moves past them."""
    if output.logprobs is None:
        return None
    tokens, token_logprobs, tops, text_offsets = [], [], [], []
    for position in range(start, min(end, len(output.logprobs))):
        token = output.token_ids[position]
        entries = output.logprobs[position]
        tokens.append(text_of(token))
        token_logprobs.append(_value(entries[token].logprob))
        tops.append({text_of(t): _value(lp.logprob) for t, lp in _ranked(entries, top_n)})
        text_offsets.append(offsets.advance(text_of.bytes_of(token)))
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": text_offsets,
    }


@dataclass
class ChoiceCursor:
    """What one streamed choice has sent so far."""

    text_len: int = 0
    num_tokens: int = 0
    finished: bool = False
    started: bool = False
    text_offsets: TextOffsets = field(default_factory=TextOffsets)


@dataclass
class StreamState:
    cursors: dict[int, ChoiceCursor] = field(default_factory=dict)
    finals: dict[int, RequestOutput] = field(default_factory=dict)

    def cursor(self, index: int) -> ChoiceCursor:
        return self.cursors.setdefault(index, ChoiceCursor())


def finish_reason(output: CompletionOutput) -> str | None:
    if output.finish_reason is None:
        return None
    return FINISH_REASONS.get(output.finish_reason, output.finish_reason)
