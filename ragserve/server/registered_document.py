"""A document in the server's registry, its id, and the API's view of it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from ragserve.document_ids import DOCUMENT_ID_LENGTH, is_document_id
from ragserve.engine.engine_info import KVModel
from ragserve.server.document_lifecycle import rfc3339
from ragserve.server.errors import bad_request
from ragserve.server.stored_document import Status, StoredDocument


def check_document_id(value: str, param: str = "id") -> str:
    if not is_document_id(value):
        raise bad_request(
            f"invalid document id {value[:40]!r}: expected {DOCUMENT_ID_LENGTH} lowercase hex characters",
            param,
            "invalid_document_id",
        )
    return value


@dataclass(eq=False)
class RegisteredDocument:
    """A document in the server's registry: its tokens, ingestion status and pin.

    Its row on disk is a :class:`StoredDocument`; a batch pipeline's input text is a
    :class:`pipelines.documents.Document`.
    """

    id: str
    namespace: str
    token_ids: list[int]  # the document in its wrapper
    prefix_ids: list[int]  # what ingestion prefills and pins: template head + token_ids
    metadata: dict[str, Any]
    created: int
    status: Status = "ingesting"
    error: str | None = None
    pinned_tokens: int = 0
    expire_time: float | None = None  # Unix seconds; None: never expires
    # The model it was ingested under, while its KV for this model is not computed yet
    # (see ``DocumentService._adopt``; a failed computation is tried again at the next
    # question); None otherwise.
    previous_model: KVModel | None = None
    # Whether its row was written (or read): one missing later was deleted by another
    # server on the directory (see ``DocumentService.sync``).
    saved: bool = False
    # The version of its row in the store that this server last wrote or took (0: none
    # yet); a higher one there is a PATCH on another server (see ``_sync_shared``).
    version: int = 0
    # Learned from another server's row (see ``DocumentService.learn``): that server
    # ingests it, and its status is the one the registry says (the store's row, else the
    # directory's); until this server takes the ingestion over from a server that died
    # (see ``_take_over``).
    learned: bool = False
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def pin_id(self) -> str:
        return f"doc-{self.id}"

    def stored(self) -> StoredDocument:
        return StoredDocument(
            self.id,
            self.namespace,
            self.token_ids,
            self.metadata,
            self.created,
            self.expire_time,
            self.status,
            self.error,
        )

    @property
    def ingested_here(self) -> bool:
        """Whether this server's own ingestion of it has ended: its status is then this
        server's to settle in the store (a document taken over from another model is
        not ingested until its first question)."""
        return not self.learned and self.previous_model is None and self.status != "ingesting"

    @property
    def ingesting_here(self) -> bool:
        """Whether this server's own ingestion of it runs: its lease (in the store, in the
        directory) is this server's to renew (see :mod:`ragserve.server.ingest_leases`,
        :mod:`ragserve.server.registry_ingestions`)."""
        return not self.learned and self.status == "ingesting"

    @property
    def ingesting_elsewhere(self) -> bool:
        """Whether another server's ingestion of it runs, as far as this server knows: its
        lease is the one to claim once it lapses (see ``ingesting_here``)."""
        return self.learned and self.status == "ingesting"

    def expired(self, now: float) -> bool:
        return self.expire_time is not None and self.expire_time <= now

    def to_json(self, block_size: int, kv: dict[str, int] | None = None) -> dict[str, Any]:
        """The API's view. ``kv``: full blocks of the document's prefix held now, per place
        (``device``, then each tier); only ``GET /v1/documents/{id}`` looks them up."""
        body = {
            "id": self.id,
            "object": "document",
            "created": self.created,
            "create_time": rfc3339(self.created),
            "expire_time": rfc3339(self.expire_time),
            "status": self.status,
            "tokens": len(self.token_ids),
            "prefix_tokens": len(self.prefix_ids),
            "pinned_tokens": self.pinned_tokens,
            "blocks_pinned": self.pinned_tokens // block_size,
            "metadata": self.metadata,
            "error": self.error,
        }
        if kv is not None:
            body["kv_blocks"] = kv
        return body
