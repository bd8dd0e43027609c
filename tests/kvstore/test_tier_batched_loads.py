"""Batched tier loads: a run of CPU/disk hits comes back in one call, stops at the first
miss, leaves the block pool intact, and streams a document in under a per-step budget."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.block_pool import BlockPool
from kvstore.cpu_tier import CpuTier
from kvstore.disk_tier import DiskTier
from kvstore.hashing import make_salt
from kvstore.kv_cache_manager import KVAllocation, KVCacheManager
from kvstore.record_format import encode_record
from kvstore.tier import BlockMeta, block_nbytes, record_key, salt_fingerprint
from kvstore.tier_link import TierLink
from kvstore.tier_manager import TierManager
from ragserve import LLM, SamplingParams
from tests.kvstore.tier_blocks import bit_equal

BS = 4
SHAPE = (2, 2, BS, 2, 8)
SALT = make_salt("batched-loads-test", BS, "float32")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BLOCK = 16
BLOCK_BYTES = BLOCK * 46080  # SmolLM2, float32
DEVICE_BLOCKS = 24


def block_for(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


class Stack:
    """A real pool, device cache (a CPU tensor here), tiers and manager over a token chain."""

    def __init__(self, num_blocks: int, cpu_slots: int, disk_dir: Path | None = None) -> None:
        nbytes = block_nbytes(SHAPE, torch.float32)
        self.cache = torch.zeros((num_blocks, *SHAPE))
        self.pool = BlockPool(num_blocks)
        cpu = CpuTier(SHAPE, torch.float32, cpu_slots * nbytes) if cpu_slots else None
        disk = DiskTier(SHAPE, torch.float32, 1 << 24, disk_dir) if disk_dir else None
        self.tiers = TierManager(cpu, disk, write_through=False)
        self.link = TierLink(self.tiers, self.cache, self.pool)
        self.manager = KVCacheManager(self.pool, BS, True, tiers=self.link)

    def alloc(self, tokens: list[int]) -> KVAllocation:
        alloc = KVAllocation(salt=SALT)
        self.manager.update_hashes(alloc, tokens)
        return alloc

    def compute(self, tokens: list[int]) -> dict[int, torch.Tensor]:
        """'Prefill' ``tokens`` with random KV, register and release it; block index -> KV."""
        alloc = self.alloc(tokens)
        assert self.manager.allocate(alloc, len(tokens))
        kv = {}
        for index, block in enumerate(alloc.block_table):
            self.cache[block] = block_for(1000 + index)
            kv[index] = self.cache[block].clone()
        self.manager.commit(alloc, tokens, len(tokens))
        self.manager.free(alloc)
        return kv

    def evict_to_tiers(self) -> None:
        self.pool.evict_all_free()
        self.tiers.flush()

    def metas(self, tokens: list[int]) -> list[BlockMeta]:
        alloc = self.alloc(tokens)
        return [
            BlockMeta(identity.block_hash, identity.parent_hash, identity.token_ids, SALT)
            for identity in (self.manager._identity(alloc, tokens, i) for i in range(len(alloc.block_hashes)))
        ]


@pytest.fixture
def tokens() -> list[int]:
    return list(range(10 * BS + 2))  # 10 full blocks and a partial one


def load_all(stack: Stack, tokens: list[int]) -> tuple[KVAllocation, int, int]:
    """match_prefix until it makes no progress: (allocation, computed tokens, calls)."""
    alloc = stack.alloc(tokens)
    computed, calls = 0, 0
    while True:
        calls += 1
        stack.manager.begin_step()
        now = stack.manager.match_prefix(alloc, tokens, computed)
        if now == computed:
            return alloc, computed, calls
        computed = now


def test_cpu_tier_batch_merges_consecutive_rows_and_slots_bit_exactly() -> None:
    nbytes = block_nbytes(SHAPE, torch.float32)
    tier = CpuTier(SHAPE, torch.float32, 8 * nbytes)
    metas = Stack(1, 0).metas(list(range(8 * BS)))
    for index in reversed(range(8)):  # slots go out from the top down: meta i in slot i
        assert tier.put(metas[index], block_for(index))
    cache = torch.full((12, *SHAPE), 7.0)
    rows = [4, 5, 6, 0, 1, 9, 10, 11]  # runs: slots 0-2 -> rows 4-6, 3-4 -> 0-1, 5-7 -> 9-11
    tier.discard(metas[4])
    found = tier.load_rows_into(metas, cache, rows)
    assert found == [True] * 4 + [False] + [True] * 3
    for index, row in enumerate(rows):
        if found[index]:
            assert bit_equal(cache[row], block_for(index))
    stats = tier.metrics()
    assert (stats.hits, stats.misses, stats.load_count, stats.load_copies) == (7, 1, 7, 3)
    assert stats.bytes_read == 7 * nbytes
    with pytest.raises(ValueError, match="8 blocks to load but 2 destination rows"):
        tier.load_rows_into(metas, cache, rows[:2])
    with pytest.raises(ValueError, match="must hold blocks of"):
        tier.load_rows_into(metas[:1], torch.zeros((2, 3)), [0])


def test_cpu_tier_batch_into_separate_destinations() -> None:
    tier = CpuTier(SHAPE, torch.float32, 4 * block_nbytes(SHAPE, torch.float32))
    metas = Stack(1, 0).metas(list(range(3 * BS)))
    for index, meta in enumerate(metas):
        tier.put(meta, block_for(index))
    dests = [torch.zeros(SHAPE) for _ in range(3)]
    assert tier.load_many_into(list(reversed(metas)), dests) == [True, True, True]
    assert all(bit_equal(dests[i], block_for(2 - i)) for i in range(3))


def test_link_loads_a_mixed_cpu_and_disk_run_and_reports_its_leading_hits(
    tmp_path: Path, tokens: list[int]
) -> None:
    stack = Stack(16, cpu_slots=4, disk_dir=tmp_path)  # 10 blocks: 6 spill to disk
    kv = stack.compute(tokens)
    stack.evict_to_tiers()
    metas = stack.metas(tokens)
    disk = stack.tiers.disk
    assert disk is not None and stack.tiers.cpu is not None
    assert sum(stack.tiers.cpu.contains(m) for m in metas) == 4
    assert all(stack.tiers.lookup(m) is not None for m in metas)
    alloc = stack.alloc(tokens)
    identities = [stack.manager._identity(alloc, tokens, i) for i in range(10)]
    blocks = stack.pool.allocate(10)
    assert stack.link.load_many(identities, blocks) == 10
    assert all(bit_equal(stack.cache[block], kv[i]) for i, block in enumerate(blocks))
    traffic = stack.link.traffic
    assert (traffic.loaded_from_cpu, traffic.loaded_from_disk) == (4, 6)
    assert traffic.load_seconds > 0

    disk.discard(metas[7])  # a miss in the middle: 7 leading blocks count, 2 are dropped
    assert stack.link.load_many(identities, blocks) == 7
    assert traffic.discarded_loads == 2
    stack.pool.release(blocks)
    stack.pool.check_invariants()
    stack.link.close()


def test_match_prefix_loads_a_cpu_run_in_one_call_bit_exactly(tokens: list[int]) -> None:
    stack = Stack(16, cpu_slots=16)
    kv = stack.compute(tokens)
    stack.evict_to_tiers()
    assert stack.pool.num_cached == 0
    alloc, computed, calls = load_all(stack, tokens)
    assert computed == 10 * BS and calls == 2  # the second call finds nothing more
    assert stack.link.traffic.loaded_from_cpu == 10
    for index, block in enumerate(alloc.block_table):
        assert bit_equal(stack.cache[block], kv[index])
        assert stack.pool.lookup(stack.manager._identity(alloc, tokens, index)) == block
    stack.pool.check_invariants([alloc.block_table])
    stack.manager.free(alloc)
    assert stack.pool.num_free == stack.pool.num_blocks


@pytest.mark.parametrize("fault", ["cpu-discard", "disk-corrupt", "disk-truncate"])
def test_a_miss_in_the_middle_stops_the_run_and_leaks_nothing(
    tmp_path: Path, tokens: list[int], fault: str
) -> None:
    on_disk = fault.startswith("disk")
    stack = Stack(16, cpu_slots=0 if on_disk else 16, disk_dir=tmp_path if on_disk else None)
    kv = stack.compute(tokens)
    stack.evict_to_tiers()
    meta = stack.metas(tokens)[6]
    if fault == "cpu-discard":
        assert stack.tiers.cpu is not None and stack.tiers.cpu.discard(meta)
    else:
        path = tmp_path / salt_fingerprint(SALT) / (meta.block_hash.hex() + ".kv")
        data = bytearray(path.read_bytes())
        if fault == "disk-corrupt":
            data[-5] ^= 0x40  # one bit of the payload
        else:
            data = data[: len(data) - 100]
        path.write_bytes(bytes(data))
    free_before = stack.pool.num_free
    alloc, computed, _ = load_all(stack, tokens)
    assert computed == 6 * BS  # blocks 0-5 loaded, block 6 is to be computed
    assert all(bit_equal(stack.cache[b], kv[i]) for i, b in enumerate(alloc.block_table))
    assert stack.pool.num_free == free_before - 6  # the blocks for 6-9 went back
    stack.pool.check_invariants([alloc.block_table])
    if on_disk:
        disk = stack.tiers.disk
        assert disk is not None and not disk.contains(meta)  # rejected and removed
        counters = disk.metrics()
        assert counters.corrupt_records == 1 and counters.hits >= 6
    stack.manager.free(alloc)
    assert stack.pool.num_free == stack.pool.num_blocks
    stack.link.close()


def test_demotions_caused_by_the_batch_allocation_cut_the_run_cleanly(tokens: list[int]) -> None:
    """Allocating the run's device blocks demotes other cached blocks into a full CPU tier,
    which evicts the run's own least recently used blocks: the batch misses there."""
    stack = Stack(16, cpu_slots=10)
    kv = stack.compute(tokens)
    stack.evict_to_tiers()  # the CPU tier is now full of the document
    stack.compute([100_000 + t for t in tokens])  # another document, cached on the device
    alloc, computed, _ = load_all(stack, tokens)
    assert 0 < computed < 10 * BS
    assert stack.link.traffic.loaded_from_cpu == computed // BS
    assert stack.link.traffic.discarded_loads == 0  # the demotions took the run's tail
    assert stack.tiers.cpu is not None and stack.tiers.cpu.metrics().misses == 10 - computed // BS
    assert all(bit_equal(stack.cache[b], kv[i]) for i, b in enumerate(alloc.block_table))
    stack.pool.check_invariants([alloc.block_table])
    stack.manager.free(alloc)
    assert stack.pool.num_free == stack.pool.num_blocks


