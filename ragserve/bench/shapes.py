"""Real model shapes for benchmarks with random weights (``load_format="dummy"``), and the
hardware floors derived from a shape: FLOPs of a prefill, bytes read by a decode step."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from ragserve.engine.engine_info import ModelShape

LLAMA_3_1_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}

# The 8B's structure (GQA, llama3 RoPE, untied head) at a size that runs in seconds on a CPU:
# the GPU benchmark commands are tested end to end with it.
TINY_LLAMA: dict[str, Any] = LLAMA_3_1_8B | {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 8192,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "rope_scaling": LLAMA_3_1_8B["rope_scaling"] | {"original_max_position_embeddings": 1024},
}

# Llama-3.1-70B: in FP8 (``--quantization fp8``) its ~70 GB of weights and ~2 GB of bf16
# embedding and LM head fit one 141 GB H200 with room for KV.
LLAMA_3_1_70B: dict[str, Any] = LLAMA_3_1_8B | {
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
}

SHAPES = {
    "llama-3.1-8b": LLAMA_3_1_8B,
    "llama-3.1-70b": LLAMA_3_1_70B,
    "tiny-llama": TINY_LLAMA,
}


def write_shape_config(name: str, min_model_len: int | None = None) -> str:
    """A directory holding only ``config.json`` of the named shape.

    ``min_model_len`` raises ``max_position_embeddings`` when a benchmark needs longer
    sequences than the shape allows (a 131,072-token prompt plus its question or decode
    tokens). With llama3 RoPE the frequencies depend only on
    ``original_max_position_embeddings``, so nothing else about the model changes.
    """
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {sorted(SHAPES)}")
    config = dict(SHAPES[name])
    if min_model_len is not None and min_model_len > config["max_position_embeddings"]:
        config["max_position_embeddings"] = -(-min_model_len // 1024) * 1024
    directory = Path(tempfile.mkdtemp(prefix=f"ragserve-{name}-"))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return str(directory)


def linear_params(shape: ModelShape) -> int:
    """Weights of the decoder's projections (q, k, v, o, gate, up, down) in all layers."""
    q_out = shape.num_heads * shape.head_dim
    kv_out = shape.num_kv_heads * shape.head_dim
    attention = shape.hidden_size * (q_out + 2 * kv_out) + q_out * shape.hidden_size
    mlp = 3 * shape.hidden_size * shape.intermediate_size
    return shape.num_layers * (attention + mlp)


def linear_output_channels(shape: ModelShape) -> int:
    """Output channels of the decoder's projections in all layers: one FP8 scale each."""
    q_out = shape.num_heads * shape.head_dim
    kv_out = shape.num_kv_heads * shape.head_dim
    attention = q_out + 2 * kv_out + shape.hidden_size
    mlp = 2 * shape.intermediate_size + shape.hidden_size
    return shape.num_layers * (attention + mlp)


def non_embedding_params(shape: ModelShape) -> int:
    """Parameters of the decoder layers and the final norm: the matrices every token passes.

    Excludes the input embedding (a lookup) and the LM head (run for one token per prefill;
    counted separately by the callers that need it).
    """
    return linear_params(shape) + (2 * shape.num_layers + 1) * shape.hidden_size


def prefill_flops(shape: ModelShape, tokens: int, context: int = 0) -> float:
    """FLOPs to prefill ``tokens`` new tokens after ``context`` cached ones, one logits row.

    2 x non-embedding params per token, plus causal attention: each new token at position
    p attends to p + 1 keys with one QK^T and one PV product of ``head_dim`` each.
    """
    linear = 2.0 * non_embedding_params(shape) * tokens
    # sum over new positions of (context + i + 1), i in [0, tokens)
    key_visits = tokens * context + tokens * (tokens + 1) / 2
    attention = 4.0 * key_visits * shape.num_heads * shape.head_dim * shape.num_layers
    head = 2.0 * shape.vocab_size * shape.hidden_size
    return linear + attention + head


def generate_flops(shape: ModelShape, input_len: int, output_len: int) -> float:
    """FLOPs of one request: its prefill, then ``output_len - 1`` decode steps with logits."""
    steps = max(0, output_len - 1)
    per_token = 2.0 * non_embedding_params(shape) + 2.0 * shape.vocab_size * shape.hidden_size
    # decode step s (1-based) attends to input_len + s keys
    key_visits = steps * input_len + steps * (steps + 1) / 2
    attention = 4.0 * key_visits * shape.num_heads * shape.head_dim * shape.num_layers
    return prefill_flops(shape, input_len) + steps * per_token + attention


def linear_flops(shape: ModelShape, tokens: float) -> float:
    """The decoder projections' share of the FLOPs of ``tokens`` tokens: the matmuls that
    FP8 weights run at the FP8 rate (attention and the LM head stay in the model's dtype)."""
    return 2.0 * linear_params(shape) * tokens


def compute_floor_s(
    flops: float, fp8_flops: float, peak_tflops: float, fp8_peak_tflops: float | None
) -> float:
    """``flops`` at the matmul ceiling, of which ``fp8_flops`` at the FP8 one (when given)."""
    if fp8_peak_tflops is None:
        return flops / (peak_tflops * 1e12)
    return (flops - fp8_flops) / (peak_tflops * 1e12) + fp8_flops / (fp8_peak_tflops * 1e12)


def decode_weight_bytes(shape: ModelShape, itemsize: int, quantization: str = "none") -> int:
    """Weight bytes one decode step reads: the decoder layers, the final norm and the LM head.

    With ``quantization="fp8"`` the projections read one byte per weight plus a float32
    scale per output channel; norms and the LM head stay at ``itemsize``.

    NOTE: the input embedding is a lookup of one row per token, so an untied embedding
    table (1.05 GB in Llama-3.1-8B) is not read; a tied one is read as the LM head.
    """
    head = shape.vocab_size * shape.hidden_size
    if quantization == "fp8":
        norms = non_embedding_params(shape) - linear_params(shape)
        linear = linear_params(shape) + 4 * linear_output_channels(shape)
        return linear + (norms + head) * itemsize
    return (non_embedding_params(shape) + head) * itemsize


def decode_floor_s(weight_bytes: int, kv_bytes: int, peak_tbps: float) -> float:
    """One batch-1 decode step must read ``weight_bytes`` (see ``decode_weight_bytes``) and
    the sequence's KV once."""
    return (weight_bytes + kv_bytes) / (peak_tbps * 1e12)
