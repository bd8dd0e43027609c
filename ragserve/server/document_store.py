"""The document registry: one SQLite database in the KV directory, one row per document.

``documents.sqlite3`` (WAL mode, ``synchronous=FULL``) holds a ``documents`` table keyed
by (model fingerprint, tenant namespace, document id), and beside it the status of each
row's ingestion (see :mod:`ragserve.server.registry_ingestions`: servers that share the
directory show it, and take over the ingestion of a server that died); ``PRAGMA
user_version`` is the schema version. Contracts:

- Atomic per document: ``put`` and ``delete`` are one transaction each, committed before
  they return, so after ``kill -9`` at any moment a row is there whole or not at all.
- Several processes may use one directory: each operation is a short transaction, and
  SQLite's file locks order them (writers wait up to ``BUSY_TIMEOUT_S``).
- Damage is found and contained: every row carries a checksum of its fields, and
  :meth:`DocumentStore.open` runs ``PRAGMA integrity_check``. A damaged row is reported
  and dropped; when the database itself is damaged the readable rows are copied to a fresh
  database that replaces it (see :mod:`ragserve.server.registry_repair`). A database that
  cannot be opened at all is reported and started afresh. Nothing here stops the server.
- Files are private: the database (and the ``-wal``/``-shm`` files SQLite gives the same
  mode) are created 0600.
- A JSON registry of earlier versions (``documents-<fp>.json``) is imported on first open
  and then removed, since it holds token ids a later DELETE could not reach.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from ragserve.engine.engine_info import KVModel
from ragserve.server import registry_ingestions as ingestions
from ragserve.server.legacy_registry import legacy_path, read_legacy
from ragserve.server.registry_cipher import RegistryCipher
from ragserve.server.registry_ingestions import IngestionRound, Key
from ragserve.server.registry_models import (
    ModelRecord,
    among,
    foreign_rows,
    record_model,
    sharing_models,
)
from ragserve.server.registry_repair import Intact, check
from ragserve.server.registry_rows import (
    SCHEMA,
    SCHEMA_VERSION,
    RowError,
    RowLocked,
    decode_row,
    encode_row,
)
from ragserve.server.stored_document import Status, StoredDocument

logger = logging.getLogger(__name__)

FILENAME = "documents.sqlite3"
BUSY_TIMEOUT_S = 30.0
FILE_MODE = 0o600


# The rows of one document (namespace, id) whose own expiry is at or before a time.
_EXPIRED = " WHERE namespace = ? AND id = ? AND expire_time IS NOT NULL AND expire_time <= ?"


class DocumentStore:
    """The registry rows of one model in ``directory``. Thread-safe; blocking calls.

    Call :meth:`open` once (it checks, repairs and migrates), then :meth:`load`,
    :meth:`put`, :meth:`delete`. An instance that failed to open keeps working in memory
    only: its writes are logged and dropped.

    ``lease_s``: how long an ingestion's lease lasts unless renewed (see
    :mod:`ragserve.server.registry_ingestions`); ``counts``: ``taken_over`` (ingestions
    taken over from a server that stopped renewing their lease, counted by the caller
    through :meth:`taken_over`).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        model_fingerprint: str,
        cipher: RegistryCipher | None = None,
        record: ModelRecord | None = None,
        lease_s: float = 10.0,
    ) -> None:
        self.directory = Path(directory)
        self.model = model_fingerprint
        self.cipher = cipher
        # This model's KV layout and tokenizer: rows of models with its tokenizer are
        # copied, and their KV purged with its own (None: neither, and it is not recorded).
        self.record = record
        self.path = self.directory / FILENAME
        self.lease_s = lease_s
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._taken_over = 0  # NOTE: counted and read on the event loop alone

    # -- opening -------------------------------------------------------------------------
    def open(self) -> list[str]:
        """Open (creating, checking, repairing, migrating); returns the problems found.

        Never raises for a damaged or foreign file; raises OSError when the directory
        cannot be created."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        problems: list[str] = []
        with self._lock:
            try:
                self._db = self._connect()
            except sqlite3.DatabaseError as exc:
                problems.append(f"cannot be opened ({exc}); started afresh")
                self._db = self._start_afresh()
            found, intact = check(self._db)
            if intact is not None:  # damaged: rebuild from the intact rows, reconnect
                self.replace_with(intact)
                self._db = self._connect()
            problems += found
            # NOTE: a crash between a delete's commit and its checkpoint left the row's
            # old pages in the log.
            self._truncate_log(self._db)
        problems += self._migrate_legacy()
        problems += self._record_model()
        for problem in problems:
            logger.warning("document registry %s: %s", self.path, problem)
        return problems

    def _connect(self) -> sqlite3.Connection:
        _create_private(self.path)
        db = sqlite3.connect(
            self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
        )
        try:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise sqlite3.DatabaseError(
                    f"schema version {version} is newer than this server's {SCHEMA_VERSION}"
                )
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            # NOTE: a deleted row's bytes are overwritten, not left in a free page.
            db.execute("PRAGMA secure_delete=ON")
            with _transaction(db):
                for statement in SCHEMA:
                    db.execute(statement)
                db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except BaseException:
            db.close()
            raise
        return db

    def _start_afresh(self) -> sqlite3.Connection:
        """Replace an unusable database with an empty one.

        NOTE: a newer schema is kept aside rather than deleted: a newer server may want it."""
        aside = self.path.with_name(f"{FILENAME}.unusable")
        for suffix in ("", "-wal", "-shm"):
            source = self.path.with_name(FILENAME + suffix)
            if source.exists():
                os.replace(source, aside.with_name(aside.name + suffix))
        return self._connect()

    def replace_with(self, intact: Intact) -> None:
        """Swap the database for a fresh one holding ``intact``'s rows (raw, checked).
        Lock held by the caller; leaves ``self._db`` None (the caller reconnects)."""
        if self._db is not None:
            self._db.close()
            self._db = None
        fresh = self.path.with_name(f".{FILENAME}.{os.getpid()}.rebuild")
        for suffix in ("", "-wal", "-shm"):
            fresh.with_name(fresh.name + suffix).unlink(missing_ok=True)
        _create_private(fresh)
        db = sqlite3.connect(fresh, isolation_level=None)
        try:
            with _transaction(db):
                for statement in SCHEMA:
                    db.execute(statement)
                db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
                db.executemany(_INSERT, intact.documents)
                db.executemany(_INSERT_MODEL, intact.models)
        finally:
            db.close()
        # NOTE: the old -wal/-shm belong to the damaged file; they must not be replayed
        # against the new one.
        for suffix in ("-wal", "-shm"):
            self.path.with_name(FILENAME + suffix).unlink(missing_ok=True)
        os.replace(fresh, self.path)

    def _migrate_legacy(self) -> list[str]:
        path = legacy_path(self.directory, self.model)
        try:
            problem, docs, skipped = read_legacy(path, self.model)
        except FileNotFoundError:
            return []
        except OSError as exc:
            return [f"the JSON registry {path.name} cannot be read ({exc}); not migrated"]
        problems = []
        if problem is not None:
            problems.append(f"the JSON registry {path.name} was not migrated: {problem}")
        if skipped:
            problems.append(f"{skipped} malformed entries of {path.name} were not migrated")
        try:
            with self._lock:
                db = self._require()
                with _transaction(db):
                    rows = [encode_row(self.model, d, self.cipher) for d in docs]
                    db.executemany(_INSERT_IF_ABSENT, rows)
        except sqlite3.Error as exc:
            return [*problems, f"migration of {path.name} failed ({exc}); it is kept"]
        path.unlink(missing_ok=True)
        logger.info("document registry: %d documents migrated from %s", len(docs), path.name)
        return problems

    def _record_model(self) -> list[str]:
        if self.record is None:
            return []
        try:
            with self._lock:
                db = self._require()
                with _transaction(db):
                    record_model(db, self.record)
        except sqlite3.Error as exc:
            return [f"this model's tokenizer could not be recorded ({exc})"]
        return []

    # -- rows ----------------------------------------------------------------------------
    def load(self) -> list[StoredDocument]:
        """This model's documents, oldest first. Damaged rows are reported and deleted."""
        with self._lock:
            db = self._db
            if db is None:
                return []
            raw = db.execute(_SELECT + " WHERE model = ? ORDER BY row", (self.model,)).fetchall()
            docs, damaged = [], []
            for row in raw:
                try:
                    docs.append(decode_row(row, self.cipher))
                except RowLocked as exc:
                    logger.warning(
                        "document registry %s: row %d kept, not served: %s", self.path, row[0], exc
                    )
                except RowError as exc:
                    logger.warning(
                        "document registry %s: row %d dropped: %s", self.path, row[0], exc
                    )
                    damaged.append((row[0],))
            if damaged:
                with _transaction(db):
                    db.executemany("DELETE FROM documents WHERE row = ?", damaged)
            return docs

    def adopt(
        self, namespaces: set[str], fits: Callable[[StoredDocument], bool]
    ) -> list[tuple[StoredDocument, KVModel]]:
        """Copy to this model the rows of ``namespaces`` that another model with this
        tokenizer holds and this one lacks (see :mod:`ragserve.server.registry_models`);
        returns (document, the model it was copied from). The other model's row stays: a
        server of that model may share the directory. Rows that do not decode, or that
        ``fits`` rejects (too long for this model), are not copied. Raises sqlite3.Error."""
        if self.record is None:
            return []
        adopted: list[tuple[StoredDocument, KVModel]] = []
        taken: set[tuple[str, str]] = set()
        with self._lock:
            db = self._require()
            with _transaction(db):
                for row, model in foreign_rows(db, self.record):
                    key = (row[2], row[3])
                    if key[0] not in namespaces or key in taken:
                        continue
                    try:
                        doc = decode_row(row, self.cipher)
                    except RowError:
                        continue  # NOTE: damaged or sealed: its own model's server reports it
                    if not fits(doc):
                        continue
                    db.execute(_INSERT_IF_ABSENT, encode_row(self.model, doc, self.cipher))
                    adopted.append((doc, model))
                    taken.add(key)
        return adopted

    def sharing_models(self) -> list[KVModel]:
        """The other recorded models with this tokenizer (whose KV a DELETE also purges).
        Raises sqlite3.Error."""
        if self.record is None:
            return []
        with self._lock:
            return sharing_models(self._require(), self.record)

    @property
    def is_open(self) -> bool:
        return self._db is not None

    def keys(self) -> set[tuple[str, str]]:
        """(namespace, id) of this model's rows. Raises sqlite3.Error."""
        with self._lock:
            rows = self._require().execute(
                "SELECT namespace, id FROM documents WHERE model = ?", (self.model,)
            )
            return {(str(ns), str(doc_id)) for ns, doc_id in rows.fetchall()}

    def has(self, namespace: str, doc_id: str) -> bool:
        """Whether this model has the document's row. Raises sqlite3.Error."""
        with self._lock:
            found = self._require().execute(
                "SELECT 1 FROM documents WHERE model = ? AND namespace = ? AND id = ?",
                (self.model, namespace, doc_id),
            )
            return found.fetchone() is not None

    def find(self, namespace: str, doc_id: str) -> StoredDocument | None:
        """This model's row of one document, decoded, with its ingestion's status; None
        when absent or damaged (a damaged row is left to ``load``, which reports it).
        Raises sqlite3.Error."""
        with self._lock:
            db = self._require()
            row = db.execute(
                _SELECT + " WHERE model = ? AND namespace = ? AND id = ?",
                (self.model, namespace, doc_id),
            ).fetchone()
            if row is None:
                return None
            key = (namespace, doc_id)
            status, error = ingestions.statuses(db, self.model, [key])[key]
        try:
            return replace(decode_row(row, self.cipher), status=status, error=error)
        except RowError:
            return None

    def put(
        self, doc: StoredDocument, ingesting_since: float | None = None, existing: bool = False
    ) -> bool:
        """Insert or replace one document's row (``existing``: replace only, False if there
        is none: another server deleted it); an upload's (``ingesting_since``: when its
        ingestion started, wall clock) also records the ingestion ``ingesting``, with its
        lease (see :mod:`ragserve.server.registry_ingestions`). Raises sqlite3.Error /
        OSError."""
        row = encode_row(self.model, doc, self.cipher)
        with self._lock:
            db = self._require()
            with _transaction(db):
                if existing:
                    return db.execute(_REPLACE, (*row[3:], *row[:3])).rowcount > 0
                db.execute(_UPSERT, row)
                if ingesting_since is not None:
                    key = (doc.namespace, doc.id)
                    ingestions.begin(db, self.model, key, ingesting_since + self.lease_s)
        return True

    def settle(self, namespace: str, doc_id: str, status: Status, error: str | None) -> bool:
        """Record how the document's ingestion here ended, where its entry says less;
        whether it did. Raises sqlite3.Error."""
        with self._lock:
            db = self._require()
            with _transaction(db):
                return ingestions.settle(db, self.model, (namespace, doc_id), status, error)

    def ingestions_round(
        self, renewing: list[Key], following: list[Key], now: float
    ) -> IngestionRound:
        """A watch round, in one transaction: renew the leases of the ingestions running
        here, claim those of the learned documents ``following`` whose lease lapsed at
        ``now`` (wall clock), read the statuses of the others (see
        :func:`registry_ingestions.watch_round`). Raises sqlite3.Error."""
        with self._lock:
            db = self._require()
            with _transaction(db):
                return ingestions.watch_round(
                    db, self.model, renewing, following, now, now + self.lease_s
                )

    @property
    def counts(self) -> dict[str, int]:
        return {"taken_over": self._taken_over}

    def taken_over(self) -> None:
        self._taken_over += 1

    def delete(self, namespace: str, doc_id: str) -> bool:
        """Delete one document's rows, under every model (its id names its text, whichever
        model served it); whether there was one. Raises sqlite3.Error."""
        with self._lock:
            db = self._require()
            with _transaction(db):
                cursor = db.execute(
                    "DELETE FROM documents WHERE namespace = ? AND id = ?", (namespace, doc_id)
                )
                ingestions.forget_gone(db, (namespace, doc_id))
            self._truncate_log(db)
            return cursor.rowcount > 0

    def expired_models(self, namespace: str, doc_id: str, now: float) -> list[KVModel]:
        """The other models (with this tokenizer) whose row of the document expired at or
        before ``now`` (``delete_expired`` would delete it). Raises sqlite3.Error."""
        with self._lock:
            return self._expired_models_locked(self._require(), namespace, doc_id, now)

    def delete_expired(self, namespace: str, doc_id: str, now: float) -> list[KVModel]:
        """Delete the document's rows whose own expire_time is at or before ``now``, under
        every model; returns the other models (with this tokenizer) whose row went.

        NOTE: a row of another model whose expiry was changed by a PATCH on its server
        stays: each row's expire_time decides for that row. Raises sqlite3.Error."""
        with self._lock:
            db = self._require()
            with _transaction(db):
                others = self._expired_models_locked(db, namespace, doc_id, now)
                cursor = db.execute("DELETE FROM documents" + _EXPIRED, (namespace, doc_id, now))
                ingestions.forget_gone(db, (namespace, doc_id))
            if cursor.rowcount:
                self._truncate_log(db)
            return others

    def _expired_models_locked(
        self, db: sqlite3.Connection, namespace: str, doc_id: str, now: float
    ) -> list[KVModel]:
        gone = db.execute(
            "SELECT DISTINCT model FROM documents" + _EXPIRED, (namespace, doc_id, now)
        ).fetchall()
        shared = sharing_models(db, self.record) if self.record is not None else []
        return among(shared, (str(row[0]) for row in gone))

    def _truncate_log(self, db: sqlite3.Connection) -> None:
        # NOTE: the WAL still holds the pages as they were before a delete; moving them
        # into the database and truncating the log leaves no copy of the row.
        busy = db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
        if busy:
            logger.warning(
                "document registry %s: the log could not be truncated now (a reader is "
                "active); the deleted row's old pages stay in it until the next checkpoint",
                self.path,
            )

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def _require(self) -> sqlite3.Connection:
        if self._db is None:
            raise sqlite3.OperationalError("the document registry is not open")
        return self._db


