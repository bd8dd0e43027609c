"""Token-aware chunking: bounds, overlap, no text lost, cuts at paragraph/sentence ends."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.chunking import (
    LINE,
    NONE,
    PARAGRAPH,
    SENTENCE,
    WORD,
    TokenizedText,
    boundary_strengths,
    chunk_text,
    plan_chunks,
    tokenize_with_offsets,
)

WORDS = [
    "cache",
    "block",
    "token",
    "engine",
    "prefix",
    "memory",
    "request",
    "batch",
    "model",
    "layer",
    "attention",
    "value",
    "key",
    "document",
    "summary",
    "question",
    "answer",
]


def make_text(paragraphs: int, sentences: int, seed: int = 0) -> str:
    rng = random.Random(seed)

    def sentence() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 9))).capitalize() + "."

    return "\n\n".join(" ".join(sentence() for _ in range(sentences)) for _ in range(paragraphs))


def assert_contract(ranges: list[tuple[int, int]], n: int, chunk_tokens: int, overlap: int) -> None:
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    for start, end in ranges:
        assert 0 < end - start <= chunk_tokens or n == 0
    for (start, end), (next_start, next_end) in itertools.pairwise(ranges):
        assert start < next_start <= end < next_end  # progress, and no gap between chunks
        shared = end - next_start
        assert (overlap + 1) // 2 <= shared <= overlap if overlap else shared == 0


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    n=st.integers(0, 400),
    chunk_tokens=st.integers(2, 120),
)
def test_plan_chunks_contract_holds_for_any_boundaries(
    data: Any, n: int, chunk_tokens: int
) -> None:
    overlap = data.draw(st.integers(0, chunk_tokens // 2 - 1)) if chunk_tokens >= 2 else 0
    inner = data.draw(
        st.lists(st.integers(NONE, PARAGRAPH), min_size=max(0, n - 1), max_size=max(0, n - 1))
    )
    strengths = [PARAGRAPH, *inner, PARAGRAPH] if n else [PARAGRAPH]
    ranges = plan_chunks(strengths, chunk_tokens, overlap)
    assert_contract(ranges, n, chunk_tokens, overlap)
    if n <= chunk_tokens:
        assert ranges == [(0, n)]


@pytest.mark.parametrize(("chunk_tokens", "overlap"), [(1, 0), (10, 5), (10, -1), (96, 48)])
def test_impossible_sizes_are_refused_with_the_numbers(chunk_tokens: int, overlap: int) -> None:
    with pytest.raises(ValueError, match=str(chunk_tokens) if chunk_tokens < 2 else str(overlap)):
        plan_chunks([PARAGRAPH] * 500, chunk_tokens, overlap)


def test_boundary_strengths_read_the_text(smollm_tokenizer: Any) -> None:
    text = "Hello world.\n\nNext para.  Sentence two!\nA line"
    tokenized = tokenize_with_offsets(smollm_tokenizer, text)
    strengths = boundary_strengths(tokenized)
    by_token = {
        text[s:e].strip(): strengths[j]
        for j, (s, e) in enumerate(tokenized.offsets)
        if text[s:e].strip()
    }
    assert by_token["world"] == WORD
    assert by_token["Next"] == PARAGRAPH
    assert by_token["Sentence"] == SENTENCE
    assert by_token["A"] == LINE
    assert by_token["."] == NONE
    # Whitespace-only tokens never start a chunk: the whitespace stays with the chunk before.
    for j, (s, e) in enumerate(tokenized.offsets):
        if j and not text[s:e].strip():
            assert strengths[j] == NONE


@pytest.mark.parametrize("overlap", [0, 16])
def test_real_document_chunks_respect_bounds_and_lose_no_text(
    smollm_tokenizer: Any, overlap: int
) -> None:
    text = make_text(paragraphs=12, sentences=4) + " Ünïcödé 日本語の文章。 Done."
    tokenized = tokenize_with_offsets(smollm_tokenizer, text)
    chunks = chunk_text(tokenized, 96, overlap)
    assert len(chunks) >= 5
    assert_contract([(c.token_start, c.token_end) for c in chunks], len(tokenized), 96, overlap)
    # The new part of each chunk, concatenated, is exactly the document.
    ids = tokenized.token_ids
    rebuilt: list[int] = []
    for chunk in chunks:
        rebuilt += ids[max(chunk.token_start, len(rebuilt)) : chunk.token_end]
    assert rebuilt == ids
    assert smollm_tokenizer.decode(rebuilt) == text
    # Every visible character lies inside some chunk's character span.
    covered: set[int] = set()
    for chunk in chunks:
        covered.update(range(chunk.char_start, chunk.char_end))
    assert all(i in covered for i, ch in enumerate(text) if not ch.isspace())


def test_chunks_end_at_the_strongest_boundary_available(smollm_tokenizer: Any) -> None:
    def cuts(text: str, overlap: int = 0) -> tuple[TokenizedText, list[int], list[Any]]:
        tokenized = tokenize_with_offsets(smollm_tokenizer, text)
        chunks = chunk_text(tokenized, 96, overlap)
        assert len(chunks) >= 3
        strengths = boundary_strengths(tokenized)
        return tokenized, strengths, chunks

    # Paragraphs of ~35 tokens: every chunk ends at a paragraph break.
    _, strengths, chunks = cuts(make_text(paragraphs=10, sentences=3, seed=1))
    assert all(strengths[c.token_end] == PARAGRAPH for c in chunks)
    # One long paragraph: chunks end at sentence ends, and with overlap begin at one too.
    tokenized, strengths, chunks = cuts(make_text(paragraphs=1, sentences=40, seed=2), overlap=24)
    assert all(strengths[c.token_end] >= SENTENCE for c in chunks)
    assert all(strengths[c.token_start] >= SENTENCE for c in chunks)
    for chunk in chunks[:-1]:
        assert tokenized.text[: chunk.char_end].endswith(".")
    # No punctuation at all: chunks still end between words, never inside one.
    _, strengths, chunks = cuts(" ".join(WORDS * 30))
    assert all(strengths[c.token_end] >= WORD for c in chunks)


def test_a_document_shorter_than_a_chunk_is_one_chunk(smollm_tokenizer: Any) -> None:
    tokenized = tokenize_with_offsets(smollm_tokenizer, make_text(paragraphs=2, sentences=2))
    assert len(tokenized) < 96
    chunks = chunk_text(tokenized, 96, 8)
    assert [(c.token_start, c.token_end) for c in chunks] == [(0, len(tokenized))]
    assert (chunks[0].char_start, chunks[0].char_end) == (0, len(tokenized.text))
