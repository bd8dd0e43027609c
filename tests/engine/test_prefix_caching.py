"""Automatic prefix caching on the real model: same outputs, shared blocks, computed once."""

from __future__ import annotations

from typing import Any

import pytest

from kvstore import hashing
from ragserve import LLM, SamplingParams
from ragserve.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK = 16


@pytest.fixture(scope="module")
def doc(smollm_tokenizer: Any) -> list[int]:
    text = (
        "Section 4.2. The tenant shall keep the premises in good repair and return them "
        "in the condition received, fair wear and tear excepted. "
    ) * 8
    return list(smollm_tokenizer.encode(text))


def prompts_sharing(doc: list[int]) -> list[list[int]]:
    """Prompts that share the document up to various points: inside a block, at a boundary, all."""
    boundary = len(doc) // BLOCK * BLOCK
    return [
        doc + [330, 331, 332],
        doc[:boundary] + [400, 401],  # diverges exactly at a block boundary
        doc[: boundary - 5] + [500, 501, 502],  # diverges inside a block
        doc,  # the whole prompt is cached on the second pass
        doc[:BLOCK],  # exactly one block
        doc + [330, 331, 332],  # identical to the first
    ]


def run_twice(
    llm: LLM, prompts: list[list[int]]
) -> tuple[list[list[int]], list[list[int]], list[int]]:
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    return (
        [o.outputs[0].token_ids for o in first],
        [o.outputs[0].token_ids for o in second],
        [o.num_cached_tokens for o in second],
    )


@pytest.mark.slow
def test_outputs_do_not_depend_on_caching(smollm_path: str, doc: list[int]) -> None:
    prompts = prompts_sharing(doc)
    cached = LLM(smollm_path, max_num_batched_tokens=64)
    plain = LLM(smollm_path, enable_prefix_caching=False, max_num_batched_tokens=64)
    first, second, hits = run_twice(cached, prompts)
    reference, _, no_hits = run_twice(plain, prompts)
    assert first == reference and second == reference
    assert no_hits == [0] * len(prompts)
    boundary = len(doc) // BLOCK * BLOCK
    assert hits[0] == boundary and hits[1] == boundary
    assert hits[2] == boundary - BLOCK  # the diverging block is recomputed
    assert hits[3] == (len(doc) - 1) // BLOCK * BLOCK  # at least one token is computed
    assert hits[4] == 0  # one block long: it is the last token's block
    for llm in (cached, plain):
        llm.engine.block_pool.check_invariants()
        assert llm.engine.block_pool.num_used == 0
    assert cached.engine.kv_manager.counters.hit_rate > 0.4
    assert cached.reset_prefix_cache() > 0 and cached.engine.block_pool.num_cached == 0


@pytest.fixture(scope="module")
def engine(smollm_path: str) -> LLMEngine:
    return LLM(smollm_path, max_num_batched_tokens=128, max_num_seqs=32).engine


@pytest.mark.slow
@pytest.mark.parametrize("readers", [1, 4, 16])
def test_concurrent_readers_share_one_copy_computed_once(
    engine: LLMEngine, doc: list[int], readers: int
) -> None:
    engine.reset_prefix_cache()
    before = engine.stats.prompt_tokens_computed
    questions = [[600 + i, 601 + i, 602] for i in range(readers)]
    for i, question in enumerate(questions):
        engine.add_request(f"reader-{readers}-{i}", doc + question, GREEDY)
    doc_blocks = len(doc) // BLOCK
    tables: list[list[int]] = []
    while engine.has_unfinished_requests():
        engine.step()
        running = [s for s in engine.scheduler.running if s.num_computed_tokens >= len(doc)]
        if len(running) == readers and not tables:
            tables = [list(s.kv.block_table) for s in running]
    assert tables, "never saw every reader past the document at once"
    document_blocks = {block for table in tables for block in table[:doc_blocks]}
    assert len(document_blocks) == doc_blocks, "the document's blocks grew with the readers"
    computed = engine.stats.prompt_tokens_computed - before
    # One document, plus each reader's private tail: its partial block and its question.
    private = len(doc) - doc_blocks * BLOCK + 3
    assert computed == doc_blocks * BLOCK + readers * private
    engine.block_pool.check_invariants()
    assert engine.block_pool.num_used == 0


@pytest.mark.slow
def test_namespaces_never_hit_each_other(engine: LLMEngine, doc: list[int]) -> None:
    def run(request_id: str, namespace: str) -> tuple[list[int], int]:
        engine.add_request(request_id, doc + [700], GREEDY, namespace=namespace)
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
        assert final is not None
        return final.outputs[0].token_ids, final.num_cached_tokens

    engine.reset_prefix_cache()
    a_tokens, a_hit = run("tenant-a-1", "tenant-a")
    b_tokens, b_hit = run("tenant-b-1", "tenant-b")
    a_again, a_hit_again = run("tenant-a-2", "tenant-a")
    assert a_hit == 0 and b_hit == 0, "tenant b hit tenant a's blocks"
    assert a_hit_again == len(doc) // BLOCK * BLOCK
    assert a_tokens == b_tokens == a_again


@pytest.mark.slow
def test_forced_hash_collision_is_detected(
    smollm_path: str, doc: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = LLM(smollm_path, enable_prefix_caching=False).generate(
        [doc, doc[::-1]], GREEDY, use_tqdm=False
    )
    monkeypatch.setattr(hashing, "hash_block", lambda salt, parent, data: b"\x07" * 16)
    llm = LLM(smollm_path)
    first = llm.generate([doc], GREEDY, use_tqdm=False)[0]
    second = llm.generate([doc[::-1]], GREEDY, use_tqdm=False)[0]  # every block "collides"
    assert second.num_cached_tokens == 0
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == [
        r.outputs[0].token_ids for r in reference
    ]