_COLUMNS = "model, namespace, id, token_ids, metadata, created, expire_time, checksum"
_SELECT = f"SELECT row, {_COLUMNS} FROM documents"
_INSERT = f"INSERT INTO documents ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
_INSERT_MODEL = (
    "INSERT OR REPLACE INTO models (fingerprint, tokenizer, block_size, kv_dtype)"
    " VALUES (?, ?, ?, ?)"
)
_INSERT_IF_ABSENT = _INSERT.replace("INSERT", "INSERT OR IGNORE", 1)
_UPSERT = (
    _INSERT + " ON CONFLICT (model, namespace, id) DO UPDATE SET token_ids = excluded.token_ids,"
    " metadata = excluded.metadata, created = excluded.created,"
    " expire_time = excluded.expire_time, checksum = excluded.checksum"
)
_REPLACE = (
    "UPDATE documents SET token_ids = ?, metadata = ?, created = ?, expire_time = ?,"
    " checksum = ? WHERE model = ? AND namespace = ? AND id = ?"
)


@contextmanager
def _transaction(db: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE (take the write lock up front, so no deadlock on upgrade) … COMMIT."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def _create_private(path: Path) -> None:
    """Create ``path`` empty with mode 0600 unless it exists (SQLite then keeps the mode)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        return
    os.close(fd)
