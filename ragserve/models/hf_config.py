"""Reading an HF model directory's ``config.json``: refused in one line unless it names an
architecture this engine runs, and never by running code that the directory ships.

transformers would offer to run a directory's own configuration code (``auto_map``), or
ask for ``trust_remote_code``, before the architecture is even looked at; and its strict
config validation raises types that are not ``ValueError``. Here the architecture is read
from the JSON first, and every way the config can be refused is one ``ValueError``.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ragserve.models.registry import model_class_for


def read_hf_config(directory: Path) -> Any:
    """The transformers config of ``directory`` (a ``PretrainedConfig``); ValueError when it
    is missing, malformed, invalid or of an architecture this engine does not run."""
    path = directory / "config.json"
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object")
    names = SimpleNamespace(
        architectures=raw.get("architectures"), model_type=raw.get("model_type")
    )
    model_class_for(names)  # NOTE: refuses before transformers sees (or runs) anything
    # NOTE: imported here: building its model mappings costs GGUF start-ups 0.6 s.
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(directory), trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError, StrictDataclassError) as exc:
        said = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        raise ValueError(f"invalid config {path}: {said[:300] or type(exc).__name__}") from None
