"""The blend-quality emulator of ``ragserve bench rag`` (ragserve/bench/rag_quality.py), on
a tiny random Llama through transformers."""

from __future__ import annotations

import random

import pytest
import torch

from ragserve.bench.rag_quality import RULES, BlendEmulator, score
from ragserve.bench.rag_workload import RagQuestion
from tests.model_factory import make_tiny_hf_model

BLOCK = 16


def _question(seed: int = 0) -> RagQuestion:
    """Template, three documents of 40-56 tokens, a question: ids below the tiny vocabulary."""
    rng = random.Random(seed)
    ids = [rng.randrange(3, 120) for _ in range(8)]
    spans = []
    for length in (40, 56, 48):
        spans.append((len(ids), len(ids) + length))
        ids += [rng.randrange(3, 120) for _ in range(length)]
    ids += [rng.randrange(3, 120) for _ in range(6)]
    return RagQuestion(ids, spans, [0, 1, 2], "")


@pytest.fixture(scope="module")
def emulator() -> BlendEmulator:
    # NOTE: room for the test prompts (up to 158 tokens and the answer)
    return BlendEmulator(make_tiny_hf_model("llama", seed=3, max_position_embeddings=256), BLOCK)


def test_recomputing_everything_gives_the_full_prefill(emulator: BlendEmulator) -> None:
    question = _question()
    ref = emulator.reference(question, 6)
    everything = {p for c in emulator.candidates(question) for p in c}
    assert emulator.select(question, 1.0, "leading", ref) == everything
    full = score(ref, emulator.blended(question, everything, ref))
    assert full.exact and full.kl < 1e-6
    stale = score(ref, emulator.blended(question, set(), ref))
    assert stale.kl > 1e-4  # reused KV at new positions is not the full prefill's


@pytest.mark.parametrize("rule", RULES)
def test_a_selection_spends_the_ratio_of_the_later_documents(
    emulator: BlendEmulator, rule: str
) -> None:
    question = _question(1)
    ref = emulator.reference(question, 4)
    chosen = emulator.select(question, 0.25, rule, ref)
    candidates = emulator.candidates(question)
    budget = sum(-(-(end - start) // 4) for start, end in question.spans[1:])
    assert len(chosen) == budget
    assert chosen <= {p for c in candidates for p in c}
    if rule == "leading":
        assert min(chosen) == question.spans[1][0]
    everything = {p for c in candidates for p in c}
    assert emulator.select(question, 1.0, rule, ref) == everything


@pytest.mark.parametrize("rule", ["full-deviation", "attention"])
def test_a_rule_picks_positions_worth_more_than_as_many_others(
    emulator: BlendEmulator, rule: str
) -> None:
    """Recomputing what the rule picks leaves the answer closer to the full prefill than
    recomputing as many of the positions it leaves out."""
    question = _question(3)
    ref = emulator.reference(question, 4)
    everything = {p for c in emulator.candidates(question) for p in c}
    picked = emulator.select(question, 0.3, rule, ref)
    rest = set(sorted(everything - picked)[: len(picked)])
    assert len(rest) == len(picked)
    kl_picked = score(ref, emulator.blended(question, picked, ref)).kl
    kl_rest = score(ref, emulator.blended(question, rest, ref)).kl
    assert kl_picked < kl_rest


def test_an_unknown_rule_is_refused(emulator: BlendEmulator) -> None:
    question = _question()
    with pytest.raises(ValueError, match="unknown selection rule"):
        emulator.select(question, 0.5, "random", emulator.reference(question, 2))


def test_the_reference_answer_ends_at_the_end_of_turn(emulator: BlendEmulator) -> None:
    """Scored tokens stop where the greedy answer ends: past it the model would be forced to
    keep writing, and those tokens are no one's greedy choice."""
    question = _question(2)
    model = emulator.model
    before = model.generation_config.eos_token_id
    try:
        model.generation_config.eos_token_id = None
        free = emulator.reference(question, 8).answer
        model.generation_config.eos_token_id = free[2]
        ended = emulator.reference(question, 8)
    finally:
        model.generation_config.eos_token_id = before
    assert ended.answer == free[: free.index(free[2]) + 1]
    assert ended.logprobs.shape[0] == len(ended.answer)
    everything = {p for c in emulator.candidates(question) for p in c}
    blended = emulator.blended(question, everything, ended)
    assert blended.shape == ended.logprobs.shape
    assert torch.equal(blended.argmax(dim=-1), torch.tensor(ended.answer))
