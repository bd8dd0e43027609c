"""Chained block hashes with and without the run memo (kvstore/hashing.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvstore.hashing import (
    MEMO_RUN_BLOCKS,
    ROOT_PARENT,
    BlockHashMemo,
    hash_full_blocks,
    make_salt,
)

BLOCK = 16
SALT = make_salt("model", BLOCK, "float32")


def _tokens(count: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(count)]


@pytest.mark.parametrize(
    "num_tokens", [0, BLOCK - 1, BLOCK * MEMO_RUN_BLOCKS, BLOCK * (2 * MEMO_RUN_BLOCKS + 3) + 5]
)
def test_the_memo_gives_the_hashes_of_the_plain_chain(num_tokens: int) -> None:
    tokens = _tokens(num_tokens)
    plain = hash_full_blocks(SALT, tokens, BLOCK)
    memo = BlockHashMemo()
    assert hash_full_blocks(SALT, tokens, BLOCK, memo=memo) == plain
    assert hash_full_blocks(SALT, tokens, BLOCK, memo=memo) == plain  # now from the memo
    assert memo.hits == num_tokens // (BLOCK * MEMO_RUN_BLOCKS)
    assert len(plain) == num_tokens // BLOCK


def test_a_continued_chain_equals_the_whole_chain() -> None:
    tokens = _tokens(BLOCK * (MEMO_RUN_BLOCKS + 40))
    whole = hash_full_blocks(SALT, tokens, BLOCK)
    memo = BlockHashMemo()
    head = hash_full_blocks(SALT, tokens[: BLOCK * 7], BLOCK, memo=memo)
    tail = hash_full_blocks(SALT, tokens, BLOCK, head[-1], len(head), memo)
    assert head + tail == whole


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_an_integer_array_hashes_as_its_list(dtype: type) -> None:
    """The engine hashes a prompt from the int64 array its validation built."""
    tokens = _tokens(BLOCK * 9 + 3, seed=5)
    array = np.array(tokens, dtype=dtype)
    assert hash_full_blocks(SALT, array, BLOCK) == hash_full_blocks(SALT, tokens, BLOCK)
    head = hash_full_blocks(SALT, tokens[: BLOCK * 2], BLOCK)
    assert (
        hash_full_blocks(SALT, array, BLOCK, head[-1], 2)
        == hash_full_blocks(SALT, tokens, BLOCK)[2:]
    )


def test_a_run_is_reused_only_under_the_same_salt_and_parent() -> None:
    """The same tokens after another prefix, or in another namespace, hash differently,
    memo or not: a run's entry is keyed by what its hashes depend on."""
    doc = _tokens(BLOCK * MEMO_RUN_BLOCKS, seed=1)
    other_prefix = _tokens(BLOCK * MEMO_RUN_BLOCKS, seed=2)
    memo = BlockHashMemo()
    alone = hash_full_blocks(SALT, doc, BLOCK, memo=memo)
    after = hash_full_blocks(SALT, other_prefix + doc, BLOCK, memo=memo)
    assert (
        after[MEMO_RUN_BLOCKS:]
        == hash_full_blocks(SALT, other_prefix + doc, BLOCK)[MEMO_RUN_BLOCKS:]
    )
    assert set(after[MEMO_RUN_BLOCKS:]).isdisjoint(alone)
    tenant = make_salt("model", BLOCK, "float32", namespace="tenant-b")
    assert set(hash_full_blocks(tenant, doc, BLOCK, memo=memo)).isdisjoint(alone)
    assert memo.hits == 0


def test_the_memo_keeps_its_most_recent_runs() -> None:
    memo = BlockHashMemo(max_runs=2)
    runs = [_tokens(BLOCK * MEMO_RUN_BLOCKS, seed=s) for s in range(3)]
    for run in runs:
        hash_full_blocks(SALT, run, BLOCK, memo=memo)
    hash_full_blocks(SALT, runs[2], BLOCK, memo=memo)
    hash_full_blocks(SALT, runs[1], BLOCK, memo=memo)
    assert memo.hits == 2
    hash_full_blocks(SALT, runs[0], BLOCK, memo=memo)  # dropped first: hashed again
    assert memo.hits == 2
    with pytest.raises(ValueError, match="max_runs"):
        BlockHashMemo(max_runs=0)


def test_the_root_parent_starts_every_chain() -> None:
    tokens = _tokens(BLOCK * 2)
    assert hash_full_blocks(SALT, tokens, BLOCK, ROOT_PARENT) == hash_full_blocks(
        SALT, tokens, BLOCK
    )
