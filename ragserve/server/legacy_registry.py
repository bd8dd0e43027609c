"""The JSON document registry of earlier versions, read once to migrate it to SQLite.

One file per model in the KV directory, ``documents-<fingerprint[:16]>.json``::

    {"format": "ragserve-documents", "version": 1, "model": <fingerprint>,
     "checksum": <xxh3-64 hex of the canonical "documents" JSON>,
     "documents": [{"id", "namespace", "token_ids", "metadata", "created"}, ...]}

A file that cannot be read, does not parse, fails its checksum, or belongs to another
format, version or model yields nothing (with the reason); malformed entries are skipped
one by one. Nothing here writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import xxhash

from ragserve.document_ids import is_document_id
from ragserve.server.stored_document import StoredDocument

FORMAT = "ragserve-documents"
VERSION = 1


def legacy_path(directory: Path, model: str) -> Path:
    return directory / f"documents-{model[:16]}.json"


def read_legacy(path: Path, model: str) -> tuple[str | None, list[StoredDocument], int]:
    """(why the file is unusable or None, its good documents, how many entries were skipped).

    Raises OSError when the file cannot be read (FileNotFoundError when absent)."""
    problem, entries = _parse(path.read_bytes(), model)
    if problem is not None:
        return problem, [], 0
    docs = [doc for doc in map(_document, entries) if doc is not None]
    return None, docs, len(entries) - len(docs)


def _parse(raw: bytes, model: str) -> tuple[str | None, list[Any]]:
    """(None, entries) for a valid file of this model, else (why not, [])."""
    try:
        payload = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        return f"not valid JSON ({exc})", []
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        return "not a ragserve document registry", []
    if payload.get("version") != VERSION:
        return f"version {payload.get('version')!r}, expected {VERSION}", []
    if payload.get("model") != model:
        return "written for another model", []
    entries = payload.get("documents")
    if not isinstance(entries, list):
        return "no document list", []
    if payload.get("checksum") != checksum(entries):
        return "checksum mismatch (damaged file)", []
    return None, entries


def _document(entry: Any) -> StoredDocument | None:
    if not isinstance(entry, dict):
        return None
    doc_id, namespace = entry.get("id"), entry.get("namespace")
    token_ids, metadata, created = (
        entry.get("token_ids"),
        entry.get("metadata"),
        entry.get("created"),
    )
    valid = (
        isinstance(doc_id, str)
        and is_document_id(doc_id)
        and isinstance(namespace, str)
        and isinstance(token_ids, list)
        and bool(token_ids)
        and all(type(t) is int and t >= 0 for t in token_ids)
        and isinstance(metadata, dict)
        and type(created) is int
    )
    if not valid:
        return None
    assert isinstance(doc_id, str) and isinstance(namespace, str)
    assert isinstance(token_ids, list) and isinstance(metadata, dict) and isinstance(created, int)
    return StoredDocument(doc_id, namespace, token_ids, metadata, created)


def checksum(documents: list[Any]) -> str:
    canonical = json.dumps(documents, separators=(",", ":"), sort_keys=True).encode()
    return xxhash.xxh3_64_hexdigest(canonical)
