"""Documents of another model: which rows a server may take over, and taking them.

A row belongs to the model fingerprint it was ingested under. After a restart with another
model (other weights, dtype or shape) those rows are still the tenant's documents, and
their token ids stay valid when both models share a tokenizer (equal digests in the
``models`` table, see :mod:`ragserve.server.tokenizer_identity`). Such a row is *copied*
to the current model: the other model's row stays, since a server of that model may be
running on the same directory and still serving it. Its KV must be computed again, since
KV depends on the model. A DELETE removes the rows of every model and purges the blocks
each model with this tokenizer wrote, found from its ``models`` row; expiry removes only
rows whose own ``expire_time`` passed (a PATCH changes one model's row).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass

from ragserve.engine.engine_info import KVModel
from ragserve.server.registry_rows import Row

_COLUMNS = (
    "d.row, d.model, d.namespace, d.id, d.token_ids, d.metadata, d.created, d.expire_time,"
    " d.checksum"
)


@dataclass(frozen=True)
class ModelRecord:
    """One ``models`` row: a model that served from this directory, and its tokenizer."""

    kv: KVModel
    tokenizer: str


def record_model(db: sqlite3.Connection, record: ModelRecord) -> None:
    """Insert or refresh ``record`` (inside the caller's transaction)."""
    kv = record.kv
    db.execute(
        "INSERT OR REPLACE INTO models (fingerprint, tokenizer, block_size, kv_dtype)"
        " VALUES (?, ?, ?, ?)",
        (kv.fingerprint, record.tokenizer, kv.block_size, kv.kv_dtype),
    )


def foreign_rows(db: sqlite3.Connection, record: ModelRecord) -> list[tuple[Row, KVModel]]:
    """Rows of other models with ``record``'s tokenizer whose document ``record``'s model
    lacks, newest first (``row`` column first, as ``decode_row`` takes them), each with
    the model it belongs to."""
    found = db.execute(
        f"SELECT {_COLUMNS}, m.block_size, m.kv_dtype FROM documents AS d"
        " JOIN models AS m ON m.fingerprint = d.model"
        " WHERE d.model != ? AND m.tokenizer = ?"
        " AND NOT EXISTS (SELECT 1 FROM documents AS own"
        "   WHERE own.model = ? AND own.namespace = d.namespace AND own.id = d.id)"
        " ORDER BY d.row DESC",
        (record.kv.fingerprint, record.tokenizer, record.kv.fingerprint),
    ).fetchall()
    return [(tuple(row[:9]), KVModel(row[1], int(row[9]), str(row[10]))) for row in found]


def sharing_models(db: sqlite3.Connection, record: ModelRecord) -> list[KVModel]:
    """The other recorded models with ``record``'s tokenizer: whose KV of a document holds
    the same token ids, so a purge of them can find it."""
    found = db.execute(
        "SELECT fingerprint, block_size, kv_dtype FROM models"
        " WHERE tokenizer = ? AND fingerprint != ? ORDER BY fingerprint",
        (record.tokenizer, record.kv.fingerprint),
    ).fetchall()
    return [KVModel(str(row[0]), int(row[1]), str(row[2])) for row in found]


def among(models: Iterable[KVModel], fingerprints: Iterable[str]) -> list[KVModel]:
    """The models of ``models`` whose fingerprint is one of ``fingerprints``."""
    wanted = set(fingerprints)
    return [model for model in models if model.fingerprint in wanted]
