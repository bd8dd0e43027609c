"""The engine brings documents back from its tiers in batches: one copy from the CPU tier,
a recompute from the first missing block, a per-step load budget, and disk records that
are damaged count as misses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.block_pool import BlockIdentity
from kvstore.kv_cache_manager import KVAllocation
from kvstore.tier import KVTier, record_key
from ragserve import LLM, SamplingParams
from ragserve.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BLOCK = 16
BLOCK_BYTES = BLOCK * 46080  # SmolLM2, float32
DEVICE_BLOCKS = 24


def tier(engine: LLMEngine, name: str) -> KVTier:
    assert engine.tiers is not None
    return next(each for each in engine.tiers.tiers if each.name == name)


pytestmark = pytest.mark.slow  # each test computes and restores a long document


@pytest.fixture(scope="module")
def doc(smollm_tokenizer: Any) -> list[int]:
    text = (
        "Section 4. The supplier ships within ten working days of each purchase order and "
        "bears the risk until delivery. "
    ) * 6
    ids = list(smollm_tokenizer.encode(text))
    assert 8 * BLOCK < len(ids) < 14 * BLOCK
    return ids


@pytest.fixture(scope="module")
def reference(smollm_path: str, doc: list[int]) -> list[int]:
    with LLM(smollm_path, enable_prefix_caching=False) as llm:
        return llm.generate([doc + [42, 43]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def cpu_llm(smollm_path: str) -> Iterator[LLM]:
    with LLM(
        smollm_path,
        kv_cache_gib=DEVICE_BLOCKS * BLOCK_BYTES / 2**30,
        kv_cpu_gib=64 * BLOCK_BYTES / 2**30,
    ) as llm:
        yield llm


def full_blocks(doc: list[int]) -> int:
    """Full blocks of ``doc + [42, 43]`` a prefix hit can cover (the last token is computed)."""
    return (len(doc) + 1) // BLOCK


def ask(llm: LLM, doc: list[int]) -> tuple[list[int], int]:
    out = llm.generate([doc + [42, 43]], GREEDY, use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def demote_everything(llm: LLM) -> None:
    assert llm.reset_prefix_cache() > 0  # every cached device block goes down a tier
    assert llm.engine.tiers is not None
    llm.engine.tiers.flush()


def record_path(root: Path, identity: BlockIdentity) -> Path:
    key = record_key(identity)
    return root / key.fingerprint / (key.block_hash.hex() + ".kv")


def assert_pool_empty(llm: LLM) -> None:
    pool = llm.engine.block_pool
    pool.check_invariants()
    assert pool.num_free == pool.num_blocks


def test_engine_brings_a_document_back_from_the_cpu_tier_in_one_batch(
    cpu_llm: LLM, doc: list[int], reference: list[int]
) -> None:
    full = full_blocks(doc)
    ask(cpu_llm, doc)
    demote_everything(cpu_llm)
    assert cpu_llm.engine.tiers is not None
    cpu = tier(cpu_llm.engine, "cpu")
    traffic = cpu_llm.engine.tiers.traffic
    before = traffic.loaded_from_cpu
    copies_before = cpu.metrics().load_copies
    assert ask(cpu_llm, doc) == (reference, full * BLOCK)
    assert traffic.loaded_from_cpu - before == full and traffic.loaded_from_disk == 0
    # NOTE: the device demotes a document tail first and the CPU tier hands out slots from
    # the top down, so the document lies in ascending slots and comes back in one copy.
    assert cpu.metrics().load_copies - copies_before == 1
    assert_pool_empty(cpu_llm)


def test_engine_recomputes_from_a_block_missing_in_the_cpu_tier(
    cpu_llm: LLM, doc: list[int], reference: list[int]
) -> None:
    ask(cpu_llm, doc)
    demote_everything(cpu_llm)
    engine = cpu_llm.engine
    assert engine.tiers is not None
    alloc = KVAllocation(salt=engine.salt_for(""))
    engine.kv_manager.update_hashes(alloc, doc)
    assert tier(engine, "cpu").discard(engine.kv_manager._identity(alloc, doc, 3))
    before = engine.tiers.traffic.loaded_from_cpu
    assert ask(cpu_llm, doc) == (reference, 3 * BLOCK)
    assert engine.tiers.traffic.loaded_from_cpu - before == 3
    assert_pool_empty(cpu_llm)


def steps_to_first_token(llm: LLM, prompt: list[int], request_id: str) -> int:
    engine = llm.engine
    engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=1))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps


def test_engine_steps_to_bring_in_a_document_drop_as_the_budget_grows(
    cpu_llm: LLM, doc: list[int]
) -> None:
    manager = cpu_llm.engine.kv_manager
    default = manager.max_load_bytes_per_step
    steps = {}
    try:
        for blocks in (1, 3, 64):
            ask(cpu_llm, doc)
            demote_everything(cpu_llm)
            manager.max_load_bytes_per_step = blocks * BLOCK_BYTES
            steps[blocks] = steps_to_first_token(cpu_llm, doc + [42, 43], f"budget-{blocks}")
    finally:
        manager.max_load_bytes_per_step = default
    assert steps[1] > steps[3] > steps[64] >= 1
    # NOTE: one block per step, and the step's matches share it: a step per block.
    assert steps[1] >= len(doc) // BLOCK
    assert_pool_empty(cpu_llm)


def test_a_decode_keeps_running_while_a_document_streams_in(cpu_llm: LLM, doc: list[int]) -> None:
    engine = cpu_llm.engine
    manager = engine.kv_manager
    ask(cpu_llm, doc)
    demote_everything(cpu_llm)
    default = manager.max_load_bytes_per_step
    manager.max_load_bytes_per_step = BLOCK_BYTES
    try:
        engine.add_request(
            "chat", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        )
        engine.step()
        engine.add_request("doc", doc + [42, 43], SamplingParams(temperature=0.0, max_tokens=1))
        chat_tokens = 0
        while True:
            outputs = {out.request_id: out for out in engine.step()}
            if "doc" in outputs:
                break
            chat_tokens = len(outputs["chat"].outputs[0].token_ids)
        assert chat_tokens >= len(doc) // BLOCK - 2  # a token per step while loading
        assert outputs["doc"].num_cached_tokens == full_blocks(doc) * BLOCK
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        manager.max_load_bytes_per_step = default
    assert_pool_empty(cpu_llm)


@pytest.mark.parametrize("damaged", [False, True])
def test_engine_brings_a_document_back_from_disk_only(
    smollm_path: str, doc: list[int], reference: list[int], tmp_path: Path, damaged: bool
) -> None:
    """With ``damaged``, block 4's record has a flipped payload bit and block 6's is cut in
    half: the loaded run stops at 4, both records are rejected, the rest is computed."""
    with LLM(
        smollm_path,
        kv_cache_gib=DEVICE_BLOCKS * BLOCK_BYTES / 2**30,
        kv_disk_gib=64 * BLOCK_BYTES / 2**30,
        kv_disk_dir=str(tmp_path),
    ) as llm:
        ask(llm, doc)
        demote_everything(llm)
        engine = llm.engine
        assert engine.tiers is not None
        disk = tier(engine, "disk")
        if damaged:
            alloc = KVAllocation(salt=engine.salt_for(""))
            engine.kv_manager.update_hashes(alloc, doc)
            corrupt = record_path(tmp_path, engine.kv_manager._identity(alloc, doc, 4))
            data = corrupt.read_bytes()
            corrupt.write_bytes(data[:-9] + bytes([data[-9] ^ 1]) + data[-8:])
            truncated = record_path(tmp_path, engine.kv_manager._identity(alloc, doc, 6))
            truncated.write_bytes(truncated.read_bytes()[: len(data) // 2])
        expected = 4 if damaged else full_blocks(doc)
        assert ask(llm, doc) == (reference, expected * BLOCK)
        assert engine.tiers.traffic.loaded_from_disk == expected
        assert disk.metrics().corrupt_records == (2 if damaged else 0)
        if damaged:
            assert not corrupt.exists() and not truncated.exists()
        assert_pool_empty(llm)
