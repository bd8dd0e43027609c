"""Incremental detokenization with stop-string handling.

Decoding only a short window of recent tokens keeps each step O(1) in the output length;
text is released only once it can no longer change (no trailing partial UTF-8 character)
and can no longer be the start of a stop string.
"""

from __future__ import annotations

from typing import Any

# Tokens decoded before the new ones, so merges and leading spaces come out right.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop_strings: tuple[str, ...],
        skip_special_tokens: bool,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop_strings = stop_strings
        self._hold_back = max((len(s) for s in stop_strings), default=1) - 1
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=self._skip_special))

    def append(self, token_id: int, find_stops: bool = True) -> str | None:
        """Add one token; returns the stop string it completed, if any. With
        ``find_stops`` False (the request's ``min_tokens`` not reached yet) stop strings
        are text like any other.

        The text is cut where the earliest stop string starts, whatever their order."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # an incomplete character: wait for more bytes
        new_text = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        old_length = len(self.text)
        self.text += new_text
        if not find_stops:
            return None
        # NOTE: each stop string only where it ends in the new text: one that ended before
        # (say, before min_tokens) is text.
        found = [
            (self.text.find(stop, max(0, old_length - len(stop) + 1)), stop)
            for stop in self._stop_strings
        ]
        at, stop = min(
            ((at, s) for at, s in found if at >= 0), key=lambda f: f[0], default=(-1, "")
        )
        if at < 0:
            return None
        self.text = self.text[:at]
        return stop

    def stream_text(self, finished: bool) -> str:
        """The text safe to show now: it can no longer turn into a stop string."""
        if finished or not self._hold_back:
            return self.text
        return self.text[: max(0, len(self.text) - self._hold_back)]
