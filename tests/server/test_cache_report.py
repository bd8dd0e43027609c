"""The ``usage.ragserve_cache`` extension: tokens per tier and why a document missed."""

from __future__ import annotations

import time
from typing import Any

from ragserve.outputs import CompletionOutput, RequestOutput
from ragserve.server.cache_report import document_notes
from ragserve.server.documents import RegisteredDocument
from ragserve.server.responses import usage

DOC_ID = "a" * 32


class Docs:
    """What ``document_notes`` reads of the document service."""

    block_size = 16

    def __init__(self, doc: RegisteredDocument) -> None:
        self.doc = doc

    def known(self, namespace: str, doc_id: str) -> RegisteredDocument | None:
        return self.doc if (namespace, doc_id) == (self.doc.namespace, self.doc.id) else None


def output(cached: int, by_tier: dict[str, int]) -> RequestOutput:
    return RequestOutput(
        "r", None, list(range(200)), [CompletionOutput(0, "", [1])], True, cached, by_tier
    )


def notes(doc: RegisteredDocument, cached: int) -> list[dict[str, Any]]:
    return document_notes(Docs(doc), "t", [DOC_ID], [output(cached, {})])  # type: ignore[arg-type]


def test_usage_splits_cached_tokens_by_tier() -> None:
    body = usage([output(96, {"device": 64, "disk": 32}), output(16, {"device": 16})])
    assert body["prompt_tokens_details"] == {"cached_tokens": 112}
    assert body["ragserve_cache"] == {
        "cached_tokens_by_tier": {"device": 80, "disk": 32},
        "blended_tokens": 0,
        "recomputed_tokens": 0,
        "documents": [],
    }


def test_reasons_for_a_document_not_fully_cached() -> None:
    doc = RegisteredDocument(DOC_ID, "t", list(range(90)), list(range(100)), {}, 0)
    assert notes(doc, 0)[0]["reason"] == "first_use"  # still ingesting
    doc.status = "ready"
    assert notes(doc, 96) == []  # every full block of its prefix was cached
    assert notes(doc, 32) == [
        {"id": DOC_ID, "prefix_tokens": 96, "cached_tokens": 32, "reason": "evicted"}
    ]
    doc.expire_time = time.time() - 1
    assert notes(doc, 0)[0]["reason"] == "expired"
    assert document_notes(Docs(doc), "other", [DOC_ID], [output(0, {})]) == []  # type: ignore[arg-type]


def test_a_document_of_another_model_reports_different_model() -> None:
    doc = RegisteredDocument(DOC_ID, "t", list(range(90)), list(range(100)), {}, 0)
    doc.status, doc.previous_model = "ready", "f" * 64  # taken over, not computed yet
    assert notes(doc, 0) == [
        {"id": DOC_ID, "prefix_tokens": 96, "cached_tokens": 0, "reason": "different_model"}
    ]
    doc.status = "ingesting"  # its recomputation is under way
    assert notes(doc, 16)[0]["reason"] == "different_model"
    doc.status, doc.previous_model = "ready", None  # computed and pinned for this model
    assert notes(doc, 96) == []
    assert notes(doc, 0)[0]["reason"] == "evicted"
