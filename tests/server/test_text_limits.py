"""The byte bound checked before tokenizing: which tokenizers allow one, which bytes they
drop, that it never refuses text that fits (property-tested on SmolLM2's tokenizer), and
the errors it gives."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ragserve.server.errors import APIError
from ragserve.server.text_limits import TextLimit, TokenBytes, token_bytes

VOCAB = {"[UNK]": 0, "a": 1, "b": 2, "ab": 3, "▁": 4, "▁ab": 5, "abab": 6}


def tokenizer(
    model: Any, normalizer: Any = None, pre_tokenizer: Any = None, decoder: Any = None
) -> Any:
    backend = Tokenizer(model)
    if normalizer is not None:
        backend.normalizer = normalizer
    if pre_tokenizer is not None:
        backend.pre_tokenizer = pre_tokenizer
    if decoder is not None:
        backend.decoder = decoder
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def bpe(**kwargs: Any) -> Any:
    return models.BPE(VOCAB, [("a", "b"), ("▁", "ab"), ("ab", "ab")], unk_token="[UNK]", **kwargs)


def test_smollm_tokens_stand_for_at_most_81_bytes(smollm_tokenizer: Any) -> None:
    # The longest entry: a newline and 80 spaces.
    bound = token_bytes(smollm_tokenizer)
    assert bound is not None and bound.most == 81


def test_smollm_drops_the_bytes_its_vocabulary_cannot_spell(
    smollm_tokenizer: Any, dropped_characters: frozenset[str]
) -> None:
    bound = token_bytes(smollm_tokenizer)
    assert bound is not None and bound.dropped == b"\x04\x06\x13\x14\x16\x1d\xf1\xf2"
    assert {chr(byte) for byte in bound.dropped if byte < 0x80} == dropped_characters
    # A character led by 0xF1 keeps its three continuation bytes (0x80, spelled U+0122).
    ids = smollm_tokenizer("\U00040000", add_special_tokens=False)["input_ids"]
    assert smollm_tokenizer.convert_ids_to_tokens(ids) == ["\u0122"] * 3


def byte_level(lacking: str = "") -> Any:
    """A byte-level BPE of single bytes whose vocabulary lacks the characters ``lacking``."""
    alphabet = sorted(set(pre_tokenizers.ByteLevel.alphabet()) - set(lacking))
    return tokenizer(
        models.BPE({char: i for i, char in enumerate(alphabet)}, []),
        pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=False),
        decoder=decoders.ByteLevel(),
    )


def spelling(text: str) -> str:
    """``text`` as byte-level BPE spells it: a character a byte."""
    pieces = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(text)
    return "".join(piece for piece, _ in pieces)


def test_byte_level_vocabularies_drop_the_bytes_they_lack() -> None:
    assert token_bytes(byte_level()) == TokenBytes(1, b"")
    assert token_bytes(byte_level(spelling("\x16"))) == TokenBytes(1, b"\x16")
    assert token_bytes(byte_level(spelling("é")[0])) == TokenBytes(1, b"\xc3")  # a lead byte
    # Without a continuation byte, a character could vanish whole: no bound.
    assert token_bytes(byte_level(spelling("é")[1])) is None


def test_sentencepiece_style_bpe_has_a_bound() -> None:
    sentencepiece = tokenizer(
        bpe(byte_fallback=True),
        normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
        decoder=decoders.Sequence([decoders.Replace("▁", " "), decoders.Strip(" ", 1, 0)]),
    )
    assert token_bytes(sentencepiece) == TokenBytes(len("[UNK]") + 1)
    # Unicode normalization can compose three characters into one: the bound triples.
    composing = tokenizer(bpe(byte_fallback=True), normalizers.NFC(), pre_tokenizers.Metaspace())
    assert token_bytes(composing) == TokenBytes(3 * (len("[UNK]") + 1))


@pytest.mark.parametrize(
    "make",
    [
        lambda: tokenizer(
            models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"),
            pre_tokenizer=pre_tokenizers.Whitespace(),  # drops whitespace
        ),
        lambda: tokenizer(bpe(fuse_unk=True)),  # one unknown token for a run of text
        lambda: tokenizer(bpe(), normalizers.BertNormalizer()),  # strips accents, controls
        lambda: tokenizer(bpe(), normalizers.Replace("ab", "")),  # deletes text
        lambda: tokenizer(bpe(), pre_tokenizer=pre_tokenizers.Split(" ", "removed")),
    ],
    ids=["whitespace split", "fused unknowns", "bert normalizer", "deletion", "removed splits"],
)
def test_tokenizers_that_drop_or_shrink_text_have_no_bound(make: Any) -> None:
    assert token_bytes(make()) is None


# Runs of whitespace make the longest tokens; special-token strings count as text; SmolLM2
# drops 0x16 (runs of it take no tokens at all) and the lead byte of U+40000.
_PIECES = [" ", "\n", "\t", "a", "Z", "é", "日", "🙂", "-", "=", "0", "<|im_end|>"]
_PIECES += ["\x16" * 1000, "\U00040000"]
_TEXT = st.lists(st.sampled_from(_PIECES), max_size=400).map("".join) | st.text(max_size=200)


@pytest.fixture(scope="module")
def dropped_characters(smollm_tokenizer: Any) -> frozenset[str]:
    """One-byte characters the embedded tokenizer turns into no token at all."""
    return frozenset(
        chr(c)
        for c in range(128)
        if not smollm_tokenizer(chr(c), add_special_tokens=False, split_special_tokens=True)[
            "input_ids"
        ]
    )


@pytest.fixture(scope="module")
def smollm_limit(smollm_tokenizer: Any) -> TextLimit:
    """SmolLM2's bound; each test sets the context and the configured limit."""
    limit = TextLimit.for_tokenizer(smollm_tokenizer, 1, sys.maxsize)
    assert limit.context_tokens is not None
    return limit


