"""Engine configuration: one frozen object, validated once at the edge."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ragserve.config_flags import check_choices, option

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# NOTE: the same names as kernels.fp8_kv.KV_CACHE_DTYPES; the config stays free of torch.
KV_CACHE_DTYPES = ("auto", "fp8", "int8")
# NOTE: the same names as ragserve.models.llama.QUANTIZATIONS, for the same reason.
QUANTIZATIONS = ("none", "fp8")
# The disk tier's budget when --kv-disk-dir is given without --kv-disk-gib.
DEFAULT_DISK_GIB = 16.0
# Tokens one step computes at most, by device type, when --max-num-batched-tokens is not
# given. NOTE: measured on an NVIDIA H200 (BENCHMARKS.md, FP8 weights): 8,192-token steps
# gave 8-9% more batch throughput than 2,048 (prefill runs eagerly, so fewer and larger
# steps pay fewer launches), while a step of decodes and one 8,192-token chunk of an 8B
# model still ends in about 0.2 s. On two CPU cores a 2,048-token step takes seconds.
DEFAULT_STEP_TOKENS = {"cpu": 2048, "cuda": 8192}
# The same for offline work (the LLM class: generate, chat, pipelines), where no stream
# waits behind a long step. NOTE: as vLLM's CPU defaults (4,096 offline, 2,048 serving): on
# a 2-core AMD EPYC a 32 x (256 in, 64 out) bf16 batch of SmolLM2 took 0.95-0.98x the time
# in 4,096-token steps (two engines in one process, batches alternated, two runs).
OFFLINE_STEP_TOKENS = {"cpu": 4096, "cuda": 8192}


_REAL_FIELDS = (
    "kv_cache_gib",
    "gpu_memory_utilization",
    "kv_cpu_gib",
    "kv_disk_gib",
    "kv_remote_timeout_s",
    "kv_remote_retry_s",
    "kv_load_gib_per_step",
    "blend_recompute_ratio",
)


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes an engine. Each field is also a command-line flag of every
    command that builds one (see :mod:`ragserve.config_flags`)."""

    model: str | None = option(
        None, help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)"
    )
    tokenizer: str | None = option(None, help="tokenizer directory (default: the model's)")
    dtype: str = option("auto", help="weights and activations", choices=DTYPES)
    quantization: str = option(
        "none",
        help="decoder linear weights: none (the model's dtype) or fp8 (e4m3 with a float32 "
        "scale per output channel, activations scaled per token at run time; embeddings and "
        "LM head keep the model's dtype); a checkpoint stored in FP8 is always served in FP8",
        choices=QUANTIZATIONS,
    )
    device: str = option("auto", help="auto, cpu, cuda or cuda:N")
    load_format: str = option("auto", help="how to read --model", choices=LOAD_FORMATS)
    seed: int = option(0, help="seed of dummy weights and of sampling")
    block_size: int = option(16, help="tokens per KV block (a power of two)")
    max_num_batched_tokens: int | None = option(
        None,
        help="tokens one step computes at most (default: "
        + ", ".join(f"{n} on {d}" for d, n in DEFAULT_STEP_TOKENS.items())
        + "; offline, as the LLM class runs: "
        + ", ".join(f"{n} on {d}" for d, n in OFFLINE_STEP_TOKENS.items())
        + ")",
    )
    max_num_seqs: int = option(256, help="sequences running at once at most")
    max_model_len: int | None = option(None, help="longest sequence (default: the model's)")
    kv_cache_gib: float | None = option(
        None, help="device KV budget in GiB (default: derived from the device)"
    )
    gpu_memory_utilization: float = option(
        0.9, help="share of the GPU's memory the engine may use, KV included"
    )
    kv_cache_dtype: str = option(
        "auto",
        help="KV cache storage: auto (the model's dtype), fp8 (e4m3 with a float32 scale "
        "per token and KV head: about half of bf16's bytes) or int8 (int8 codes with a "
        "float32 scale per token and KV head: the same bytes as fp8, within the model "
        "dtype's own rounding noise where fp8 is five times further off)",
        choices=KV_CACHE_DTYPES,
    )
    enable_prefix_caching: bool = option(
        True, help="reuse cached KV blocks of shared prefixes", flag="--prefix-caching"
    )
    attention_backend: str | None = option(
        None,
        help="reference, cpu or triton (default: the best one on the device that reads "
        "the KV cache dtype)",
    )
    kv_cpu_gib: float = option(0.0, help="host memory tier for KV blocks evicted from the device")
    kv_disk_dir: str | None = option(
        None,
        help="disk tier folder; given alone it turns the disk tier on with a "
        f"{DEFAULT_DISK_GIB:g} GiB budget (default folder: $XDG_CACHE_HOME/ragserve/kv or "
        "~/.cache/ragserve/kv)",
    )
    kv_disk_gib: float | None = option(
        None,
        help="disk tier for KV blocks, kept across restarts (default: "
        f"{DEFAULT_DISK_GIB:g} with --kv-disk-dir, else no disk tier; 0 turns it off)",
    )
    kv_encryption_key_file: str | None = option(
        None,
        help="encrypt disk and remote tier records at rest (AES-256-GCM, a key derived per "
        "tenant) under the key in this file (at least 32 bytes); a wrong or missing key only "
        "misses; given without --kv-remote-url it turns the disk tier on like --kv-disk-dir",
    )
    kv_remote_url: str | None = option(
        None,
        help="remote tier in a Redis-protocol store shared by engines "
        "(redis://[:PASSWORD@]HOST:PORT/DB, rediss:// for TLS, unix://PATH; Valkey and Redis "
        "alike): read after the CPU and disk tiers, given every block that leaves the device "
        "and every document's blocks; give the store a maxmemory and allkeys-lru",
    )
    kv_remote_timeout_s: float = option(
        0.5, help="time-out of one round trip to the remote tier's store (then: a miss)"
    )
    kv_remote_retry_s: float = option(
        5.0,
        help="after repeated failures the remote tier stops calling its store for this long, "
        "then tries again",
    )
    kv_load_gib_per_step: float = option(
        1.0,
        help="KV loaded from the CPU/disk tiers per step, all sequences together "
        "(the rest streams in later steps)",
    )
    kv_reuse: str = option(
        "prefix",
        help="default reuse of document KV: prefix (exact prefix hits only) or blend (also "
        "documents at other positions, with a selected fraction recomputed)",
        choices=("prefix", "blend"),
    )
    blend_recompute_ratio: float = option(
        0.15, help="share of each blended document's tokens recomputed (1: a full prefill)"
    )
    enforce_eager: bool = option(False, help="run decode steps eagerly (no CUDA graphs)")
    # NOTE: on the CPU overlapping only adds work, hence the default.
    async_scheduling: bool | None = option(
        None,
        help="launch each decode step before reading the previous one's tokens, so host "
        "work overlaps the device's (default: on CUDA)",
    )

    def __post_init__(self) -> None:
        for name in _REAL_FIELDS:
            value = getattr(self, name)
            # NOTE: NaN passes every comparison below, and an infinite size overflows later.
            if value is not None and not (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(value)
            ):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        checks = {
            "block_size": (self.block_size, 1),
            "max_num_seqs": (self.max_num_seqs, 1),
        }
        if self.max_num_batched_tokens is not None:
            checks["max_num_batched_tokens"] = (self.max_num_batched_tokens, 1)
        for name, (value, low) in checks.items():
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        check_choices(self)
        if not 0.0 <= self.blend_recompute_ratio <= 1.0:
            raise ValueError(
                f"blend_recompute_ratio must be in [0, 1], got {self.blend_recompute_ratio}"
            )
        if self.kv_load_gib_per_step <= 0:
            raise ValueError(f"kv_load_gib_per_step must be > 0, got {self.kv_load_gib_per_step}")
        if self.kv_cpu_gib < 0 or (self.kv_disk_gib is not None and self.kv_disk_gib < 0):
            raise ValueError("kv_cpu_gib and kv_disk_gib must be >= 0")
        # NOTE: combinations that used to be silently ignored are refused here.
        if self.kv_disk_gib == 0 and self.kv_disk_dir:
            raise ValueError(
                "kv_disk_dir names a disk tier that kv_disk_gib=0 turns off; drop one of them"
            )
        if self.kv_encryption_key_file and self.kv_disk_gib == 0:
            raise ValueError(
                "kv_encryption_key_file encrypts the disk tier that kv_disk_gib=0 turns off"
            )
        if self.kv_remote_timeout_s <= 0 or self.kv_remote_retry_s < 0:
            raise ValueError(
                "kv_remote_timeout_s must be > 0 and kv_remote_retry_s >= 0, got "
                f"{self.kv_remote_timeout_s}, {self.kv_remote_retry_s}"
            )
        if not self.enable_prefix_caching and (
            self.kv_cpu_gib > 0 or self.disk_tier_gib > 0 or self.kv_remote_url
        ):
            raise ValueError(
                "the CPU, disk and remote KV tiers hold prefix-cache blocks: they need prefix "
                "caching (drop --no-prefix-caching, or the --kv-cpu-gib / --kv-disk-* / "
                "--kv-remote-url flags)"
            )

    def for_device(self, device_type: str, *, offline: bool = False) -> EngineConfig:
        """This config with what it leaves to the device filled in for ``device_type``
        (``cpu`` or ``cuda``): the step size (``DEFAULT_STEP_TOKENS``, or
        ``OFFLINE_STEP_TOKENS`` for an engine that serves no streams)."""
        if self.max_num_batched_tokens is not None:
            return self
        steps = OFFLINE_STEP_TOKENS if offline else DEFAULT_STEP_TOKENS
        return replace(self, max_num_batched_tokens=steps[device_type])

    @property
    def step_tokens(self) -> int:
        """``max_num_batched_tokens`` of a config that :meth:`for_device` filled in."""
        assert self.max_num_batched_tokens is not None, "call for_device first"
        return self.max_num_batched_tokens

    @property
    def disk_tier_gib(self) -> float:
        """The disk tier's budget: ``kv_disk_gib``, else ``DEFAULT_DISK_GIB`` when
        ``kv_disk_dir`` asks for a disk tier (or ``kv_encryption_key_file`` does, without a
        remote tier to encrypt), else 0 (none)."""
        if self.kv_disk_gib is not None:
            return self.kv_disk_gib
        wanted = self.kv_disk_dir or (self.kv_encryption_key_file and not self.kv_remote_url)
        return DEFAULT_DISK_GIB if wanted else 0.0
