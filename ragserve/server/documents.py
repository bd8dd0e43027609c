"""The document registry: upload once, prefill in the background, pin the blocks.

A document's id is a content hash of its tenant and text, so uploading the same text again
finds the existing document and computes nothing. Ingestion prefills the document's
prompt prefix (see :mod:`ragserve.server.prompts`) with a one-token greedy request, then
pins its full blocks so they are never evicted while the document exists. A question on a
document still ingesting does not wait: the engine makes it share the blocks being
computed. Documents live in memory; a restarted server forgets them (their blocks may
still be found in the CPU or disk tiers when re-uploaded).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import xxhash

from ragserve.engine.async_engine import AsyncEngine
from ragserve.sampling_params import SamplingParams
from ragserve.server.engine_access import call_engine
from ragserve.server.errors import APIError, bad_request
from ragserve.server.prompts import PromptBuilder

logger = logging.getLogger(__name__)

DOCUMENT_ID_LENGTH = 32
_DOCUMENT_ID = re.compile(f"[0-9a-f]{{{DOCUMENT_ID_LENGTH}}}")
Status = Literal["ingesting", "ready", "failed"]


def document_id(namespace: str, text: str) -> str:
    """xxh3-128 of tenant and text: 32 lowercase hex characters."""
    return xxhash.xxh3_128_hexdigest(namespace.encode() + b"\x00" + text.encode())


def check_document_id(value: str, param: str = "id") -> str:
    if not _DOCUMENT_ID.fullmatch(value):
        raise bad_request(
            f"invalid document id {value[:40]!r}: expected {DOCUMENT_ID_LENGTH} lowercase hex characters",
            param,
            "invalid_document_id",
        )
    return value


@dataclass(eq=False)
class Document:
    id: str
    namespace: str
    token_ids: list[int]  # the document in its wrapper
    prefix_ids: list[int]  # what ingestion prefills and pins: template head + token_ids
    metadata: dict[str, Any]
    created: int
    status: Status = "ingesting"
    error: str | None = None
    pinned_tokens: int = 0
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def pin_id(self) -> str:
        return f"doc-{self.id}"

    def to_json(self, block_size: int) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "document",
            "created": self.created,
            "status": self.status,
            "tokens": len(self.token_ids),
            "prefix_tokens": len(self.prefix_ids),
            "pinned_tokens": self.pinned_tokens,
            "blocks_pinned": self.pinned_tokens // block_size,
            "metadata": self.metadata,
            "error": self.error,
        }


class DocumentService:
    """Owns every tenant's documents and their ingestion tasks. Event-loop only."""

    def __init__(self, engine: AsyncEngine, prompts: PromptBuilder) -> None:
        self.engine = engine
        self.prompts = prompts
        self.block_size: int = engine.engine.config.block_size
        self._docs: dict[tuple[str, str], Document] = {}
        self._ids = itertools.count()

    def get(self, namespace: str, doc_id: str, param: str = "id") -> Document:
        doc = self._docs.get((namespace, check_document_id(doc_id, param)))
        if doc is None:
            raise APIError(
                404, f"document {doc_id} not found", param=param, code="document_not_found"
            )
        return doc

    def list_for(self, namespace: str) -> list[Document]:
        docs = [doc for (ns, _), doc in self._docs.items() if ns == namespace]
        return sorted(docs, key=lambda doc: (doc.created, doc.id))

    def count_by_status(self) -> dict[str, int]:
        counts = {"ingesting": 0, "ready": 0, "failed": 0}
        for doc in self._docs.values():
            counts[doc.status] += 1
        return counts

    def token_lists(self, namespace: str, doc_ids: list[str]) -> list[list[int]]:
        """The documents' tokens, in order, for a prompt; 404 for any id the tenant lacks."""
        return [self.get(namespace, doc_id, "documents").token_ids for doc_id in doc_ids]

    def existing(self, namespace: str, text: str) -> Document | None:
        """The live document holding exactly this text, if any (a failed one does not count)."""
        doc = self._docs.get((namespace, document_id(namespace, text)))
        return doc if doc is not None and doc.status != "failed" else None

    async def add(
        self, namespace: str, text: str, metadata: dict[str, Any]
    ) -> tuple[Document, bool]:
        """Register and start ingesting; returns (document, whether it is new)."""
        existing = self.existing(namespace, text)
        if existing is not None:
            return existing, False
        token_ids = await self.prompts.run(self.prompts.document_ids, text)
        prefix_ids = self.prompts.document_prefix(token_ids)
        self._check_fits(len(token_ids), len(prefix_ids))
        existing = self.existing(namespace, text)  # another upload may have won the race
        if existing is not None:
            return existing, False
        doc_id = document_id(namespace, text)
        doc = Document(doc_id, namespace, token_ids, prefix_ids, metadata, int(time.time()))
        self._docs[(namespace, doc_id)] = doc
        doc.task = asyncio.create_task(self._ingest(doc), name=f"ingest-{doc_id}")
        logger.info("document %s: %d tokens, ingesting", doc_id, len(token_ids))
        return doc, True

    def _check_fits(self, num_tokens: int, num_prefix_tokens: int) -> None:
        max_len = self.engine.max_model_len
        if num_prefix_tokens >= max_len:
            raise bad_request(
                f"the document has {num_tokens} tokens ({num_prefix_tokens} with the document "
                f"template) but the model's context is {max_len} tokens, and questions need room",
                "text",
                "context_length_exceeded",
            )
        num_blocks = self.engine.engine.num_kv_blocks
        needed = -(-(num_prefix_tokens + 1) // self.block_size)
        if needed > num_blocks:
            raise bad_request(
                f"the document needs {needed} KV blocks but the cache holds {num_blocks}",
                "text",
                "context_length_exceeded",
            )

    async def _ingest(self, doc: Document) -> None:
        params = SamplingParams(max_tokens=1, temperature=0.0)
        request_id = f"ingest-{doc.id[:16]}-{next(self._ids)}"
        started = time.perf_counter()
        try:
            stream = self.engine.generate(doc.prefix_ids, params, request_id, doc.namespace)
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for _ in stream:
                    pass
            prefix_ids, namespace, pin_id = doc.prefix_ids, doc.namespace, doc.pin_id
            pinned = await call_engine(
                self.engine, lambda engine: engine.pin_prefix(pin_id, prefix_ids, namespace)
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the document records why; the server goes on
            doc.status, doc.error = "failed", str(exc)
            logger.warning("document %s: ingestion failed: %s", doc.id, exc)
            return
        doc.status, doc.pinned_tokens = "ready", pinned
        logger.info(
            "document %s: ready in %.2fs, %d tokens pinned",
            doc.id,
            time.perf_counter() - started,
            pinned,
        )

    async def remove(self, namespace: str, doc_id: str) -> Document:
        doc = self.get(namespace, doc_id)
        del self._docs[(namespace, doc.id)]
        if doc.task is not None and not doc.task.done():
            doc.task.cancel()
            await asyncio.gather(doc.task, return_exceptions=True)
        if self.engine.is_alive:
            pin_id = doc.pin_id
            # NOTE: commands run in order on the engine thread, so this unpin also undoes a
            # pin that a just-cancelled ingestion had already queued.
            await call_engine(self.engine, lambda engine: engine.unpin_prefix(pin_id))
        return doc

    async def close(self) -> None:
        tasks = [doc.task for doc in self._docs.values() if doc.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