@settings(max_examples=300, deadline=None)
@given(text=_TEXT)
def test_the_bound_never_undercounts(
    smollm_tokenizer: Any, smollm_limit: TextLimit, text: str
) -> None:
    """In a context of exactly as many tokens as the text takes, the text is never refused
    for the context: its bytes counted, or its characters past the configured limit."""
    ids = smollm_tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    fits = replace(smollm_limit, context_tokens=len(ids))
    fits.check([text], "prompt")
    if text:
        with pytest.raises(APIError) as raised:
            replace(fits, max_bytes=len(text) - 1).check([text], "prompt")
        assert raised.value.code == "text_too_large"


def test_text_limit_from_the_context_or_the_configured_bytes(smollm_tokenizer: Any) -> None:
    limit = TextLimit.for_tokenizer(smollm_tokenizer, 8192, 4 * 2**20)
    assert (limit.max_bytes, limit.context_tokens, limit.bytes_per_token) == (4 * 2**20, 8192, 81)
    assert limit.context_bytes == 8192 * 81
    assert TextLimit.for_tokenizer(smollm_tokenizer, 131072, 4 * 2**20) == TextLimit(4 * 2**20)


def test_check_counts_bytes_across_texts() -> None:
    limit = TextLimit(100, context_tokens=10, bytes_per_token=10)
    limit.check(["a" * 50, "é" * 25], "messages")  # exactly 100 bytes
    with pytest.raises(APIError) as raised:
        limit.check(["a" * 50, "é" * 26], "messages")
    assert raised.value.status == 400 and raised.value.code == "context_length_exceeded"
    assert raised.value.param == "messages" and "102 bytes" in raised.value.message
    with pytest.raises(APIError) as raised:
        limit.check(["a" * 10**6], "messages")  # decided on the character count alone
    assert "at least 1000000 bytes" in raised.value.message
    with pytest.raises(APIError) as raised:
        TextLimit(100).check(["x" * 101], "text")
    assert raised.value.status == 413 and raised.value.code == "text_too_large"


def test_check_counts_only_the_bytes_that_take_tokens() -> None:
    limit = TextLimit(1000, context_tokens=1, bytes_per_token=3, dropped=b"\x16\xf1")
    limit.check(["\x16" * 900, "\U00040000"], "messages")  # 3 bytes take tokens, 904 in all
    with pytest.raises(APIError) as raised:
        limit.check(["\x16" * 900, "\U00040000a"], "messages")
    assert raised.value.code == "context_length_exceeded" and "has 4 bytes" in raised.value.message
    with pytest.raises(APIError) as raised:
        limit.check(["\x16" * 1001], "messages")  # the configured limit counts every byte
    assert raised.value.code == "text_too_large" and "at least 1001 bytes" in raised.value.message


def test_text_the_tokenizer_drops_takes_no_room(smollm_tokenizer: Any) -> None:
    limit = TextLimit.for_tokenizer(smollm_tokenizer, 8192, 4 * 2**20)
    question = "What is the capital of France?"
    padded = "\x16" * (2 * 8192 * 81) + question  # twice the bytes that fit
    assert len(smollm_tokenizer(padded, add_special_tokens=False)["input_ids"]) < 20
    limit.check([padded], "messages")
    too_long = padded + question * (8192 * 81 // len(question) + 1)
    with pytest.raises(APIError) as raised:
        limit.check([too_long], "messages")
    assert raised.value.code == "context_length_exceeded"
    assert f"has {len(too_long) - 2 * 8192 * 81} bytes" in raised.value.message
