"""The registry's tables and how one document becomes one row and back.

``documents`` holds the rows; ``models`` the tokenizer digest of each model fingerprint
that has served from this directory (see :mod:`ragserve.server.registry_models`);
``ingestions`` how far each row's ingestion got (see
:mod:`ragserve.server.registry_ingestions`).

A row's ``checksum`` (xxh3-64) covers every other field, so a row whose bytes were
damaged on disk is caught when read even where SQLite's own structure still looks fine.
Token ids are stored as little-endian uint32. With a :class:`RegistryCipher` the token ids
and the metadata are sealed together into the ``token_ids`` column (prefixed ``SEALED``),
and ``metadata`` holds ``{}``.
"""

from __future__ import annotations

import json
import sys
from array import array
from typing import Any

import xxhash

from ragserve.document_ids import is_document_id
from ragserve.server.registry_cipher import RegistryCipher, SealedFieldError
from ragserve.server.registry_ingestions import TABLE as INGESTIONS
from ragserve.server.stored_document import StoredDocument

SCHEMA_VERSION = 1
SCHEMA = (
    """CREATE TABLE IF NOT EXISTS documents (
        row INTEGER PRIMARY KEY AUTOINCREMENT,
        model TEXT NOT NULL,
        namespace TEXT NOT NULL,
        id TEXT NOT NULL,
        token_ids BLOB NOT NULL,
        metadata TEXT NOT NULL,
        created INTEGER NOT NULL,
        expire_time REAL,
        checksum TEXT NOT NULL,
        UNIQUE (model, namespace, id)
    )""",
    # NOTE: added without a version change: older servers never read it. A rebuild keeps
    # its rows (see :mod:`ragserve.server.registry_repair`): a model that is not running
    # does not write its row again, and a DELETE needs it to purge that model's KV.
    """CREATE TABLE IF NOT EXISTS models (
        fingerprint TEXT PRIMARY KEY,
        tokenizer TEXT NOT NULL,
        block_size INTEGER NOT NULL,
        kv_dtype TEXT NOT NULL
    )""",
    # NOTE: also without a version change. A rebuild does not keep it: the rows then read
    # as ``ready`` (see :mod:`ragserve.server.registry_ingestions`).
    INGESTIONS,
)
Row = tuple[Any, ...]


SEALED = b"SEALED1\x00"


class RowError(ValueError):
    """A row that is not a valid document (damaged or written by something else)."""


class RowLocked(RowError):
    """An intact row sealed under a key this server does not have: kept, not served."""


def encode_row(model: str, doc: StoredDocument, cipher: RegistryCipher | None = None) -> Row:
    """The column values after ``row``, in table order."""
    tokens = array("I", doc.token_ids)
    if sys.byteorder == "big":
        tokens.byteswap()
    blob = tokens.tobytes()
    metadata = json.dumps(doc.metadata, separators=(",", ":"), sort_keys=True)
    if cipher is not None:
        inner = len(blob).to_bytes(8, "little") + blob + metadata.encode()
        blob, metadata = SEALED + cipher.seal(doc.namespace, doc.id, inner), "{}"
    expire = float(doc.expire_time) if doc.expire_time is not None else None
    digest = _checksum(model, doc.namespace, doc.id, blob, metadata, doc.created, expire)
    return (model, doc.namespace, doc.id, blob, metadata, doc.created, expire, digest)


def decode_row(row: Row, cipher: RegistryCipher | None = None) -> StoredDocument:
    """A row as selected (``row`` first, then the columns of :func:`encode_row`).
    Raises RowError when any field is malformed or the checksum does not match, RowLocked
    for an intact sealed row that ``cipher`` (or its absence) cannot open."""
    if len(row) != 9:
        raise RowError(f"{len(row)} columns, expected 9")
    _, model, namespace, doc_id, blob, metadata, created, expire, digest = row
    if not (isinstance(model, str) and isinstance(namespace, str) and isinstance(doc_id, str)):
        raise RowError("a key column is not text")
    if not (isinstance(blob, bytes) and isinstance(metadata, str) and type(created) is int):
        raise RowError("a value column has the wrong type")
    if not (expire is None or isinstance(expire, float)):
        raise RowError("expire_time is not a number")
    if digest != _checksum(model, namespace, doc_id, blob, metadata, created, expire):
        raise RowError(f"checksum mismatch for document {doc_id[:32]!r} (damaged row)")
    if blob.startswith(SEALED):
        if cipher is None:
            raise RowLocked(f"document {doc_id[:32]!r} is encrypted and no key is configured")
        try:
            inner = cipher.open(namespace, doc_id, blob[len(SEALED) :])
        except SealedFieldError:
            raise RowLocked(f"document {doc_id[:32]!r} is encrypted under another key") from None
        size = int.from_bytes(inner[:8], "little")
        blob, metadata = inner[8 : 8 + size], inner[8 + size :].decode()
    if not is_document_id(doc_id) or not blob or len(blob) % 4:
        raise RowError("malformed id or token ids")
    tokens = array("I")
    tokens.frombytes(blob)
    if sys.byteorder == "big":
        tokens.byteswap()
    try:
        parsed = json.loads(metadata)
    except ValueError as exc:
        raise RowError(f"metadata is not JSON ({exc})") from None
    if not isinstance(parsed, dict):
        raise RowError("metadata is not an object")
    return StoredDocument(doc_id, namespace, tokens.tolist(), parsed, created, expire)


def _checksum(
    model: str,
    namespace: str,
    doc_id: str,
    blob: bytes,
    metadata: str,
    created: int,
    expire: float | None,
) -> str:
    head = json.dumps([model, namespace, doc_id, metadata, created, expire]).encode()
    return xxhash.xxh3_64_hexdigest(head + b"\x00" + blob)
