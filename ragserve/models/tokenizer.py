"""Tokenizers from HF directories and from GGUF files (converted once, then cached on disk).

Converting a GGUF vocabulary with transformers takes seconds (about 6.5 s for SmolLM2's
49k tokens); the converted tokenizer is saved under
``${RAGSERVE_CACHE_DIR:-~/.cache/ragserve}/tokenizers/<GGUF header digest>/`` and loaded
from there afterwards (about 0.2 s). The cache entry appears atomically (a temporary
directory renamed into place), so a crash mid-save leaves no half-written entry.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from ragserve.models.gguf_loader import open_gguf

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Classes that transformers' generic fast tokenizer loads as they are (a cache entry of
# a GGUF vocabulary usually names one of them).
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def cache_root() -> Path:
    return Path(os.environ.get("RAGSERVE_CACHE_DIR") or "~/.cache/ragserve").expanduser()


def has_tokenizer_files(directory: Path) -> bool:
    return any((directory / name).is_file() for name in _TOKENIZER_FILES)


def load_hf_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer in an HF directory; ValueError naming the path when there is none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load a tokenizer from {path}: {exc}") from exc


def load_gguf_tokenizer(
    gguf_path: str | Path, header_digest: str | None = None
) -> PreTrainedTokenizerBase:
    """The tokenizer embedded in ``gguf_path`` (with its chat template), via the disk cache.

    ``header_digest`` is ``GGUFCheckpoint.header_digest``; it is computed (by parsing the
    header) when not given.
    """
    gguf_path = Path(gguf_path)
    if header_digest is None:
        header_digest = open_gguf(gguf_path).header_digest
    entry = cache_root() / "tokenizers" / header_digest
    if (entry / "tokenizer_config.json").is_file():
        try:
            return _load_cache_entry(entry)
        except (OSError, ValueError) as exc:
            logger.warning("discarding unreadable tokenizer cache %s: %s", entry, exc)
            shutil.rmtree(entry, ignore_errors=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    _save_atomically(tokenizer, entry)
    return tokenizer


def _load_cache_entry(entry: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in ``entry``: by the generic fast class when the entry names it.

    NOTE: ``AutoTokenizer`` is imported only for other classes: its import builds
    transformers' model mappings, 0.6 s of start-up on 2 cores.
    """
    with open(entry / "tokenizer_config.json") as handle:
        tokenizer_class = json.load(handle).get("tokenizer_class")
    if tokenizer_class in _GENERIC_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(entry))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(entry))


def _save_atomically(tokenizer: PreTrainedTokenizerBase, entry: Path) -> None:
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=entry.parent))
    except OSError as exc:
        logger.warning("tokenizer cache %s is not writable: %s", entry.parent, exc)
        return
    try:
        tokenizer.save_pretrained(str(staging))
        os.rename(staging, entry)
    except OSError as exc:
        # NOTE: another process may have filled the entry first; either copy is fine.
        logger.debug("tokenizer cache entry %s not written: %s", entry, exc)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
