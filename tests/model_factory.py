"""Builds tiny random-weight checkpoints with transformers' own classes, for model tests.

``make_tiny_model(tmp_path, arch)`` saves an HF directory (config.json + float32
safetensors, no tokenizer: tests feed token ids). Weights are drawn with a fixed seed and
with norms and biases randomised too, so a wrong bias or norm cannot hide behind HF's
zero/one initialisation. ``make_tiny_gguf`` writes the same weights as a GGUF file the way
llama.cpp's converter does (Q/K rows permuted), next to the HF directory.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

_BASE: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

# name -> (transformers model_type, overrides)
_ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True, "rope_theta": 100000.0}),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-llama3-rope": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    "llama-linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-yarn-rope": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    "llama-sharded": ("llama", {}),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"head_dim": 32}),
}
TINY_ARCHS = tuple(_ARCHS)


def tiny_config(arch: str, **overrides: Any) -> PretrainedConfig:
    model_type, arch_overrides = _ARCHS[arch]
    return AutoConfig.for_model(model_type, **{**_BASE, **arch_overrides, **overrides})


def _randomise(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(0.08 * noise)


def make_tiny_hf_model(arch: str, *, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The transformers model (float32, eager attention) with seeded random weights."""
    config = tiny_config(arch, **overrides)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise(model, seed)
    return model.eval()


def make_tiny_model(tmp_path: Path, arch: str, *, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny ``arch`` model under ``tmp_path / arch`` and return the directory."""
    model = make_tiny_hf_model(arch, seed=seed, **overrides)
    directory = tmp_path / arch
    # NOTE: about 280 KB of float32 weights: a 200KB limit splits them into two shards.
    shard_size = "200KB" if arch == "llama-sharded" else "50GB"
    model.save_pretrained(directory, max_shard_size=shard_size)
    return directory


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: per head, rows ``(2, half)`` -> ``(half, 2)``."""
    rows = weight.shape[0]
    per_head = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weight.shape)


def _gguf_name(hf_name: str) -> str:
    globals_ = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in globals_:
        return globals_[hf_name]
    parts = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{parts[module]}.{kind}"


def _default_inv_freq(config: PretrainedConfig) -> np.ndarray:
    theta = config.rope_parameters["rope_theta"]
    dim = config.hidden_size // config.num_attention_heads
    return 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))


def make_tiny_gguf(
    tmp_path: Path, arch: str, *, seed: int = 0, metadata: dict[str, int] | None = None
) -> tuple[Path, torch.nn.Module]:
    """Write tiny llama ``arch`` as an F32 GGUF file; return it and the transformers twin.

    Llama 3 rope scaling is stored like llama.cpp does: default rope metadata plus a
    ``rope_freqs`` tensor of per-frequency divisors. ``metadata``: more keys (uint32).
    """
    model = make_tiny_hf_model(arch, seed=seed)
    config = model.config
    assert config.model_type == "llama"
    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)
    for key, value in (metadata or {}).items():
        writer.add_uint32(key, value)
    if config.rope_parameters["rope_type"] == "llama3":
        hf_inv_freq = model.model.rotary_emb.inv_freq.double().numpy()
        factors = _default_inv_freq(config) / hf_inv_freq
        assert not math.isclose(float(factors.max()), 1.0)
        writer.add_tensor("rope_freqs.weight", factors.astype(np.float32))
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for name, tensor in model.state_dict().items():
        array = tensor.numpy().astype(np.float32)
        for proj, num_heads in heads.items():
            if f".{proj}." in name:
                array = llama_cpp_permute(array, num_heads)
        writer.add_tensor(_gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, model
