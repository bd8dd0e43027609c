"""One row of the document registry: what a restart needs to bring a document back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Status = Literal["ingesting", "ready", "failed"]


@dataclass(frozen=True)
class StoredDocument:
    """A document as the registry keeps it. ``created`` and ``expire_time`` are Unix
    seconds; ``expire_time`` None means the document never expires.

    ``status`` and ``error``: how far its ingestion got on the server that publishes the
    row to the store (see :mod:`ragserve.server.store_values`). Only the store's rows carry
    them; this server's own registry keeps none (a restored document is ingested again),
    so its rows read as ``ready``, as the store's rows of older servers do."""

    id: str
    namespace: str
    token_ids: list[int]
    metadata: dict[str, Any]
    created: int
    expire_time: float | None = None
    status: Status = "ready"
    error: str | None = None
