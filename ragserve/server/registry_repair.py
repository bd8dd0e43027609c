"""Start-up check of the registry database: find damage, keep every row that is intact.

``PRAGMA integrity_check`` on open. When it reports problems, rows are read one at a time
by rowid (a damaged page loses the rows stored on it; a lookup that fails or returns a row
whose checksum does not match loses that row alone), and the intact rows are written to a
fresh database that replaces the damaged one. The ``models`` rows are salvaged the same
way: a model no longer recorded could not have its KV purged by a later DELETE.

NOTE: the replacement happens at start-up under this process's lock only; a second server
that has the damaged database open at that moment keeps writing to the old file until it
restarts. Damage is rare and start-up is the one moment a server reads everything, so the
repair happens there rather than behind every write.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field

from ragserve.server.registry_rows import Row, RowError, RowLocked, decode_row

_MAX_REPORTED = 5


@dataclass
class Intact:
    """What a rebuild keeps: ``documents`` rows without their ``row`` column, in rowid
    order, and ``models`` rows (fingerprint, tokenizer, block_size, kv_dtype)."""

    documents: list[Row] = field(default_factory=list)
    models: list[Row] = field(default_factory=list)


def check(db: sqlite3.Connection) -> tuple[list[str], Intact | None]:
    """(problems found, the intact rows to rebuild the database from); (``[]``, None) when
    the database is intact."""
    try:
        report = [str(line[0]) for line in db.execute("PRAGMA integrity_check").fetchall()]
    except sqlite3.DatabaseError as exc:
        report = [str(exc)]
    if report == ["ok"]:
        return [], None
    detail = "; ".join(report[:_MAX_REPORTED]) + (" …" if len(report) > _MAX_REPORTED else "")
    kept, lost = _salvage(db)
    problem = (
        f"integrity check failed ({detail}); {len(kept)} rows kept, {lost} damaged rows dropped"
    )
    return [problem], Intact([row[1:] for row in kept], _salvage_models(db))


def _salvage(db: sqlite3.Connection) -> tuple[list[Row], int]:
    """(intact rows, how many rowids were lost) by lookups of every rowid ever assigned."""
    top = _highest_rowid(db)
    kept: list[Row] = []
    lost = 0
    for rowid in range(1, top + 1):
        try:
            row = db.execute(
                "SELECT row, model, namespace, id, token_ids, metadata, created, expire_time,"
                " checksum FROM documents WHERE row = ?",
                (rowid,),
            ).fetchone()
        except sqlite3.DatabaseError:
            lost += 1
            continue
        if row is None:
            continue  # deleted (or on a lost page: counted below when it shows)
        try:
            decode_row(row)
        except RowLocked:
            pass  # intact, sealed: kept for a server with the key
        except RowError:
            lost += 1
            continue
        kept.append(row)
    return kept, lost


def _salvage_models(db: sqlite3.Connection) -> list[Row]:
    """The readable ``models`` rows, one rowid at a time (a damaged page loses its own)."""
    try:
        top = db.execute("SELECT max(rowid) FROM models").fetchone()[0]
    except sqlite3.DatabaseError:
        top = None
    kept: list[Row] = []
    for rowid in range(1, (top if isinstance(top, int) else 0) + 1):
        try:
            row = db.execute(
                "SELECT fingerprint, tokenizer, block_size, kv_dtype FROM models WHERE rowid = ?",
                (rowid,),
            ).fetchone()
        except sqlite3.DatabaseError:
            continue
        if row is not None and _is_model_row(row):
            kept.append(tuple(row))
    return kept


def _is_model_row(row: Row) -> bool:
    fingerprint, tokenizer, block_size, kv_dtype = row
    texts = all(isinstance(value, str) and value for value in (fingerprint, tokenizer, kv_dtype))
    return texts and type(block_size) is int and block_size > 0


def _highest_rowid(db: sqlite3.Connection) -> int:
    """The largest rowid ever handed out: AUTOINCREMENT's record, or the table's own max."""
    candidates = [0]
    for query in (
        "SELECT seq FROM sqlite_sequence WHERE name = 'documents'",
        "SELECT max(row) FROM documents",
    ):
        try:
            value = db.execute(query).fetchone()
        except sqlite3.DatabaseError:
            continue
        if value is not None and isinstance(value[0], int):
            candidates.append(value[0])
    return max(candidates)
