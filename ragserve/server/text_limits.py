"""Refusing text that cannot fit before tokenizing it: a bound on UTF-8 bytes.

One token stands for at most ``B`` bytes of text (its longest vocabulary entry, decoded),
so text of more than ``max_model_len * B`` bytes needs more than ``max_model_len`` tokens
and is refused at once. This holds when nothing between the bytes and the model drops or
shrinks text. :func:`max_token_bytes` allows the usual chat-model tokenizers (byte-level
BPE, SentencePiece-style BPE or Unigram with byte fallback, Unicode normalization,
Metaspace, regex splits) and returns None for the rest (whitespace-dropping
pre-tokenizers, stripping normalizers, unknown-token models), which then have only the
configured byte limit.

Chat templates place every message's content in the prompt; a request whose messages alone
hold more bytes than the bound is refused even where a template would drop some of them
(the reasoning of earlier turns).

NOTE: measured on two shared cores with SmolLM2 (8192 tokens, 81 bytes a token): a 20 MB
chat message is refused 0.17-0.22 s after the request starts (reading and parsing the
body; the check itself is one pass over the characters), and the server's RSS stays
20-60 MB above its baseline afterwards, so this path needs no heap trimming. Tokenized
in full instead, such a message held other chats up for 10 to 16 s and left 1.4 GB behind.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ragserve.server.errors import APIError, bad_request

# How far Unicode normalization can shrink UTF-8 text: composing three 3-byte Hangul jamo
# into one 3-byte syllable.
_UNICODE_NORMALIZATION_SHRINK = 3
_SAFE_PRE_TOKENIZERS = {
    "ByteLevel",
    "Metaspace",
    "Digits",
    "Punctuation",
    "Split",
    "UnicodeScripts",
}


@dataclass(frozen=True)
class TextLimit:
    """The most UTF-8 bytes a prompt's text may hold.

    ``max_bytes`` is the smaller of the configured limit and, where the tokenizer allows one,
    ``context_tokens * bytes_per_token`` (both then set).
    """

    max_bytes: int
    context_tokens: int | None = None
    bytes_per_token: int | None = None

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, max_model_len: int, configured: int) -> TextLimit:
        per_token = max_token_bytes(tokenizer)
        if per_token is None or max_model_len * per_token >= configured:
            return cls(configured)
        return cls(max_model_len * per_token, max_model_len, per_token)

    def check(self, texts: Iterable[str], param: str) -> None:
        """400 (``context_length_exceeded``) or 413 (``text_too_large``) when ``texts``
        together hold more than ``max_bytes`` bytes. Costs O(characters) at most, and nothing
        when the character count alone decides."""
        texts = list(texts)
        chars = sum(len(text) for text in texts)
        if 4 * chars <= self.max_bytes:  # a character is at most 4 bytes
            return
        size = chars if chars > self.max_bytes else sum(len(t.encode()) for t in texts)
        if size <= self.max_bytes:
            return
        at_least = "at least " if chars > self.max_bytes else ""
        if self.context_tokens is not None:
            raise bad_request(
                f"this model's maximum context length is {self.context_tokens} tokens, and one "
                f"token stands for at most {self.bytes_per_token} bytes of text, so at most "
                f"{self.max_bytes} bytes fit; the {param} hold {at_least}{size} bytes",
                param,
                "context_length_exceeded",
            )
        raise APIError(
            413,
            f"the {param} hold {at_least}{size} bytes of text; this server takes at most "
            f"{self.max_bytes}",
            param=param,
            code="text_too_large",
        )


def max_token_bytes(tokenizer: Any) -> int | None:
    """The most UTF-8 bytes of input text one token can stand for, or None when the
    tokenizer may drop or shrink text so that no such bound holds (see the module doc)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    shrink = _normalizer_shrink(_spec(backend.normalizer))
    if shrink is None or not _pre_tokenizer_keeps_text(_spec(backend.pre_tokenizer)):
        return None
    if not _model_keeps_text(backend.model, _is_byte_level(_spec(backend.pre_tokenizer))):
        return None
    decoder = _spec(backend.decoder)
    added = [token.content for token in tokenizer.added_tokens_decoder.values()]
    longest_added = max((len(content.encode()) for content in added), default=0)
    if decoder is not None and decoder.get("type") == "ByteLevel":
        # Byte-level vocabularies spell each byte as one character.
        longest = max(len(token) for token in backend.get_vocab(with_added_tokens=False))
    else:
        size = backend.get_vocab_size(with_added_tokens=True)
        texts = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
        # NOTE: +1: Metaspace and WordPiece decoders drop the space a lone token starts with.
        longest = max(len(text.encode()) for text in texts) + 1
    return max(longest, longest_added) * shrink


def _spec(component: Any) -> dict[str, Any] | None:
    """A tokenizers component (normalizer, pre-tokenizer, decoder) as its JSON form."""
    if component is None:
        return None
    spec: dict[str, Any] = json.loads(component.__getstate__())
    return spec


def _normalizer_shrink(spec: dict[str, Any] | None) -> int | None:
    """How many times fewer bytes the normalizer can leave; None when unbounded."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factors = [_normalizer_shrink(part) for part in spec.get("normalizers", [])]
        if any(factor is None for factor in factors):
            return None
        return math.prod(factor for factor in factors if factor is not None)
    if kind in ("NFC", "NFD", "NFKC", "NFKD"):
        return _UNICODE_NORMALIZATION_SHRINK
    if kind == "Prepend":
        return 1
    if kind == "Replace":
        pattern = spec.get("pattern", {}).get("String")
        content = str(spec.get("content", ""))
        if not isinstance(pattern, str) or not content:
            return None  # a regex or a deletion: no bound
        return max(1, math.ceil(len(pattern.encode()) / len(content.encode())))
    return None


def _pre_tokenizer_keeps_text(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_text(part) for part in spec.get("pretokenizers", []))
    return kind in _SAFE_PRE_TOKENIZERS and spec.get("behavior") != "Removed"


def _is_byte_level(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return False
    if spec.get("type") == "Sequence":
        return any(_is_byte_level(part) for part in spec.get("pretokenizers", []))
    return spec.get("type") == "ByteLevel"


def _model_keeps_text(model: Any, byte_level: bool) -> bool:
    """Every input character reaches a token of its own: none is dropped as unknown, and
    no unknown token stands for a run of them."""
    kind = type(model).__name__
    if kind == "BPE":
        if byte_level or model.byte_fallback:
            return True  # every byte has a token
        return model.unk_token is not None and not model.fuse_unk
    if kind == "Unigram":
        return bool(getattr(model, "byte_fallback", False))
    return False
