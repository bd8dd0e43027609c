"""A digest of what turns text into token ids: equal digests mean a document's stored
token ids mean the same text to both tokenizers.

It covers the full tokenizer definition (vocabulary, merges, normalizer, pre-tokenizer,
added tokens) of a fast tokenizer, or the vocabulary and added tokens of a slow one, plus
the chat template (the document wrapper and the prompt head are rendered with it).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def tokenizer_fingerprint(tokenizer: Any) -> str | None:
    """sha256 hex of the tokenizer's definition; None without a tokenizer."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        definition = backend.to_str()
    else:
        vocab = sorted(tokenizer.get_vocab().items())
        added = sorted(str(token) for token in tokenizer.all_special_tokens)
        definition = json.dumps([type(tokenizer).__name__, vocab, added])
    template = getattr(tokenizer, "chat_template", None)
    payload = json.dumps([definition, template if isinstance(template, str) else None])
    return hashlib.sha256(payload.encode()).hexdigest()
