"""How far each document's ingestion got, kept in the registry directory beside its rows
(the ``ingestions`` table), so servers that share a ``--registry-dir`` and no store show
one another's statuses and take over the ingestions of a server that died.

One entry per row, keyed like it (model, namespace, id): ``status`` (``ingesting``,
``ready`` or ``failed``), ``error`` (a failed one's) and ``lease_until`` (wall-clock
seconds). It is kept out of the row: a row's checksum covers every column of it (see
:mod:`ragserve.server.registry_rows`), and the status changes after the row is written.

As in the store (see :mod:`ragserve.server.ingest_leases`):

- an upload's row write records its ingestion ``ingesting`` with a lease, in the same
  transaction (:func:`begin`);
- the server ingesting the document renews the lease at each watch round while its
  ingestion runs, and settles the entry when it ends (:func:`settle`); a status only moves
  forward (``PROGRESS``);
- a server that learned the document shows the entry's status and reads it again at each
  watch round while it says ``ingesting``; once its lease lapsed (its server died), the
  server claims it (one conditional UPDATE under the database's write lock: one server
  wins), runs the ingestion itself and settles the entry as its owner would have;
- a row without an entry (an older server's) reads as ``ready``: such a server never
  settles, so ``ingesting`` would never end.

The functions run inside a transaction their caller holds (see
:class:`~ragserve.server.document_store.DocumentStore`).

NOTE: a lease compares the wall clocks of the servers sharing the directory (one machine,
or a shared filesystem whose machines keep time). As in the store, a lease only keeps a
second ingestion from starting while the first runs; two that do run compute the same
content-hashed blocks, and a status only moves forward.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import NamedTuple, cast

from ragserve.server.stored_document import MAX_ERROR_CHARS, PROGRESS, Status

Key = tuple[str, str]  # (namespace, document id), the model being the caller's

TABLE = """CREATE TABLE IF NOT EXISTS ingestions (
        model TEXT NOT NULL,
        namespace TEXT NOT NULL,
        id TEXT NOT NULL,
        status TEXT NOT NULL,
        error TEXT,
        lease_until REAL NOT NULL,
        PRIMARY KEY (model, namespace, id)
    )"""
_WHERE = "model = ? AND namespace = ? AND id = ?"
_RANK = (
    "CASE status " + " ".join(f"WHEN '{s}' THEN {n}" for s, n in PROGRESS.items()) + " ELSE -1 END"
)
# NOTE: keys a query names at once (two parameters each): under SQLite's oldest limit (999).
_CHUNK = 400


class IngestionRound(NamedTuple):
    """What a watch round read: the status and error of each followed document not
    claimed, and the documents whose ingestion this server claimed (to take over)."""

    statuses: dict[Key, tuple[Status, str | None]]
    claimed: set[Key]


def begin(db: sqlite3.Connection, model: str, key: Key, lease_until: float) -> None:
    """An upload: its ingestion starts (a new one, whatever the entry said)."""
    db.execute(
        "INSERT INTO ingestions (model, namespace, id, status, error, lease_until)"
        " VALUES (?, ?, ?, 'ingesting', NULL, ?) ON CONFLICT (model, namespace, id)"
        " DO UPDATE SET status = 'ingesting', error = NULL, lease_until = excluded.lease_until",
        (model, *key, lease_until),
    )


def settle(db: sqlite3.Connection, model: str, key: Key, status: Status, error: str | None) -> bool:
    """Record how the ingestion ended where the entry says less; whether it did. A row
    without an entry reads as ``ready`` already: nothing is written for it."""
    error = error[:MAX_ERROR_CHARS] if error is not None else None
    cursor = db.execute(
        f"UPDATE ingestions SET status = ?, error = ? WHERE {_WHERE} AND {_RANK} < ?",
        (status, error, model, *key, PROGRESS[status]),
    )
    return cursor.rowcount > 0


def watch_round(
    db: sqlite3.Connection,
    model: str,
    renewing: Sequence[Key],
    following: Sequence[Key],
    now: float,
    lease_until: float,
) -> IngestionRound:
    """Renew the leases of the ingestions running here (``renewing``); claim those of
    ``following`` (learned, still ``ingesting`` here) whose lease lapsed; read the
    statuses of the others."""
    db.executemany(
        f"UPDATE ingestions SET lease_until = ? WHERE {_WHERE} AND status = 'ingesting'",
        [(lease_until, model, *key) for key in renewing],
    )
    claimed = {key for key in following if _claim(db, model, key, now, lease_until)}
    unclaimed = [key for key in following if key not in claimed]
    return IngestionRound(statuses(db, model, unclaimed), claimed)


def _claim(db: sqlite3.Connection, model: str, key: Key, now: float, lease_until: float) -> bool:
    # NOTE: the write lock is held: of two servers claiming, the second finds the lease
    # the first wrote, and its UPDATE changes nothing.
    cursor = db.execute(
        f"UPDATE ingestions SET lease_until = ? WHERE {_WHERE}"
        " AND status = 'ingesting' AND lease_until < ?",
        (lease_until, model, *key, now),
    )
    return cursor.rowcount > 0


def statuses(
    db: sqlite3.Connection, model: str, keys: Sequence[Key]
) -> dict[Key, tuple[Status, str | None]]:
    """The status and error of each of ``keys``; ``ready`` for one without an entry."""
    found: dict[Key, tuple[Status, str | None]] = dict.fromkeys(keys, ("ready", None))
    for start in range(0, len(keys), _CHUNK):
        chunk = keys[start : start + _CHUNK]
        values = ", ".join("(?, ?)" for _ in chunk)
        rows = db.execute(
            "SELECT namespace, id, status, error FROM ingestions"
            f" WHERE model = ? AND (namespace, id) IN (VALUES {values})",
            (model, *(part for key in chunk for part in key)),
        )
        for namespace, doc_id, status, error in rows.fetchall():
            found[(namespace, doc_id)] = _checked(status, error)
    return found


def _checked(status: object, error: object) -> tuple[Status, str | None]:
    """An entry's status as served; a malformed one reads as a row without an entry."""
    if status not in PROGRESS:
        return "ready", None
    text = error[:MAX_ERROR_CHARS] if isinstance(error, str) else None
    return cast(Status, status), text


def forget_gone(db: sqlite3.Connection, key: Key) -> None:
    """Drop the document's entries whose row is gone (deleted, or expired)."""
    db.execute(
        "DELETE FROM ingestions WHERE namespace = ? AND id = ? AND NOT EXISTS (SELECT 1 FROM"
        " documents WHERE documents.model = ingestions.model AND documents.namespace ="
        " ingestions.namespace AND documents.id = ingestions.id)",
        key,
    )
