"""One token's text and raw bytes for logprobs, and where each token starts in the text.

A byte-level tokenizer splits a character of several UTF-8 bytes (an emoji, most CJK) over
tokens, and decoding such a token alone gives U+FFFD. OpenAI reports its raw ``bytes`` and
shows it as ``bytes:\\xNN``; a token's ``text_offset`` is the character it starts in.
NOTE: offsets add up each token decoded alone, exact for byte-level tokenizers; one that
drops a word's leading space when its token is decoded alone (SentencePiece) undercounts.
"""

from __future__ import annotations

import codecs
import re
from functools import cache
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


@cache
def _byte_level_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


class TokenText:
    """Decodes single tokens for logprobs, memoized (a vocabulary is small)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> str:
        """The token as shown: its text, or ``bytes:\\xNN…`` for part of a character."""
        return self._entry(token_id)[0]

    def bytes_of(self, token_id: int) -> bytes:
        return self._entry(token_id)[1]

    def _entry(self, token_id: int) -> tuple[str, bytes]:
        entry = self._cache.get(token_id)
        if entry is None:
            text = str(self.tokenizer.decode([token_id]))
            entry = (text, text.encode())
            if "\ufffd" in text:
                raw = self._raw_bytes(token_id)
                if raw is not None and raw.decode(errors="replace") == text:
                    entry = (_shown(raw), raw)
            self._cache[token_id] = entry
        return entry

    def _raw_bytes(self, token_id: int) -> bytes | None:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, bytes):  # tokenizers whose vocabulary is bytes (tiktoken's)
            return piece
        if not isinstance(piece, str):
            return None
        match = _BYTE_TOKEN.fullmatch(piece)
        if match:
            return bytes([int(match[1], 16)])
        decoder = _byte_level_decoder()
        if all(char in decoder for char in piece):
            return bytes(decoder[char] for char in piece)
        return None


def _shown(raw: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)


class TextOffsets:
    """Character offsets of successive tokens in the text they decode to."""

    def __init__(self) -> None:
        self.chars = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, raw: bytes) -> int:
        """The offset where a token of these bytes starts; moves past the characters it ends."""
        start = self.chars
        self.chars += len(self._decoder.decode(raw))
        return start
