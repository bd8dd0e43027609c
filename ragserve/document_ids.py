"""Document ids: xxh3-128 of tenant and text, as 32 lowercase hex characters.

Kept free of heavy imports: the cluster's ingress reads ids too, and holds no engine."""

from __future__ import annotations

import re

import xxhash

DOCUMENT_ID_LENGTH = 32
_DOCUMENT_ID = re.compile(f"[0-9a-f]{{{DOCUMENT_ID_LENGTH}}}")


def document_id(namespace: str, text: str) -> str:
    """The id of ``text`` uploaded by tenant ``namespace``."""
    return xxhash.xxh3_128_hexdigest(namespace.encode() + b"\x00" + text.encode())


def is_document_id(value: str) -> bool:
    """Whether ``value`` has a document id's form (it may name no document)."""
    return _DOCUMENT_ID.fullmatch(value) is not None
