"""Refusing text that cannot fit before tokenizing it: a bound on UTF-8 bytes.

One token stands for at most ``B`` bytes of text (its longest vocabulary entry, decoded),
so text of more than ``max_model_len * B`` bytes needs more than ``max_model_len`` tokens
and is refused at once. This holds for the bytes that reach a token: :func:`token_bytes`
gives ``B`` and the bytes the tokenizer drops, which are not counted. It allows the usual
chat-model tokenizers (byte-level BPE, SentencePiece-style BPE or Unigram with byte
fallback, Unicode normalization, Metaspace, regex splits) and returns None for the rest
(whitespace-dropping pre-tokenizers, stripping normalizers, unknown-token models), which
then have only the configured byte limit.

A byte-level vocabulary spells each byte as one character, and a byte whose character it
lacks is dropped: SmolLM2's lacks six control characters (0x04, 0x06, 0x13, 0x14, 0x16,
0x1D) and the lead bytes 0xF1 and 0xF2, so text made of those control characters takes
almost no tokens however many bytes it holds. The configured limit still counts every byte.

Chat templates place every message's content in the prompt; a request whose messages alone
hold more bytes than the bound is refused even where a template would drop some of them
(the reasoning of earlier turns).

NOTE: measured on two shared cores with SmolLM2 (8192 tokens, 81 bytes a token): a 20 MB
chat message sent alone is refused 0.14-0.17 s after the request starts: reading and
parsing the body, then the check, one pass over the characters for each one-byte
character the tokenizer drops (about 0.06 s for SmolLM2's six). The server's RSS stays
20-60 MB above its baseline afterwards, so this path needs no heap trimming. Tokenized in
full instead, such a message held other chats up for 10 to 16 s and left 1.4 GB behind.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

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
# Bytes that never occur in UTF-8, so a vocabulary need not spell them.
_NEVER_IN_UTF8 = frozenset({0xC0, 0xC1, *range(0xF5, 0x100)})
# The bytes after the first of a character of two or more bytes.
_CONTINUATION_BYTES = range(0x80, 0xC0)


class TokenBytes(NamedTuple):
    """What a tokenizer's tokens stand for, in UTF-8 bytes of input text."""

    most: int  # the most bytes one token stands for
    dropped: bytes = b""  # bytes no token spells: the tokenizer drops them


@dataclass(frozen=True)
class TextLimit:
    """How much UTF-8 text a prompt may hold.

    ``max_bytes`` is the configured limit, on all of the text's bytes. Where the tokenizer
    allows a bound tighter than that, the bytes that reach a token (all but the ``dropped``
    ones) must also fit ``context_tokens * bytes_per_token``.
    """

    max_bytes: int
    context_tokens: int | None = None
    bytes_per_token: int | None = None
    dropped: bytes = b""

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, max_model_len: int, configured: int) -> TextLimit:
        bound = token_bytes(tokenizer)
        if bound is None or max_model_len * bound.most >= configured:
            return cls(configured)
        return cls(configured, max_model_len, bound.most, bound.dropped)

    @property
    def context_bytes(self) -> int | None:
        """The most bytes reaching a token that fit the context, where the tokenizer allows
        a bound."""
        if self.context_tokens is None or self.bytes_per_token is None:
            return None
        return self.context_tokens * self.bytes_per_token

    def check(self, texts: Iterable[str], param: str) -> None:
        """400 (``context_length_exceeded``) when the bytes of ``texts`` that reach a token
        cannot fit the context, else 413 (``text_too_large``) when ``texts`` together hold
        more than ``max_bytes`` bytes. Costs O(characters) at most (a pass for each dropped
        byte), and nothing when the character count alone decides."""
        texts = list(texts)
        chars = sum(len(text) for text in texts)
        context_bytes = self.context_bytes
        tightest = self.max_bytes if context_bytes is None else min(self.max_bytes, context_bytes)
        if 4 * chars <= tightest:  # a character is at most 4 bytes
            return
        at_least = "at least " if chars > self.max_bytes else ""
        if at_least:
            # Refused whatever the characters take; counted without encoding, as each one is
            # a byte at least, and each one the tokenizer keeps reaches a token with a byte
            # at least (see token_bytes): ``kept`` is a lower bound.
            size = chars
            one_byte = [chr(byte) for byte in self.dropped if byte < 0x80]
            kept = chars - sum(text.count(char) for text in texts for char in one_byte)
        else:
            encoded = [text.encode() for text in texts]
            size = sum(len(data) for data in encoded)
            kept = size - sum(data.count(byte) for data in encoded for byte in self.dropped)
        if context_bytes is not None and kept > context_bytes:
            raise bad_request(
                f"this model's maximum context length is {self.context_tokens} tokens, and one "
                f"token stands for at most {self.bytes_per_token} bytes of text, so at most "
                f"{context_bytes} bytes fit; the text in {param} has {at_least}{kept} "
                "bytes that take tokens",
                param,
                "context_length_exceeded",
            )
        if size > self.max_bytes:
            raise APIError(
                413,
                f"the text in {param} is {at_least}{size} bytes; this server "
                f"takes at most {self.max_bytes}",
                param=param,
                code="text_too_large",
            )


