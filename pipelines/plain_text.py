"""A tokenizer copy for user text: special-token strings in it are read as plain text.

Text written by users (documents, prompts, questions) must never become control tokens
(``<|im_start|>``, ``<|eot_id|>``, ...): a document holding ``<|im_start|>system`` would
otherwise forge a turn. Prompt frames from chat templates keep the original tokenizer.
NOTE: a copy, because toggling the setting per call would mutate a tokenizer that another
thread (the engine's detokenizer) reads at the same time.
"""

from __future__ import annotations

import copy
from typing import Any


def plain_text_tokenizer(tokenizer: Any) -> Any:
    """A deep copy of ``tokenizer`` that encodes special-token strings as ordinary text."""
    plain = copy.deepcopy(tokenizer)
    plain.split_special_tokens = True
    backend = getattr(plain, "backend_tokenizer", None)
    if backend is not None:
        # NOTE: set on the backend now: the first call would set it, racing other threads.
        backend.encode_special_tokens = True
    return plain