def test_load_budget_bounds_blocks_per_call() -> None:
    stack = Stack(48, cpu_slots=48)
    long_tokens = list(range(40 * BS + 1))
    stack.compute(long_tokens)
    calls_by_budget = {}
    for budget_blocks in (1, 4, 16, 64):
        stack.evict_to_tiers()
        stack.manager.max_load_bytes_per_step = budget_blocks * stack.link.block_nbytes
        assert stack.manager.max_loads_per_step == budget_blocks
        alloc, computed, calls = load_all(stack, long_tokens)
        assert computed == 40 * BS
        calls_by_budget[budget_blocks] = calls - 1  # the last call finds nothing
        stack.manager.free(alloc)
    assert calls_by_budget == {1: 40, 4: 10, 16: 3, 64: 1}
    stack.manager.max_load_bytes_per_step = 1  # below one block: still one block per call
    assert stack.manager.max_loads_per_step == 1
    with pytest.raises(ValueError, match="max_load_bytes_per_step must be >= 1"):
        KVCacheManager(stack.pool, BS, True, tiers=stack.link, max_load_bytes_per_step=0)


def test_the_load_budget_is_shared_by_every_sequence_of_a_step() -> None:
    stack = Stack(48, cpu_slots=48)
    first, second = list(range(10 * BS + 1)), list(range(500, 500 + 10 * BS + 1))
    stack.compute(first)
    stack.compute(second)
    stack.evict_to_tiers()
    stack.manager.max_load_bytes_per_step = 4 * stack.link.block_nbytes
    one, two = stack.alloc(first), stack.alloc(second)
    stack.manager.begin_step()
    assert stack.manager.match_prefix(one, first, 0) == 4 * BS
    assert stack.manager.match_prefix(two, second, 0) == 0  # the step's budget is spent
    stack.manager.begin_step()
    assert stack.manager.match_prefix(two, second, 0) == 4 * BS
    stack.pool.check_invariants([one.block_table, two.block_table])
    stack.manager.free(one)
    stack.manager.free(two)
    assert stack.pool.num_free == stack.pool.num_blocks


