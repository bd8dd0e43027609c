"""Token-aware chunking: split a document's token ids at paragraph/sentence boundaries.

A document is tokenized once. Every position between two tokens gets a boundary strength
(paragraph > line > sentence > word > none) from the text around it; chunks are then cut
on token counts, each ending at the strongest boundary in the second half of its budget,
and the next one starting at the strongest boundary inside the requested overlap.

Contract of :func:`plan_chunks` (tested):
- every chunk holds at most ``chunk_tokens`` tokens and at least one;
- the first chunk starts at token 0, the last ends at the last token, starts strictly
  increase, and each chunk starts no later than the previous one ends: no token is lost;
- consecutive chunks share between ``ceil(overlap / 2)`` and ``overlap`` tokens
  (exactly 0 when ``overlap_tokens`` is 0);
- a document of at most ``chunk_tokens`` tokens is one chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

NONE, WORD, SENTENCE, LINE, PARAGRAPH = 0, 1, 2, 3, 4
_SENTENCE_ENDS = frozenset(".!?…。！？")
_CLOSERS = frozenset("\"')]}”’»")


@dataclass(frozen=True)
class TokenizedText:
    """A text, its token ids, and each token's ``(start, end)`` character span in ``text``."""

    text: str
    token_ids: list[int]
    offsets: list[tuple[int, int]]

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class Chunk:
    """Tokens ``[token_start, token_end)`` of a document, and the characters they span."""

    index: int
    token_start: int
    token_end: int
    char_start: int
    char_end: int

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start


def tokenize_with_offsets(tokenizer: Any, text: str) -> TokenizedText:
    """Token ids of ``text`` (no special tokens added) with character offsets.

    Fast tokenizers report offsets; for others the offsets come from decoding each token,
    measured against the concatenation of those pieces (only boundaries depend on them).
    """
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = [int(t) for t in encoded["input_ids"]]
        offsets = [(int(a), int(b)) for a, b in encoded["offset_mapping"]]
        return TokenizedText(text, ids, offsets)
    except (NotImplementedError, KeyError, TypeError):
        pass
    ids = [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
    pieces = [tokenizer.decode([t]) for t in ids]
    offsets = []
    position = 0
    for piece in pieces:
        offsets.append((position, position + len(piece)))
        position += len(piece)
    return TokenizedText("".join(pieces), ids, offsets)


def boundary_strengths(tokenized: TokenizedText) -> list[int]:
    """Strength of cutting before token ``j``, for ``j`` in ``0..n`` (both ends: PARAGRAPH).

    Only a token with visible characters may start a chunk, so whitespace stays at the end
    of the chunk before. The strength comes from the whitespace run in front of the token
    and the character before that run.
    """
    text, offsets = tokenized.text, tokenized.offsets
    n = len(offsets)
    strengths = [NONE] * (n + 1)
    strengths[0] = strengths[n] = PARAGRAPH
    for j in range(1, n):
        start, end = offsets[j]
        if not text[start:end].strip():
            continue
        left = start
        while left > 0 and text[left - 1].isspace():
            left -= 1
        right = start
        while right < end and text[right].isspace():
            right += 1
        gap = text[left:right]
        if not gap:
            continue
        newlines = gap.count("\n")
        if newlines >= 2:
            strengths[j] = PARAGRAPH
        elif newlines == 1:
            strengths[j] = LINE
        elif _ends_sentence(text, left):
            strengths[j] = SENTENCE
        else:
            strengths[j] = WORD
    return strengths


def _ends_sentence(text: str, position: int) -> bool:
    """Whether the text just before ``position`` ends a sentence (closing quotes allowed)."""
    index = position - 1
    while index >= 0 and text[index] in _CLOSERS:
        index -= 1
    return index >= 0 and text[index] in _SENTENCE_ENDS


def plan_chunks(
    strengths: Sequence[int], chunk_tokens: int, overlap_tokens: int
) -> list[tuple[int, int]]:
    """Token ranges ``[start, end)`` over ``len(strengths) - 1`` tokens (see the module contract)."""
    validate_chunking(chunk_tokens, overlap_tokens)
    n = len(strengths) - 1
    if n <= chunk_tokens:
        return [(0, n)]
    ranges: list[tuple[int, int]] = []
    start = 0
    while n - start > chunk_tokens:
        end = _strongest(strengths, start + chunk_tokens // 2, start + chunk_tokens, latest=True)
        ranges.append((start, end))
        if overlap_tokens:
            next_start = _strongest(
                strengths, end - overlap_tokens, end - (overlap_tokens + 1) // 2, latest=False
            )
        else:
            next_start = end
        assert start < next_start <= end, (start, next_start, end)
        start = next_start
    ranges.append((start, n))
    return ranges


def _strongest(strengths: Sequence[int], low: int, high: int, latest: bool) -> int:
    """The position in ``[low, high]`` with the strongest boundary; ties go latest or earliest."""
    best = high if latest else low
    positions = range(high, low - 1, -1) if latest else range(low, high + 1)
    for position in positions:
        if strengths[position] > strengths[best]:
            best = position
    return best


def validate_chunking(chunk_tokens: int, overlap_tokens: int) -> None:
    if chunk_tokens < 2:
        raise ValueError(f"chunk_tokens must be >= 2, got {chunk_tokens}")
    if not 0 <= overlap_tokens < chunk_tokens // 2:
        raise ValueError(
            f"overlap_tokens must be in [0, chunk_tokens // 2) = [0, {chunk_tokens // 2}), "
            f"got {overlap_tokens}"
        )


def chunk_text(tokenized: TokenizedText, chunk_tokens: int, overlap_tokens: int) -> list[Chunk]:
    """Chunks of a tokenized document, with the character span of each."""
    ranges = plan_chunks(boundary_strengths(tokenized), chunk_tokens, overlap_tokens)
    offsets = tokenized.offsets
    chunks = []
    for index, (start, end) in enumerate(ranges):
        char_start = offsets[start][0] if start < len(offsets) else len(tokenized.text)
        char_end = offsets[end - 1][1] if end > 0 else 0
        chunks.append(Chunk(index, start, end, char_start, char_end))
    return chunks


def default_overlap(chunk_tokens: int) -> int:
    """The overlap used when none is asked: a tenth of the chunk, at most 128 tokens."""
    return min(128, chunk_tokens // 10)
