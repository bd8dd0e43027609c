"""The document registry shared through the remote tier's store (``--kv-remote-url``), so
replicas with no shared filesystem know every document.

Each row this server writes to its own registry is also published under
``ragserve:registry:v1:<model fingerprint>:<tenant namespace>:<document id>``, as the
bytes SQLite keeps (:func:`~ragserve.server.registry_rows.encode_row`: checksummed, and
sealed under ``--kv-encryption-key-file`` when one is given, so the store never holds
token ids in the clear then) behind a stamp line with the row's version (see
:mod:`ragserve.server.store_values`), and its id joins the set ``...:<namespace>:ids``
that a listing reads. A DELETE or an expiry replaces the row by a tombstone that lives
``TOMBSTONE_TTL_S``: a server that still knows the document forgets it at its next watch
round, and no server learns it again.

A PATCH publishes the row again under a higher version; a server that already knows the
document takes the newer row at its next watch round (see :meth:`StoreRegistry.stamps`).
Concurrent PATCHes on two servers: the one whose write reaches the store last gets the
higher version and wins on every server (the other server takes it at its next round). A
PATCH never replaces a tombstone (only an upload of the text does): a DELETE wins over a
PATCH whether the PATCH reaches the store before it or after.

A row also says how far the document's ingestion got (see
:mod:`ragserve.server.store_values`): the uploading server publishes it ``ingesting`` and
settles it when its ingestion ends, and a server that learned the document takes the
status with the row at its next watch round. A settle never overwrites a newer row (it
names the version this server holds), so a server that ingested a document settles its
row again at a watch round where the store's says less than it knows.

An ingestion holds a lease beside its row, renewed at each watch round (see
:mod:`ragserve.server.ingest_leases` and :meth:`StoreRegistry.watch_round`): when the
uploading server dies mid-ingestion, the lease lapses, and one of the servers that learned
the document claims it, ingests the document and settles the row, so no server shows it
``ingesting`` for good.

A row read from the store is trusted only once it decodes (checksum), opens under this
server's key, and names the model, tenant and id its key names; anything else is
counted in ``rejected`` and ignored, never served.

The store is a cache (its LRU may evict a row, it may restart empty), each server's own
SQLite stays its durable copy: a publish that fails is kept pending and tried again at
every watch round, and after an outage (or at start) every row this server holds is
offered again where the store lacks it (or holds an older version); so is a row that a
watch round finds missing (evicted, with no failed call to tell), and a tenant's listing
found missing is rebuilt from the rows the store still holds. A retried or offered row never replaces a tombstone: a document deleted elsewhere
meanwhile stays deleted.

Blocking calls, thread-safe: the document service runs them on its registry thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import redis

from kvstore.remote_store import RemoteStore, StoreUnavailable
from ragserve.server.ingest_leases import CLAIM, lease_key
from ragserve.server.registry_cipher import RegistryCipher
from ragserve.server.registry_rows import SEALED, RowError, decode_row, encode_row
from ragserve.server.store_values import (
    RELIST,
    STAMP_BYTES,
    WRITE,
    Stamp,
    row_body,
    row_status,
    stamp_of,
    unpack_row,
)
from ragserve.server.stored_document import StoredDocument

logger = logging.getLogger(__name__)

PREFIX = "ragserve:registry:v1"
TOMBSTONE_TTL_S = 24 * 3600
_FAILED = (StoreUnavailable, redis.RedisError)

# A document this server holds, with the version of its row it last wrote or read.
Held = tuple[StoredDocument, int]
# A document's (namespace, id).
Key = tuple[str, str]


class WatchRound(NamedTuple):
    """What a watch round read from the store (see :meth:`StoreRegistry.watch_round`)."""

    stamps: dict[Key, Stamp]
    claimed: set[Key]  # the ingestions this server now holds the lease of, to take over
    # Keys whose row the store lacks (see :meth:`StoreRegistry.offer`), and tenants whose
    # listing it lacks (see :meth:`StoreRegistry.relist`): evicted by its LRU, or it
    # restarted empty.
    missing: set[Key]
    unlisted: set[str]


def row_key(model: str, namespace: str, doc_id: str, prefix: str = PREFIX) -> str:
    return f"{prefix}:{model}:{namespace}:{doc_id}"


def ids_key(model: str, namespace: str, prefix: str = PREFIX) -> str:
    return f"{prefix}:{model}:{namespace}:ids"


def _raw(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


class StoreRegistry:
    """Publishes this server's rows of ``model`` to ``store`` and reads other servers'.

    ``counts``: ``published`` (rows and tombstones written), ``adopted`` (rows taken from
    the store, counted by the caller through :meth:`adopted`), ``refreshed`` (newer rows
    of known documents taken, counted through :meth:`refreshed`), ``taken_over``
    (ingestions taken over from a server that stopped renewing their lease, counted
    through :meth:`taken_over`), ``publish_failures``
    (attempts that failed; the write stays pending, a settle is made again by the watch),
    ``rejected`` (store values that did not verify).

    ``lease_s``: how long an ingestion's lease lasts unless renewed (see
    :mod:`ragserve.server.ingest_leases`)."""

    def __init__(
        self,
        store: RemoteStore,
        model: str,
        lease_s: float,
        cipher: RegistryCipher | None = None,
        prefix: str = PREFIX,
    ) -> None:
        self.store = store
        self.model = model
        self.cipher = cipher
        self.prefix = prefix
        self._lease_ms = max(1, round(lease_s * 1000))
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(
            ("published", "adopted", "refreshed", "taken_over", "publish_failures", "rejected"),
            0,
        )
        # (namespace, id) -> the write that failed: the row body (None: a tombstone), its
        # mode and version (see ``WRITE``); the latest wins.
        self._pending: dict[tuple[str, str], tuple[bytes | None, str, int]] = {}
        # (namespace, id) -> when it expired here: an expiry to check again once the store
        # answers, where the version of the row this server holds is unknown (0).
        self._expiring: dict[tuple[str, str], float] = {}
        # NOTE: set at start and when the store was unreachable (it may be back empty).
        self._offer_all = True
        self._script = store.client.register_script(WRITE)
        self._claim = store.client.register_script(CLAIM)
        self._relist = store.client.register_script(RELIST)

    @classmethod
    def connect(
        cls,
        url: str,
        model: str,
        cipher: RegistryCipher | None,
        timeout_s: float,
        retry_s: float,
        lease_s: float,
    ) -> StoreRegistry:
        """A registry on its own connection pool and breaker (its outage and the KV
        tier's are told apart in logs and metrics). Sends nothing yet."""
        holder: list[StoreRegistry] = []
        store = RemoteStore(
            url, timeout_s=timeout_s, retry_s=retry_s, on_down=lambda: holder[0].store_down()
        )
        holder.append(cls(store, model, lease_s, cipher))
        return holder[0]

    @property
    def counts(self) -> dict[str, int]:
        with self._lock:
            return {**self._counts, "pending": len(self._pending) + len(self._expiring)}

    def _count(self, name: str, by: int = 1) -> None:
        with self._lock:
            self._counts[name] += by

    def adopted(self) -> None:
        self._count("adopted")

    def refreshed(self) -> None:
        self._count("refreshed")

    def taken_over(self) -> None:
        self._count("taken_over")

    def store_down(self) -> None:
        with self._lock:
            self._offer_all = True

    # -- writing -------------------------------------------------------------------------
    def publish(self, doc: StoredDocument, patch: bool = False) -> int | None:
        """Write ``doc``'s row: an upload's replaces a tombstone, a PATCH's (``patch``)
        does not. Returns the version the store gave it; None when nothing was written (it
        failed and is kept pending, or a tombstone stays)."""
        written = self._write(doc.namespace, doc.id, self._body(doc), "patch" if patch else "row")
        return written if written is not None and written >= 0 else None

    def settle(self, doc: StoredDocument, version: int) -> int | None:
        """Write ``doc``'s row with the status its ingestion ended in, only over the row of
        ``version`` (the one this server holds: a newer one may carry another server's
        PATCH) and where that row's status says less (see ``WRITE``). Returns the version
        written; None when nothing was. A failed settle is not kept pending: the watch
        settles again while the store's row says less (see ``_sync_shared``)."""
        body = self._body(doc)
        written = self._write(doc.namespace, doc.id, body, "settle", keep=False, version=version)
        return written if written is not None and written >= 0 else None

    def _body(self, doc: StoredDocument) -> bytes:
        return row_body(encode_row(self.model, doc, self.cipher), doc.status, doc.error)

    def publish_gone(self, namespace: str, doc_id: str) -> bool:
        """Replace the document's row by a tombstone (DELETE, expiry)."""
        return self._write(namespace, doc_id, None, "gone") is not None

    def publish_expired(self, namespace: str, doc_id: str, now: float, version: int = 0) -> bool:
        """A tombstone for a document that expired here, unless the store's row says it
        lives on (a PATCH on another server moved its expiry, as its own registry row
        decides for a shared directory). ``version``: of the row this server holds. False
        when the store could not be read or written."""
        key = row_key(self.model, namespace, doc_id, self.prefix)
        try:
            value = self.store.call(lambda c: c.get(key))
        except _FAILED:
            if not version:  # NOTE: checked again, as now, once the store answers
                with self._lock:
                    self._counts["publish_failures"] += 1
                    self._expiring[(namespace, doc_id)] = now
                return False
            # NOTE: kept pending, only over the row this server holds: a PATCH that reached
            # the store meanwhile wins (every server expires the row by its own time).
            return self._write(namespace, doc_id, None, "expire", version=version) is not None
        raw = _raw(value) if value is not None else b""
        stamp = stamp_of(raw)
        if stamp is not None and not stamp.gone:
            try:
                expire = self._verify(namespace, doc_id, raw)[0].expire_time
            except RowError:
                expire = None  # NOTE: unreadable: nothing says it lives on
            else:
                if expire is None or expire > now:
                    return True
        # NOTE: only over the version just read (0: none, or a value of no format): a
        # PATCH or an upload that reached the store since wins.
        seen = stamp.version if stamp is not None else 0
        return self._write(namespace, doc_id, None, "expire", version=seen) is not None

    def retry(self, holding: Iterable[Held] = ()) -> int:
        """Write what is pending; after an outage (or at the first call) also offer the
        rows of ``holding`` (every document this server serves, with the version it
        holds) where the store lacks them or holds an older version. Returns how many are
        still pending."""
        with self._lock:
            pending = list(self._pending.items())
            expiring = list(self._expiring.items())
            offer = self._offer_all
        for (namespace, doc_id), (body, mode, version) in pending:
            # NOTE: as first asked: an upload's row replaces a tombstone (the text came
            # back after a delete), a PATCH's never does (deleted elsewhere meanwhile).
            if self._write(namespace, doc_id, body, mode, keep=False, version=version) is None:
                return self.counts["pending"]
        for (namespace, doc_id), expired_at in expiring:
            with self._lock:
                self._expiring.pop((namespace, doc_id), None)
            if not self.publish_expired(namespace, doc_id, expired_at):
                return self.counts["pending"]
        if offer:
            try:
                self._offer(holding)
            except _FAILED as exc:
                self._count("publish_failures")
                logger.warning("shared document registry: rows not offered: %s", exc)
            else:
                with self._lock:
                    self._offer_all = False
        return self.counts["pending"]

    def _call_write(
        self, client: Any, namespace: str, doc_id: str, body: bytes | None, mode: str, version: int
    ) -> Any:
        row = row_key(self.model, namespace, doc_id, self.prefix)
        keys = [row, ids_key(self.model, namespace, self.prefix), lease_key(row)]
        args: list[bytes | str | int] = [
            mode, body or b"", doc_id, version, TOMBSTONE_TTL_S, self._lease_ms
        ]  # fmt: skip
        return self._script(keys=keys, args=args, client=client)

    def _write(
        self,
        namespace: str,
        doc_id: str,
        body: bytes | None,
        mode: str,
        keep: bool = True,
        version: int = 0,
    ) -> int | None:
        """The script's answer (the version written, -1 when its rules wrote nothing: see
        ``WRITE``); None when the write failed (kept pending, unless not to ``keep``: a
        retry of what is pending, or a settle)."""
        try:
            written = int(
                self.store.call(
                    lambda c: self._call_write(c, namespace, doc_id, body, mode, version)
                )
            )
        except _FAILED as exc:
            with self._lock:
                self._counts["publish_failures"] += 1
                if keep:  # NOTE: a failed retry keeps what is pending (maybe newer)
                    self._pending[(namespace, doc_id)] = (body, mode, version)
            if keep:
                logger.warning(
                    "shared document registry: document %s not published yet (%s); "
                    "retried every watch round", doc_id, exc,
                )  # fmt: skip
            return None
        with self._lock:
            if written >= 0:
                self._counts["published"] += 1
            if mode in ("row", "gone"):  # NOTE: uploaded again, or deleted: nothing to expire
                self._expiring.pop((namespace, doc_id), None)
            entry = self._pending.get((namespace, doc_id))
            if keep or (entry is not None and entry[0] is body):
                self._pending.pop((namespace, doc_id), None)
        return written

    def _offer(self, holding: Iterable[Held]) -> None:
        held = list(holding)
        if not held:
            return

        def offer(client: redis.Redis) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for doc, version in held:
                self._call_write(pipe, doc.namespace, doc.id, self._body(doc), "offer", version)
            return list(pipe.execute())

        written = self.store.call(offer)
        self._count("published", sum(1 for version in written if int(version) >= 0))

    # -- reading -------------------------------------------------------------------------
    def listed(self, namespace: str) -> set[str]:
        """The ids the store lists for the tenant (may include rows that do not verify).
        Raises StoreUnavailable / redis.RedisError."""
        members = self.store.call(lambda c: c.smembers(ids_key(self.model, namespace, self.prefix)))
        return {m.decode() if isinstance(m, bytes) else str(m) for m in members}

    def fetch(self, namespace: str, doc_ids: list[str]) -> dict[str, Held]:
        """The verified rows of ``doc_ids`` the store holds, with their versions, in one
        round trip; tombstones and absent keys are left out, values that do not verify
        are counted and left out. Raises StoreUnavailable / redis.RedisError."""
        if not doc_ids:
            return {}
        keys = [row_key(self.model, namespace, doc_id, self.prefix) for doc_id in doc_ids]
        values = self.store.call(lambda c: c.mget(keys))
        found: dict[str, Held] = {}
        for doc_id, value in zip(doc_ids, values, strict=True):
            stamp = stamp_of(_raw(value)) if value is not None else None
            if value is None or (stamp is not None and stamp.gone):
                continue
            try:
                found[doc_id] = self._verify(namespace, doc_id, _raw(value))
            except RowError as exc:
                self._count("rejected")
                logger.warning("shared document registry: row of %s ignored: %s", doc_id[:32], exc)
        return found

    def stamps(self, keys: list[Key]) -> dict[Key, Stamp]:
        """The stamps (version, tombstone or row, status) the store holds for (namespace, id)
        ``keys``, in one round trip that reads a few bytes of each value: what a watch
        round compares with the versions it holds. Absent keys (the store may have evicted
        the row) and values that are neither are left out. Raises StoreUnavailable /
        redis.RedisError."""
        return self.watch_round(keys).stamps

    def watch_round(
        self, keys: list[Key], renewing: Sequence[Key] = (), claiming: Sequence[Key] = ()
    ) -> WatchRound:
        """In one round trip: the :meth:`stamps` of ``keys``; the leases of the ingestions
        running here (``renewing``) renewed; and the leases of ``claiming`` (learned
        documents whose rows said ``ingesting``) claimed where their row still says so
        and the lease lapsed: only one server wins each (see ``CLAIM``). Raises
        StoreUnavailable / redis.RedisError."""
        if not keys and not renewing and not claiming:
            return WatchRound({}, set(), set(), set())
        namespaces = sorted({namespace for namespace, _ in keys})

        def row(key: Key) -> str:
            return row_key(self.model, *key, self.prefix)

        def read(client: redis.Redis) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.getrange(row(key), 0, STAMP_BYTES - 1)
            for key in renewing:
                pipe.set(lease_key(row(key)), b"1", px=self._lease_ms)
            for key in claiming:
                self._claim(
                    keys=[row(key), lease_key(row(key))], args=[self._lease_ms], client=pipe
                )
            for namespace in namespaces:
                pipe.exists(ids_key(self.model, namespace, self.prefix))
            return list(pipe.execute())

        answers = self.store.call(read)
        stamps: dict[Key, Stamp] = {}
        missing: set[Key] = set()
        for key, head in zip(keys, answers[: len(keys)], strict=True):
            stamp = stamp_of(_raw(head)) if head else None
            if stamp is not None:
                stamps[key] = stamp
            elif not head:
                missing.add(key)
        claims = answers[len(keys) + len(renewing) : len(keys) + len(renewing) + len(claiming)]
        listings = answers[len(answers) - len(namespaces) :]
        unlisted = {ns for ns, there in zip(namespaces, listings, strict=True) if not there}
        claimed = {key for key, won in zip(claiming, claims, strict=True) if won}
        return WatchRound(stamps, claimed, missing, unlisted)

    def relist(self, namespace: str, doc_ids: list[str]) -> None:
        """Put those of ``doc_ids`` whose rows the store holds back in the tenant's
        listing, which the store lost (see ``RELIST``). Raises StoreUnavailable /
        redis.RedisError."""
        if doc_ids:
            keys = [ids_key(self.model, namespace, self.prefix)]
            keys += [row_key(self.model, namespace, doc_id, self.prefix) for doc_id in doc_ids]
            self.store.call(lambda c: self._relist(keys=keys, args=doc_ids, client=c))

    def offer(self, holding: Iterable[Held]) -> None:
        """Offer the rows of ``holding`` (documents this server serves, with the version
        it holds) where the store lacks them or holds an older version: after the store
        lost them (see :attr:`WatchRound.missing`). A tombstone stays. Raises
        StoreUnavailable / redis.RedisError."""
        self._offer(holding)

    def gone(self, keys: list[Key]) -> set[Key]:
        """Which of (namespace, id) ``keys`` the store holds a tombstone for (see
        :meth:`stamps`): an absent key is not gone. Raises StoreUnavailable /
        redis.RedisError."""
        return {key for key, stamp in self.stamps(keys).items() if stamp.gone}

    def _verify(self, namespace: str, doc_id: str, value: bytes) -> Held:
        """The row a value holds (with its status), and its version. Raises RowError."""
        row = unpack_row(value)
        # NOTE: the checksum covers the row's own model, tenant and id; the key must name
        # the same ones, or a row copied under another key would be served there.
        if tuple(row[1:4]) != (self.model, namespace, doc_id):
            raise RowError("the row names another model, tenant or document than its key")
        doc = decode_row(row, self.cipher)
        if self.cipher is not None and not bytes(row[4]).startswith(SEALED):
            raise RowError("a row in the clear where this server encrypts its rows")
        status, error = row_status(value)
        stamp = stamp_of(value)
        return replace(doc, status=status, error=error), stamp.version if stamp is not None else 0

    def close(self) -> None:
        self.store.close()
