"""The engine's read-only face, built from its parts: ``EngineInfo`` once, ``EngineSnapshot``
on demand (see :mod:`ragserve.engine.engine_info` for what each holds and why)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from kvstore.tier import TierMetrics
from kvstore.tier_stack import TierStack, TierTraffic
from ragserve.engine.engine_info import EngineInfo, EngineSnapshot, KVBlockUsage

if TYPE_CHECKING:
    from ragserve.engine.llm_engine import LLMEngine


class TierReading(NamedTuple):
    """What the face reports of the tiers below the device (all copies)."""

    metrics: dict[str, TierMetrics]
    traffic: TierTraffic | None
    disk_dir: Path | None
    remote_url: str | None  # password redacted


def read_tiers(tiers: TierStack | None) -> TierReading:
    """The one place the face reads the tier stack."""
    if tiers is None:
        return TierReading({}, None, None, None)
    where = {t.name: t.location for t in tiers.describe() if t.location}
    disk_dir = Path(where["disk"]) if "disk" in where else None
    return TierReading(
        tiers.metrics(), dataclasses.replace(tiers.traffic), disk_dir, where.get("remote")
    )


def make_info(engine: LLMEngine, attention_backend: str) -> EngineInfo:
    config = engine.config
    loaded = engine.loaded
    tiers = read_tiers(engine.tiers)
    cpu, disk = tiers.metrics.get("cpu"), tiers.metrics.get("disk")
    return EngineInfo(
        model_name=engine.model_name,
        model_fingerprint=loaded.fingerprint,
        device=engine.device,
        dtype=engine.dtype,
        model_shape=loaded.model.shape,
        weight_bytes=sum(p.numel() * p.element_size() for p in loaded.model.parameters()),
        eos_token_ids=tuple(engine.eos_token_ids),
        max_model_len=engine.max_model_len,
        block_size=config.block_size,
        num_kv_blocks=engine.num_kv_blocks,
        kv_bytes_per_block=engine.kv_spec.bytes_per_block,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.step_tokens,
        enable_prefix_caching=config.enable_prefix_caching,
        attention_backend=attention_backend,
        cpu_tier_bytes=cpu.capacity_bytes if cpu is not None else None,
        disk_tier_dir=tiers.disk_dir,
        disk_tier_key_file=config.kv_encryption_key_file if tiers.disk_dir else None,
        disk_tier_bytes=disk.capacity_bytes if disk is not None else None,
        remote_tier_url=tiers.remote_url,
        kv_dtype=engine.kv_format.name,
        quantization=loaded.quantization,
    )


def take_snapshot(engine: LLMEngine) -> EngineSnapshot:
    """The engine's counters, copied; call it on the thread that steps the engine."""
    counters = engine.kv_manager.counters
    stats = engine.stats
    scheduler = engine.scheduler
    tiers = read_tiers(engine.tiers)
    return EngineSnapshot(
        running=len(scheduler.running),
        waiting=len(scheduler.waiting),
        requests_in_flight=engine.num_requests,
        kv_blocks=KVBlockUsage(**engine.kv_usage()),
        queried_tokens=counters.queried_tokens,
        hit_tokens=counters.hit_tokens,
        prompt_tokens_computed=stats.prompt_tokens_computed,
        generated_tokens=stats.generated_tokens,
        steps=stats.steps,
        steps_ahead=stats.steps_ahead,
        preemptions=scheduler.num_preemptions,
        kv_utilisation=stats.kv_utilisation,
        tier_metrics=tiers.metrics,
        tier_traffic=tiers.traffic,
    )
