"""Maps a transformers config's architecture name onto our model class."""

from __future__ import annotations

from typing import Any

from ragserve.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}

# NOTE: configs built from GGUF metadata carry a model_type but no architectures list.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_CLASSES)


def architecture_of(config: Any) -> str:
    """The architecture name of ``config``: ``architectures[0]``, else derived from ``model_type``."""
    architectures = getattr(config, "architectures", None) or []
    if architectures:
        return str(architectures[0])
    model_type = getattr(config, "model_type", None)
    return _MODEL_TYPES.get(str(model_type), f"<model_type {model_type!r}>")


def model_class_for(config: Any) -> type[LlamaForCausalLM]:
    """Our class for ``config``; ValueError naming the supported ones when there is none."""
    architecture = architecture_of(config)
    cls = MODEL_CLASSES.get(architecture)
    if cls is None:
        raise ValueError(
            f"architecture {architecture} is not supported; supported: {supported_architectures()}"
        )
    return cls
