"""The ``usage.ragserve_cache`` extension: where a response's cached prompt tokens came
from, and why a named document was not fully cached.

::

    "ragserve_cache": {
        "cached_tokens_by_tier": {"device": 480, "cpu": 0, "disk": 32},
        "documents": [{"id": "…", "prefix_tokens": 512, "cached_tokens": 0,
                       "reason": "first_use"}]
    }

``documents`` lists only the named documents that were not fully cached. Reasons:
``first_use`` (its ingestion has not finished or failed: its blocks are being computed),
``evicted`` (it was ingested, but its blocks were dropped from every tier: it could not
be pinned, or a restart found them gone), ``expired`` (it expired while the request ran),
``different_model`` (it was ingested under another model, whose KV this one cannot use: a
restart with other weights, dtype or shape took it over, and its blocks are computed again
at first use).
Only the first named document can be a cached prefix: the later ones follow it in the
prompt, so they are reported only when the first was fully cached.
"""

from __future__ import annotations

import time
from typing import Any

from ragserve.outputs import RequestOutput
from ragserve.server.documents import DocumentService


def document_notes(
    docs: DocumentService, namespace: str, doc_ids: list[str], outputs: list[RequestOutput]
) -> list[dict[str, Any]]:
    """One note per named document that was not fully cached (see the module)."""
    if not doc_ids or not outputs:
        return []
    cached = min(output.num_cached_tokens for output in outputs)
    doc = docs.known(namespace, doc_ids[0])
    if doc is None:
        return []
    full = len(doc.prefix_ids) // docs.block_size * docs.block_size
    if cached >= full:
        return []
    if doc.expired(time.time()):
        reason = "expired"
    elif doc.previous_model is not None:
        reason = "different_model"
    elif doc.status != "ready":
        reason = "first_use"
    else:
        reason = "evicted"
    return [{"id": doc.id, "prefix_tokens": full, "cached_tokens": cached, "reason": reason}]
