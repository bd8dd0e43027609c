"""Documents of another model: which rows a server may take over, and taking them.

A row belongs to the model fingerprint it was ingested under. After a restart with another
model (other weights, dtype or shape) those rows are still the tenant's documents, and
their token ids stay valid when both models share a tokenizer (equal digests in the
``models`` table, see :mod:`ragserve.server.tokenizer_identity`). Such a row is moved to
the current model in one transaction: one document keeps exactly one row, which a later
DELETE removes. Its KV must be computed again, since KV depends on the model.
"""

from __future__ import annotations

import sqlite3

from ragserve.server.registry_rows import Row

_COLUMNS = "model, namespace, id, token_ids, metadata, created, expire_time, checksum"


def record_model(db: sqlite3.Connection, model: str, tokenizer: str) -> None:
    """Note the tokenizer ``model`` uses (inside the caller's transaction)."""
    db.execute(
        "INSERT INTO models (fingerprint, tokenizer) VALUES (?, ?)"
        " ON CONFLICT (fingerprint) DO UPDATE SET tokenizer = excluded.tokenizer",
        (model, tokenizer),
    )


def foreign_rows(db: sqlite3.Connection, model: str, tokenizer: str) -> list[Row]:
    """Rows of other models with the same tokenizer whose document ``model`` lacks, newest
    first (``row`` column first, as ``decode_row`` takes them)."""
    return db.execute(
        f"SELECT row, {_COLUMNS} FROM documents AS d WHERE model != ?"
        " AND model IN (SELECT fingerprint FROM models WHERE tokenizer = ?)"
        " AND NOT EXISTS (SELECT 1 FROM documents AS own"
        "   WHERE own.model = ? AND own.namespace = d.namespace AND own.id = d.id)"
        " ORDER BY row DESC",
        (model, tokenizer, model),
    ).fetchall()
