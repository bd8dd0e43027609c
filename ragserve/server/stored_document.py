"""One row of the document registry: what a restart needs to bring a document back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Status = Literal["ingesting", "ready", "failed"]
# How far an ingestion got: a settle never writes a status that says less than the row's
# (a server that holds the document's blocks wins over one whose ingestion failed).
PROGRESS: dict[Status, int] = {"ingesting": 0, "failed": 1, "ready": 2}
# NOTE: an error is only shown, and a row must stay small.
MAX_ERROR_CHARS = 500


@dataclass(frozen=True)
class StoredDocument:
    """A document as the registry keeps it. ``created`` and ``expire_time`` are Unix
    seconds; ``expire_time`` None means the document never expires.

    ``status`` and ``error``: how far its ingestion got on the server that wrote the row:
    the store's rows carry them (see :mod:`ragserve.server.store_values`), the directory
    keeps them beside its rows (see :mod:`ragserve.server.registry_ingestions`; only
    ``DocumentStore.find`` reads them: a restored document is ingested again). A row of
    an older server has none and reads as ``ready``."""

    id: str
    namespace: str
    token_ids: list[int]
    metadata: dict[str, Any]
    created: int
    expire_time: float | None = None
    status: Status = "ready"
    error: str | None = None
