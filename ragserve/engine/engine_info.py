"""The engine's read-only face: what it is (``EngineInfo``) and how it is doing (``EngineSnapshot``).

Everything above the engine (server, pipelines, load tests, benchmarks) reads the engine
through these values and its request API, never through its scheduler, KV manager, block
pool, model or tiers. Both are frozen copies: holding one holds no engine state, and
reading one never races the engine thread.

The value types they carry (``ModelShape``, ``TierMetrics``, ``TierTraffic``) are
re-exported here, so readers import them from the face alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstore.tier import TierMetrics
from kvstore.tier_stack import TierTraffic
from ragserve.models.llama import ModelShape

__all__ = [
    "EngineInfo",
    "EngineSnapshot",
    "KVBlockUsage",
    "KVModel",
    "ModelShape",
    "TierMetrics",
    "TierTraffic",
]


@dataclass(frozen=True)
class KVModel:
    """What a KV block's hash depends on besides its tokens and tenant: equal values mean
    equal KV for equal tokens. Kept by the document registry, so a later server with
    another model can still find (and purge) the blocks this one wrote."""

    fingerprint: str
    block_size: int
    kv_dtype: str  # the KV format's name, e.g. "float32" or "fp8_e4m3/slot_f32_scales"


@dataclass(frozen=True)
class EngineInfo:
    """What the engine is: fixed for its life, built once at start-up.

    Tier fields are resolved: ``disk_tier_dir`` is the directory the disk tier writes to
    (its default applied), and budgets are the bytes each tier really holds. A tier that
    is off has None in its fields.
    """

    model_name: str
    model_fingerprint: str  # equal fingerprints mean equal KV for equal tokens
    device: torch.device
    dtype: torch.dtype
    model_shape: ModelShape
    weight_bytes: int  # the model's parameters as stored: FP8 codes and scales when quantized
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    block_size: int
    num_kv_blocks: int  # device KV blocks
    kv_bytes_per_block: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    attention_backend: str
    cpu_tier_bytes: int | None
    disk_tier_dir: Path | None
    disk_tier_bytes: int | None
    # The key file disk records are encrypted under (None: stored in the clear).
    disk_tier_key_file: str | None = None
    # The remote tier's store (password redacted); its capacity is the store's own.
    remote_tier_url: str | None = None
    # How KV is stored (``kernels/fp8_kv.KVFormat.name``); the block-hash salt binds it.
    kv_dtype: str = ""
    # How the decoder's linear weights are stored: "none" (the model's dtype) or "fp8".
    quantization: str = "none"

    @property
    def kv_model(self) -> KVModel:
        kv_dtype = self.kv_dtype or str(self.dtype).removeprefix("torch.")
        return KVModel(self.model_fingerprint, self.block_size, kv_dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_block // self.block_size

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the device KV cache."""
        return self.num_kv_blocks * self.kv_bytes_per_block

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the device KV cache holds when full."""
        return self.num_kv_blocks * self.block_size


@dataclass(frozen=True)
class KVBlockUsage:
    """Device KV blocks by state. ``used``: held by requests (pinned blocks not counted);
    ``cached``: indexed in the prefix cache (in use or free); ``free``: not referenced."""

    total: int
    used: int
    pinned: int
    cached: int
    free: int

    def by_state(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class EngineSnapshot:
    """How the engine is doing: counters read on the engine thread in one go, as copies.

    Counters (tokens, steps, preemptions, tier traffic) grow over the engine's life;
    the rest is the state at the moment of reading. ``tier_metrics`` holds one ``TierMetrics``
    per tier below the device (empty without tiers); ``tier_traffic`` is None without tiers.
    """

    running: int  # sequences in the running batch
    waiting: int  # sequences waiting to be scheduled
    requests_in_flight: int  # requests added and not finished or aborted
    kv_blocks: KVBlockUsage
    queried_tokens: int  # prompt tokens looked up in the prefix cache at admission
    hit_tokens: int  # of those, tokens found cached
    prompt_tokens_computed: int  # prompt tokens run through the model (cache misses)
    generated_tokens: int
    steps: int
    steps_ahead: int  # steps launched before the previous step's tokens were read
    preemptions: int
    kv_utilisation: float  # time-averaged share of allocated KV slots that hold a token
    tier_metrics: Mapping[str, TierMetrics]
    tier_traffic: TierTraffic | None

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the cache / prompt tokens looked up (0 before any)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
