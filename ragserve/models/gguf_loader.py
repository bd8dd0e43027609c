"""Reads a GGUF file: the transformers config from its metadata, and its weights under HF names.

Architectures: ``llama`` (incl. SmolLM2 and llama.cpp's Mistral conversions) and ``qwen2``,
``qwen3``. The header is parsed by ``gguf_header``; weights are dequantized to float32 by
``gguf_dequant``, one tensor at a time. llama.cpp's converter permutes the rows of Llama's Q and K projections into an
interleaved rotary layout; ``iter_gguf_weights`` undoes that so the weights suit the
half-rotation rotary of HF Llama (and of our model).

Differences from transformers' GGUF path, both towards llama.cpp's behaviour: a
``rope_freqs`` tensor (Llama 3.1 conversions) is returned as rotary frequency factors, and
``{arch}.rope.scaling.*`` metadata becomes ``rope_parameters``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from ragserve.models.gguf_dequant import dequantize
from ragserve.models.gguf_header import GGUFHeader, read_gguf_header


class GGUFConfig(PretrainedConfig):
    """A GGUF model's transformers config: the fields its metadata gives, nothing more.

    NOTE: not transformers' own config classes: importing their modules (Llama's, Qwen's)
    pulls in ``torch.distributed.tensor``, about 2.5 s of a 2-core machine's start-up.
    Every field the model reads is set from the metadata, and the rest of those classes'
    defaults are the model's own for these architectures. ``save_pretrained`` writes a
    config.json that transformers loads as the architecture's own config.
    """


class GGUFLlamaConfig(GGUFConfig):
    model_type = "llama"


class GGUFQwen2Config(GGUFConfig):
    model_type = "qwen2"


class GGUFQwen3Config(GGUFConfig):
    model_type = "qwen3"


# GGUF general.architecture -> (config class, architecture name)
GGUF_ARCHITECTURES: dict[str, tuple[type[GGUFConfig], str]] = {
    "llama": (GGUFLlamaConfig, "LlamaForCausalLM"),
    "qwen2": (GGUFQwen2Config, "Qwen2ForCausalLM"),
    "qwen3": (GGUFQwen3Config, "Qwen3ForCausalLM"),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
ROPE_FREQS = "rope_freqs.weight"


@dataclass(frozen=True)
class GGUFCheckpoint:
    """An opened GGUF file with the transformers config built from its metadata.

    ``header_digest`` hashes the metadata and tensor index, which name every tensor's type,
    shape and offset: it identifies the weights without hashing gigabytes of data.
    """

    header: GGUFHeader
    architecture: str
    config: PretrainedConfig

    @property
    def path(self) -> Path:
        return self.header.path

    @property
    def header_digest(self) -> str:
        return self.header.digest

    @property
    def has_tokenizer(self) -> bool:
        return "tokenizer.ggml.model" in self.header.metadata

    @property
    def chat_template(self) -> str | None:
        value = self.header.metadata.get("tokenizer.chat_template")
        return None if value is None else str(value)


def open_gguf(path: Path) -> GGUFCheckpoint:
    """Parse the header of ``path`` and build its config; ValueError for other architectures."""
    header = read_gguf_header(path)
    architecture = str(header.metadata.get("general.architecture", ""))
    if architecture not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {architecture!r} in {path} is not supported; "
            f"supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    if int(header.metadata.get(f"{architecture}.expert_count", 0) or 0) > 0:
        raise ValueError(f"{path} is a mixture-of-experts model, which is not supported")
    if int(header.metadata.get("split.count", 1) or 1) > 1:
        raise ValueError(
            f"{path} is one part of a split GGUF file, which is not supported; "
            "merge the parts first (llama-gguf-split --merge)"
        )
    return GGUFCheckpoint(header, architecture, gguf_config(header, architecture))


def gguf_config(header: GGUFHeader, architecture: str) -> PretrainedConfig:
    """A transformers config from the ``{architecture}.*`` and ``tokenizer.ggml.*`` metadata."""
    config_class, class_name = GGUF_ARCHITECTURES[architecture]
    metadata = header.metadata

    def arch_field(key: str, default: Any = None) -> Any:
        return metadata.get(f"{architecture}.{key}", default)

    required = {
        "hidden_size": "embedding_length",
        "intermediate_size": "feed_forward_length",
        "num_hidden_layers": "block_count",
        "num_attention_heads": "attention.head_count",
        "max_position_embeddings": "context_length",
    }
    values: dict[str, Any] = {}
    for name, key in required.items():
        value = arch_field(key)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {architecture}.{key}")
        values[name] = int(value)
    tensor_shapes = {t.name: t.shape for t in header.tensors}
    num_heads = values["num_attention_heads"]
    head_dim = arch_field("attention.key_length") or arch_field("rope.dimension_count")
    vocab_size = arch_field("vocab_size") or tensor_shapes["token_embd.weight"][0]
    rope_theta = float(arch_field("rope.freq_base", 10000.0))
    values.update(
        architectures=[class_name],
        num_key_value_heads=int(arch_field("attention.head_count_kv", num_heads)),
        head_dim=int(head_dim or values["hidden_size"] // num_heads),
        rms_norm_eps=float(arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
        vocab_size=int(vocab_size),
        tie_word_embeddings="output.weight" not in tensor_shapes,
        rope_parameters=_rope_parameters(arch_field, rope_theta),
    )
    for token, key in (("bos", "bos"), ("pad", "padding"), ("unk", "unknown")):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            values[f"{token}_token_id"] = int(token_id)
    # NOTE: llama.cpp ends generation at the end-of-turn and end-of-message tokens too.
    ends = [metadata.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(int(token_id) for token_id in ends if token_id is not None))
    if eos:
        values["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return config_class(**values)


def _rope_parameters(arch_field: Any, rope_theta: float) -> dict[str, Any]:
    scaling = arch_field("rope.scaling.type")
    if scaling in (None, "none"):
        return {"rope_type": "default", "rope_theta": rope_theta}
    if scaling not in ("linear", "yarn"):
        raise ValueError(f"GGUF rope scaling type {scaling!r} is not supported (linear, yarn)")
    params: dict[str, Any] = {
        "rope_type": scaling,
        "rope_theta": rope_theta,
        "factor": float(arch_field("rope.scaling.factor", 1.0)),
    }
    original = arch_field("rope.scaling.original_context_length")
    if original is not None:
        params["original_max_position_embeddings"] = int(original)
    return params


def hf_name(gguf_name: str) -> str:
    """The HF checkpoint name of a GGUF tensor; ValueError for names we do not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's Q/K row permutation: per head, rows ``(half, 2)`` -> ``(2, half)``."""
    rows = weight.shape[0]
    per_head = weight.view(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape)


def iter_gguf_weights(checkpoint: GGUFCheckpoint) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, float32 tensor)`` for every weight; skips ``rope_freqs`` (see ``rope_frequency_factors``)."""
    config = checkpoint.config
    permute_heads = {
        ".self_attn.q_proj.": int(config.num_attention_heads),
        ".self_attn.k_proj.": int(config.num_key_value_heads),
    }
    header = checkpoint.header
    for info in header.tensors:
        if info.name == ROPE_FREQS:
            continue
        name = hf_name(info.name)
        weight = dequantize(header.tensor_data(info), info.tensor_type)
        if checkpoint.architecture == "llama":
            for marker, heads in permute_heads.items():
                if marker in name:
                    weight = unpermute_rotary_rows(weight, heads)
        yield name, weight


def rope_frequency_factors(checkpoint: GGUFCheckpoint) -> torch.Tensor | None:
    """llama.cpp's per-frequency divisors of the rotary inverse frequencies, when present."""
    header = checkpoint.header
    for info in header.tensors:
        if info.name == ROPE_FREQS:
            return dequantize(header.tensor_data(info), info.tensor_type).reshape(-1)
    return None