def test_disk_batch_through_staging_into_non_contiguous_destinations(tmp_path: Path) -> None:
    """Destinations that cannot be read into directly go through the readers' staging
    buffers; more records than buffers, so each buffer is reused."""
    metas = Stack(1, 0).metas(list(range(9 * BS)))
    with DiskTier(SHAPE, torch.float32, 1 << 22, tmp_path, num_readers=2) as tier:
        for index, meta in enumerate(metas):
            path = tmp_path / record_key(meta).fingerprint / (meta.block_hash.hex() + ".kv")
            path.parent.mkdir(exist_ok=True)
            path.write_bytes(encode_record(meta, block_for(index)))
        backing = torch.zeros((9, *reversed(SHAPE)))
        dests = [backing[i].permute(4, 3, 2, 1, 0) for i in range(9)]
        assert not dests[0].is_contiguous()
        assert tier.load_many_into(metas, dests) == [True] * 9
        assert all(bit_equal(dests[i], block_for(i)) for i in range(9))


@pytest.mark.gpu
def test_async_cpu_batch_to_the_gpu_is_complete_before_slots_are_reused() -> None:
    """Big enough that copies are still in flight when the loop ends; every slot is then
    overwritten at once, which must not reach the loaded blocks."""
    shape = (8, 2, 16, 8, 128)  # 1 MiB in bfloat16
    nbytes = block_nbytes(shape, torch.bfloat16)
    tier = CpuTier(shape, torch.bfloat16, 64 * nbytes)
    assert tier._storage.is_pinned()
    metas = Stack(1, 0).metas(list(range(64 * BS)))
    blocks = torch.randn((64, *shape), generator=torch.Generator().manual_seed(5)).bfloat16()
    for meta, block in zip(metas, blocks, strict=True):
        tier.put(meta, block)
    cache = torch.zeros((80, *shape), dtype=torch.bfloat16, device="cuda")
    rows = [79 - i for i in range(32)] + list(range(32))  # unmerged, then merged runs
    assert tier.load_rows_into(metas, cache, rows) == [True] * 64
    for meta in metas:  # refill every slot with other bytes
        tier.discard(meta)
        tier.put(meta, torch.zeros(shape, dtype=torch.bfloat16))
    loaded = cache[rows].cpu()
    assert torch.equal(loaded.view(torch.uint8), blocks.view(torch.uint8))


