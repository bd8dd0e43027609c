"""The model layer: our Llama-family implementation and its loaders.

Public entry points (imported lazily, so ``ragserve.models.forward_context`` stays cheap to
import for code that never loads a model):

- ``load_model(model, *, dtype, device, load_format, tokenizer, max_model_len, seed)``
  and ``load_model_from_config(engine_config)`` -> ``LoadedModel``
- ``LoadedModel``, ``ModelShape``, ``LlamaForCausalLM``
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ragserve.models.llama import LlamaForCausalLM, ModelShape
    from ragserve.models.loader import LoadedModel, load_model, load_model_from_config

_EXPORTS = {
    "LlamaForCausalLM": "ragserve.models.llama",
    "ModelShape": "ragserve.models.llama",
    "LoadedModel": "ragserve.models.loader",
    "load_model": "ragserve.models.loader",
    "load_model_from_config": "ragserve.models.loader",
}

__all__ = ["LlamaForCausalLM", "LoadedModel", "ModelShape", "load_model", "load_model_from_config"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
