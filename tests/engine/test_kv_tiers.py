"""The engine with CPU and disk tiers: evicted and persisted blocks come back, bit-exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvstore.disk_tier import DiskTier
from ragserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK = 16
BLOCK_BYTES = BLOCK * 46080  # SmolLM2, float32
DEVICE_BLOCKS = 24


@pytest.fixture(scope="module")
def doc(smollm_tokenizer: Any) -> list[int]:
    text = (
        "Clause 7. Either party may end this agreement with thirty days' written notice, "
        "provided all invoices are settled. "
    ) * 6
    ids = list(smollm_tokenizer.encode(text))
    assert 8 * BLOCK < len(ids) < 14 * BLOCK
    return ids


@pytest.fixture(scope="module")
def reference(smollm_path: str, doc: list[int]) -> list[int]:
    llm = LLM(smollm_path, enable_prefix_caching=False)
    return llm.generate([doc + [42, 43]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def evict_device_cache(llm: LLM) -> None:
    """Run an unrelated prompt that needs every device block, pushing the document out."""
    filler = [1000 + i for i in range((DEVICE_BLOCKS - 1) * BLOCK)]
    llm.generate([filler], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    assert llm.engine.block_pool.num_evictions > 0


def ask(llm: LLM, doc: list[int]) -> tuple[list[int], int]:
    out = llm.generate([doc + [42, 43]], GREEDY, use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def ingest_and_stop(smollm_path: str, doc: list[int], tiers: dict[str, Any]) -> None:
    """An engine computes the document, writing its blocks through to disk, then shuts down."""
    with LLM(smollm_path, **tiers) as llm:
        llm.engine.add_request("ingest", doc, SamplingParams(max_tokens=1), persist=True)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()


def small_engine(smollm_path: str, **tiers: Any) -> LLM:
    return LLM(smollm_path, kv_cache_gib=DEVICE_BLOCKS * BLOCK_BYTES / 2**30, **tiers)


@pytest.mark.slow
def test_prefix_from_device_cpu_and_disk_gives_identical_outputs(
    smollm_path: str, doc: list[int], reference: list[int], tmp_path: Path
) -> None:
    full_block_tokens = len(doc) // BLOCK * BLOCK

    device = small_engine(smollm_path)
    ask(device, doc)
    assert ask(device, doc) == (reference, full_block_tokens)

    cpu = small_engine(smollm_path, kv_cpu_gib=64 * BLOCK_BYTES / 2**30)
    ask(cpu, doc)
    evict_device_cache(cpu)
    assert ask(cpu, doc) == (reference, full_block_tokens)
    assert (
        cpu.engine.tiers is not None
        and cpu.engine.tiers.traffic.loaded_from_cpu >= len(doc) // BLOCK - 2
    )

    disk = small_engine(
        smollm_path, kv_disk_gib=64 * BLOCK_BYTES / 2**30, kv_disk_dir=str(tmp_path)
    )
    ask(disk, doc)
    evict_device_cache(disk)
    assert disk.engine.tiers is not None
    disk.engine.tiers.flush()  # demotions are written asynchronously
    assert ask(disk, doc) == (reference, full_block_tokens)
    assert disk.engine.tiers.traffic.loaded_from_disk >= len(doc) // BLOCK - 2
    for llm in (device, cpu, disk):
        llm.engine.block_pool.check_invariants()
        llm.close()


@pytest.mark.slow
def test_a_written_through_document_is_demoted_to_the_cpu_tier_too(
    smollm_path: str, doc: list[int], reference: list[int], tmp_path: Path
) -> None:
    """Already on disk is no reason to skip the CPU tier: it is the faster way back."""
    llm = small_engine(
        smollm_path,
        kv_cpu_gib=64 * BLOCK_BYTES / 2**30,
        kv_disk_gib=64 * BLOCK_BYTES / 2**30,
        kv_disk_dir=str(tmp_path),
    )
    llm.engine.add_request("ingest", doc, SamplingParams(max_tokens=1), persist=True)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.engine.tiers is not None
    llm.engine.tiers.flush()
    evict_device_cache(llm)
    assert ask(llm, doc) == (reference, len(doc) // BLOCK * BLOCK)
    traffic = llm.engine.tiers.traffic
    assert traffic.loaded_from_cpu >= len(doc) // BLOCK - 2 and traffic.loaded_from_disk == 0
    llm.close()


@pytest.mark.slow
def test_restart_serves_a_persisted_document_from_disk(
    smollm_path: str, doc: list[int], reference: list[int], tmp_path: Path
) -> None:
    tiers = {"kv_disk_gib": 0.05, "kv_disk_dir": str(tmp_path)}
    ingest_and_stop(smollm_path, doc, tiers)
    assert len(list(tmp_path.rglob("*.kv"))) + len(list(tmp_path.rglob("*"))) > len(doc) // BLOCK

    with LLM(smollm_path, **tiers) as second:
        tokens, cached = ask(second, doc)
        assert cached >= len(doc) // BLOCK * BLOCK
        assert tokens == reference
        assert second.engine.tiers is not None
        assert second.engine.tiers.traffic.loaded_from_disk == len(doc) // BLOCK


@pytest.mark.slow
def test_corrupt_records_after_restart_are_recomputed_not_served(
    smollm_path: str, doc: list[int], reference: list[int], tmp_path: Path
) -> None:
    tiers = {"kv_disk_gib": 0.05, "kv_disk_dir": str(tmp_path)}
    ingest_and_stop(smollm_path, doc, tiers)
    records = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert records
    for record in records[::2]:  # flip a byte in the middle of every other record
        data = bytearray(record.read_bytes())
        data[len(data) // 2] ^= 0xFF
        record.write_bytes(bytes(data))

    with LLM(smollm_path, **tiers) as second:
        tokens, _ = ask(second, doc)
        assert tokens == reference
        assert second.engine.tiers is not None
        assert second.engine.tiers.metrics()["disk"].corrupt_records >= 1
    assert sum(1 for p in tmp_path.rglob("*") if p.is_file()) < len(records) + 1


@pytest.mark.slow
def test_unusable_disk_directory_is_a_clear_error(smollm_path: str, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="KV disk directory"):
        LLM(smollm_path, kv_disk_gib=0.01, kv_disk_dir=str(blocker / "kv"))


@pytest.mark.slow
def test_a_document_larger_than_the_write_queue_is_persisted_whole(
    smollm_path: str, doc: list[int], tmp_path: Path
) -> None:
    """Write-through never drops a document's blocks: what the queue cannot take waits."""
    long_doc = doc * 4  # about 36 blocks, against a write queue of 64 shared with the rest
    with LLM(smollm_path, kv_disk_gib=0.05, kv_disk_dir=str(tmp_path)) as llm:
        assert llm.engine.tiers is not None
        [disk] = llm.engine.tiers.tiers
        assert isinstance(disk, DiskTier)
        disk._writer._queue.maxsize = 4  # a tiny queue, so most blocks wait
        llm.engine.add_request("ingest", long_doc, SamplingParams(max_tokens=1), persist=True)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    records = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(records) == len(long_doc) // BLOCK
