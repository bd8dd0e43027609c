"""Logprob token texts, raw bytes and offsets for tokens that split a UTF-8 character."""

from __future__ import annotations

from typing import Any

from ragserve.server.token_text import TextOffsets, TokenText

TEXT = "€ 😀 日本"


def test_split_characters_keep_their_bytes_and_offsets(smollm_tokenizer: Any) -> None:
    ids = list(smollm_tokenizer.encode(TEXT))
    text_of = TokenText(smollm_tokenizer)
    raw = [text_of.bytes_of(token) for token in ids]
    assert b"".join(raw) == TEXT.encode()
    shown = [text_of(token) for token in ids]
    assert any(s.startswith("bytes:\\x") for s in shown)  # SmolLM2 splits the emoji and 日
    assert "\ufffd" not in "".join(shown)
    offsets = TextOffsets()
    # €, ␠ and 😀's first three bytes, 😀's last, ␠ and 日's first, 日's second, its last, 本
    assert [offsets.advance(piece) for piece in raw] == [0, 1, 2, 3, 4, 4, 5]
    assert offsets.chars == len(TEXT)


def test_whole_characters_are_their_text(smollm_tokenizer: Any) -> None:
    text_of = TokenText(smollm_tokenizer)
    for token in smollm_tokenizer.encode("The capital of France is Paris, isn't it?"):
        assert text_of.bytes_of(token) == text_of(token).encode()
        assert text_of(token) == smollm_tokenizer.decode([token])
