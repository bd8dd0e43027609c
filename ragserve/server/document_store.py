"""The document registry on disk, next to the disk KV tier, so a restart keeps documents.

One JSON file per model in the disk tier's directory (the tier indexes only its own
sub-directories, so the file never looks like a KV record to it)::

    {"format": "ragserve-documents", "version": 1, "model": <fingerprint>,
     "checksum": <xxh3-64 hex of the canonical "documents" JSON>,
     "documents": [{"id", "namespace", "token_ids", "metadata", "created"}, ...]}

Writes are atomic (temporary file, fsync, rename, fsync of the directory): a reader sees
the old file or the new one, never a mix. A file that cannot be read, does not parse,
fails its checksum, or belongs to another format, version or model is logged and
ignored (and replaced by the next write); it never stops the server. Entries whose
fields are malformed are skipped one by one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

logger = logging.getLogger(__name__)

FORMAT = "ragserve-documents"
VERSION = 1
_ID = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class StoredDocument:
    id: str
    namespace: str
    token_ids: list[int]
    metadata: dict[str, Any]
    created: int

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "namespace": self.namespace,
            "token_ids": self.token_ids,
            "metadata": self.metadata,
            "created": self.created,
        }


class DocumentStore:
    """Load and save the registry file of one model in ``directory``."""

    def __init__(self, directory: str | os.PathLike[str], model_fingerprint: str) -> None:
        self.directory = Path(directory)
        self.model = model_fingerprint
        self.path = self.directory / f"documents-{model_fingerprint[:16]}.json"

    def load(self) -> list[StoredDocument]:
        """The stored documents; [] (with a warning) when the file is absent or unusable."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as exc:
            logger.warning("document registry %s cannot be read (%s); ignored", self.path, exc)
            return []
        problem, entries = _parse(raw, self.model)
        if problem is not None:
            logger.warning("document registry %s ignored: %s", self.path, problem)
            return []
        docs = []
        for number, entry in enumerate(entries):
            doc = _document(entry)
            if doc is None:
                logger.warning("document registry %s: entry %d is malformed; skipped", self.path, number)
                continue
            docs.append(doc)
        return docs

    def save(self, docs: list[StoredDocument]) -> None:
        """Replace the file atomically. Raises OSError (the caller logs it)."""
        documents = [doc.to_json() for doc in docs]
        payload = {
            "format": FORMAT,
            "version": VERSION,
            "model": self.model,
            "checksum": _checksum(documents),
            "documents": documents,
        }
        data = json.dumps(payload, separators=(",", ":")).encode()
        self.directory.mkdir(parents=True, exist_ok=True)
        temp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            with temp.open("wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, self.path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        _fsync_directory(self.directory)


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
    if payload.get("checksum") != _checksum(entries):
        return "checksum mismatch (damaged file)", []
    return None, entries


def _document(entry: Any) -> StoredDocument | None:
    if not isinstance(entry, dict):
        return None
    doc_id, namespace = entry.get("id"), entry.get("namespace")
    token_ids, metadata, created = entry.get("token_ids"), entry.get("metadata"), entry.get("created")
    valid = (
        isinstance(doc_id, str)
        and _ID.fullmatch(doc_id) is not None
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


def _checksum(documents: list[Any]) -> str:
    canonical = json.dumps(documents, separators=(",", ":"), sort_keys=True).encode()
    return xxhash.xxh3_64_hexdigest(canonical)


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
