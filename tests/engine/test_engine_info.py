"""The engine's read-only face: ``info`` (what it is) and ``snapshot()`` (how it is doing),
on the offline ``LLM`` and on ``AsyncEngine``."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest

from ragserve import LLM, SamplingParams
from ragserve.config import EngineConfig
from ragserve.engine.async_engine import AsyncEngine, EngineDeadError

BLOCK_BYTES = 16 * 46080  # SmolLM2-135M, float32: 30 layers x K,V x 3 heads x 64 x 4 bytes
GIB = 2**30


@pytest.mark.slow
def test_info_and_snapshot_of_the_offline_engine(
    smollm_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the disk tier's default directory
    cpu_gib, disk_gib = 8.5 * BLOCK_BYTES / GIB, 32 * BLOCK_BYTES / GIB
    llm = LLM(
        smollm_path,
        max_model_len=256,
        kv_cache_gib=64 * BLOCK_BYTES / GIB,
        kv_cpu_gib=cpu_gib,
        kv_disk_gib=disk_gib,
    )
    try:
        info, engine = llm.info, llm.engine
        assert info.model_name == engine.model_name == Path(smollm_path).stem
        assert info.model_fingerprint == engine.loaded.fingerprint
        assert info.device.type == "cpu" and info.dtype == engine.dtype
        assert info.model_shape == engine.loaded.shape
        params = engine.loaded.model.parameters()
        assert info.weight_bytes == sum(p.numel() * p.element_size() for p in params)
        assert info.eos_token_ids == tuple(engine.eos_token_ids)
        assert (info.max_model_len, info.block_size, info.num_kv_blocks) == (256, 16, 64)
        assert info.kv_bytes_per_block == BLOCK_BYTES
        assert info.kv_bytes_per_token == BLOCK_BYTES // 16
        assert info.kv_cache_bytes == engine.kv_cache.nbytes and info.kv_cache_tokens == 64 * 16
        # the LLM class runs offline: its CPU steps default to 4,096 tokens
        assert (info.max_num_seqs, info.max_num_batched_tokens) == (256, 4096)
        assert info.enable_prefix_caching and info.attention_backend
        assert info.cpu_tier_bytes == 8 * BLOCK_BYTES  # whole blocks of the budget
        assert info.disk_tier_dir == tmp_path / "ragserve" / "kv"
        assert info.disk_tier_bytes == int(disk_gib * GIB)
        with pytest.raises(dataclasses.FrozenInstanceError):
            info.block_size = 32  # type: ignore[misc]

        idle = llm.snapshot()
        assert (idle.running, idle.waiting, idle.requests_in_flight, idle.steps) == (0, 0, 0, 0)
        empty = {"total": 64, "used": 0, "pinned": 0, "cached": 0, "free": 64}
        assert idle.kv_blocks.by_state() == empty
        assert idle.hit_rate == 0.0 and set(idle.tier_metrics) == {"cpu", "disk"}
        assert idle.tier_traffic is not None and idle.tier_traffic.demoted == 0

        prompt = list(range(100, 140))  # two full blocks and a partial one
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        llm.generate([prompt], params, use_tqdm=False)
        first = llm.snapshot()
        llm.generate([prompt], params, use_tqdm=False)
        second = llm.snapshot()
        assert (first.queried_tokens, first.hit_tokens) == (40, 0)
        assert (second.queried_tokens, second.hit_tokens) == (80, 32)
        assert (first.prompt_tokens_computed, second.prompt_tokens_computed) == (40, 48)
        assert second.hit_rate == 32 / 80
        assert (first.generated_tokens, second.generated_tokens) == (3, 6)
        assert second.steps > first.steps > 0 and 0.0 < second.kv_utilisation <= 1.0
        assert first.kv_blocks.used == 0 and first.kv_blocks.cached >= 2
        assert first.requests_in_flight == 0 and second.preemptions == 0
        assert (first.queried_tokens, first.generated_tokens) == (40, 3), "a snapshot is a copy"

        assert engine.pin_prefix("doc", prompt) == 32
        assert llm.snapshot().kv_blocks.pinned == 2
        assert engine.unpin_prefix("doc")
    finally:
        llm.close()
    assert llm.snapshot().tier_metrics == {} and llm.snapshot().tier_traffic is None


@pytest.mark.slow
def test_info_without_tiers_has_none_for_them(smollm_path: str) -> None:
    llm = LLM(
        smollm_path,
        max_model_len=128,
        kv_cache_gib=16 * BLOCK_BYTES / GIB,
        enable_prefix_caching=False,
    )
    info = llm.info
    assert (info.cpu_tier_bytes, info.disk_tier_dir, info.disk_tier_bytes) == (None, None, None)
    assert not info.enable_prefix_caching
    snapshot = llm.snapshot()
    assert snapshot.tier_metrics == {} and snapshot.tier_traffic is None
    llm.close()


@pytest.mark.slow
def test_the_async_face_answers_and_fails_cleanly(smollm_path: str) -> None:
    async def run() -> None:
        engine = AsyncEngine(
            EngineConfig(model=smollm_path, max_model_len=128, kv_cache_gib=16 * BLOCK_BYTES / GIB)
        )
        try:
            assert engine.info is engine.engine.info
            assert engine.info.num_kv_blocks == 16
            prompt = list(range(200, 236))
            params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
            outputs = [out async for out in engine.generate(prompt, params)]
            assert outputs[-1].finished
            snapshot = await engine.snapshot()
            assert (snapshot.generated_tokens, snapshot.prompt_tokens_computed) == (2, 36)
            assert await engine.pin_prefix("doc", prompt) == 32
            assert (await engine.snapshot()).kv_blocks.pinned == 2
            assert await engine.unpin_prefix("doc")
            assert not await engine.unpin_prefix("doc")

            # An engine thread that does not answer in time reads as dead.
            busy = asyncio.ensure_future(engine.call(lambda _: time.sleep(1.0)))
            await asyncio.sleep(0.1)
            with pytest.raises(EngineDeadError, match="did not answer"):
                await engine.snapshot(timeout=0.1)
            await busy
        finally:
            await engine.shutdown()
        with pytest.raises(EngineDeadError, match="not running"):
            await engine.snapshot()
        with pytest.raises(EngineDeadError):
            await engine.pin_prefix("doc", [1, 2, 3])

    asyncio.run(run())
