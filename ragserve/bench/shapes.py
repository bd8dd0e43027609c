"""Real model shapes for benchmarks with random weights (``load_format="dummy"``)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

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

SHAPES = {"llama-3.1-8b": LLAMA_3_1_8B}


def write_shape_config(name: str) -> str:
    """A directory holding only ``config.json`` of the named shape."""
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {sorted(SHAPES)}")
    directory = Path(tempfile.mkdtemp(prefix=f"ragserve-{name}-"))
    (directory / "config.json").write_text(json.dumps(SHAPES[name], indent=2))
    return str(directory)
