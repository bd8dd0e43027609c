"""One row of the document registry: what a restart needs to bring a document back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredDocument:
    """A document as the registry keeps it. ``created`` and ``expire_time`` are Unix
    seconds; ``expire_time`` None means the document never expires."""

    id: str
    namespace: str
    token_ids: list[int]
    metadata: dict[str, Any]
    created: int
    expire_time: float | None = None