def token_bytes(tokenizer: Any) -> TokenBytes | None:
    """The most UTF-8 bytes of input text one token can stand for and the bytes the
    tokenizer drops, or None when it may drop or shrink text so that no such bound holds
    (see the module doc)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    shrink = _normalizer_shrink(_spec(backend.normalizer))
    if shrink is None or not _pre_tokenizer_keeps_text(_spec(backend.pre_tokenizer)):
        return None
    byte_level = _is_byte_level(_spec(backend.pre_tokenizer))
    if not _model_keeps_text(backend.model, byte_level):
        return None
    vocab = backend.get_vocab(with_added_tokens=False)
    dropped = _unspelled_bytes(vocab) if byte_level else b""
    if any(byte in _CONTINUATION_BYTES for byte in dropped):
        # NOTE: each character of two or more bytes holds a continuation byte, so while all
        # of those have tokens, each character kept reaches a token with one byte at least,
        # and TextLimit.check can refuse on a character count without encoding. A
        # vocabulary lacking one would need a count per character: it gets no bound.
        return None
    decoder = _spec(backend.decoder)
    added = [token.content for token in tokenizer.added_tokens_decoder.values()]
    longest_added = max((len(content.encode()) for content in added), default=0)
    if decoder is not None and decoder.get("type") == "ByteLevel":
        # Byte-level vocabularies spell each byte as one character.
        longest = max(len(token) for token in vocab)
    else:
        size = backend.get_vocab_size(with_added_tokens=True)
        texts = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
        # NOTE: +1: Metaspace and WordPiece decoders drop the space a lone token starts with.
        longest = max(len(text.encode()) for text in texts) + 1
    return TokenBytes(max(longest, longest_added) * shrink, dropped)


def _unspelled_bytes(vocab: dict[str, int]) -> bytes:
    """The bytes of UTF-8 text a byte-level vocabulary has no token for. Its BPE drops
    them, or makes each run of them an unknown token: counting them as nothing holds either
    way.

    Byte-level BPE spells each byte as one character (GPT-2's table): printable Latin-1
    bytes as themselves, the others as U+0100 onwards, in order.
    """
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = iter(range(0x100, 0x200))
    spelling = [chr(byte) if byte in printable else chr(next(others)) for byte in range(256)]
    return bytes(
        byte
        for byte, char in enumerate(spelling)
        if char not in vocab and byte not in _NEVER_IN_UTF8
    )


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
    no unknown token stands for a run of them. Byte-level BPE is the exception: it drops
    the bytes its vocabulary lacks, which :func:`token_bytes` finds and counts apart."""
    kind = type(model).__name__
    if kind == "BPE":
        if byte_level or model.byte_fallback:
            return True  # every byte has a token, or is dropped (byte-level)
        return model.unk_token is not None and not model.fuse_unk
    if kind == "Unigram":
        return bool(getattr(model, "byte_fallback", False))
    return False