@pytest.mark.gpu
def test_disk_batch_to_the_gpu_through_pinned_staging(tmp_path: Path) -> None:
    metas = Stack(1, 0).metas(list(range(12 * BS)))
    with DiskTier(SHAPE, torch.float32, 1 << 22, tmp_path, num_readers=3) as tier:
        for index, meta in enumerate(metas):
            assert tier.put(meta, block_for(index))
        tier.flush()
        cache = torch.zeros((12, *SHAPE), device="cuda")
        assert tier.load_many_into(metas, [cache[11 - i] for i in range(12)]) == [True] * 12
        assert all(bit_equal(cache[11 - i].cpu(), block_for(i)) for i in range(12))


# ------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def doc(smollm_tokenizer: Any) -> list[int]:
    text = ("Section 4. The supplier ships within ten working days of each purchase order and "
            "bears the risk until delivery. ") * 6
    ids = list(smollm_tokenizer.encode(text))
    assert 8 * BLOCK < len(ids) < 14 * BLOCK
    return ids


@pytest.fixture(scope="module")
def reference(smollm_path: str, doc: list[int]) -> list[int]:
    with LLM(smollm_path, enable_prefix_caching=False) as llm:
        return llm.generate([doc + [42, 43]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def cpu_llm(smollm_path: str) -> Iterator[LLM]:
    with LLM(smollm_path, kv_cache_gib=DEVICE_BLOCKS * BLOCK_BYTES / 2**30,
             kv_cpu_gib=64 * BLOCK_BYTES / 2**30) as llm:
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
    llm.engine.tiers.tiers.flush()


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
    assert cpu_llm.engine.tiers is not None and cpu_llm.engine.tiers.tiers.cpu is not None
    traffic = cpu_llm.engine.tiers.traffic
    before = traffic.loaded_from_cpu
    copies_before = cpu_llm.engine.tiers.tiers.cpu.metrics().load_copies
    assert ask(cpu_llm, doc) == (reference, full * BLOCK)
    assert traffic.loaded_from_cpu - before == full and traffic.loaded_from_disk == 0
    # NOTE: the device demotes a document tail first and the CPU tier hands out slots from
    # the top down, so the document lies in ascending slots and comes back in one copy.
    assert cpu_llm.engine.tiers.tiers.cpu.metrics().load_copies - copies_before == 1
    assert_pool_empty(cpu_llm)


def test_engine_recomputes_from_a_block_missing_in_the_cpu_tier(
    cpu_llm: LLM, doc: list[int], reference: list[int]
) -> None:
    ask(cpu_llm, doc)
    demote_everything(cpu_llm)
    engine = cpu_llm.engine
    assert engine.tiers is not None and engine.tiers.tiers.cpu is not None
    alloc = KVAllocation(salt=engine.salt_for(""))
    engine.kv_manager.update_hashes(alloc, doc)
    assert engine.tiers.tiers.cpu.discard(engine.kv_manager._identity(alloc, doc, 3))
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
        engine.add_request("chat", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=40,
                                                                 ignore_eos=True))
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
    with LLM(smollm_path, kv_cache_gib=DEVICE_BLOCKS * BLOCK_BYTES / 2**30,
             kv_disk_gib=64 * BLOCK_BYTES / 2**30, kv_disk_dir=str(tmp_path)) as llm:
        ask(llm, doc)
        demote_everything(llm)
        engine = llm.engine
        assert engine.tiers is not None and engine.tiers.tiers.disk is not None
        disk = engine.tiers.tiers.disk
        if damaged:
            alloc = KVAllocation(salt=engine.salt_for(""))
            engine.kv_manager.update_hashes(alloc, doc)
            corrupt = Path(disk._path(record_key(engine.kv_manager._identity(alloc, doc, 4))))
            data = corrupt.read_bytes()
            corrupt.write_bytes(data[:-9] + bytes([data[-9] ^ 1]) + data[-8:])
            truncated = Path(disk._path(record_key(engine.kv_manager._identity(alloc, doc, 6))))
            truncated.write_bytes(truncated.read_bytes()[: len(data) // 2])
        expected = 4 if damaged else full_blocks(doc)
        assert ask(llm, doc) == (reference, expected * BLOCK)
        assert engine.tiers.traffic.loaded_from_disk == expected
        assert disk.metrics().corrupt_records == (2 if damaged else 0)
        if damaged:
            assert not corrupt.exists() and not truncated.exists()
        assert_pool_empty(llm)
