"""Engine configuration: one frozen object, validated once at the edge."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF directory, .gguf file, or None for the embedded default
    tokenizer: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    seed: int = 0
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None
    kv_cache_gib: float | None = None  # device KV budget; None: derived from the device
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    attention_backend: str | None = None
    kv_cpu_gib: float = 0.0
    kv_disk_dir: str | None = None
    kv_disk_gib: float = 0.0
    kv_load_gib_per_step: float = 1.0  # tier-to-device loads per step, all sequences together
    max_waiting_requests: int = 1024
    enforce_eager: bool = False  # no CUDA graphs for decode batches
    # Launch the next decode step before reading this one's tokens (host work overlaps
    # the device's). None: on CUDA only; on the CPU it only adds work.
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        checks = {
            "block_size": (self.block_size, 1),
            "max_num_batched_tokens": (self.max_num_batched_tokens, 1),
            "max_num_seqs": (self.max_num_seqs, 1),
        }
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
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(
                f"load_format must be auto, safetensors, gguf or dummy, got {self.load_format!r}"
            )
        if self.kv_load_gib_per_step <= 0:
            raise ValueError(f"kv_load_gib_per_step must be > 0, got {self.kv_load_gib_per_step}")
        if self.kv_cpu_gib < 0 or self.kv_disk_gib < 0:
            raise ValueError("kv_cpu_gib and kv_disk_gib must be >= 0")
