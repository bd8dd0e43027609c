"""The document registry shared through the remote tier's store (``--kv-remote-url``), so
replicas with no shared filesystem know every document.

Each row this server writes to its own registry is also published under
``ragserve:registry:v1:<model fingerprint>:<tenant namespace>:<document id>``, as the
bytes SQLite keeps (:func:`~ragserve.server.registry_rows.encode_row`: checksummed, and
sealed under ``--kv-encryption-key-file`` when one is given, so the store never holds
token ids in the clear then), and its id joins the set ``...:<namespace>:ids`` that a
listing reads. A DELETE or an expiry replaces the row by a tombstone that lives
``TOMBSTONE_TTL_S``: a server that still knows the document forgets it at its next watch
round, and no server learns it again.

A row read from the store is trusted only once it decodes (checksum), opens under this
server's key, and names the model, tenant and id its key names; anything else is
counted in ``rejected`` and ignored, never served.

The store is a cache (its LRU may evict a row, it may restart empty), each server's own
SQLite stays its durable copy: a publish that fails is kept pending and tried again at
every watch round, and after an outage (or at start) every row this server holds is
offered again where the store lacks it. A retried or offered row never replaces a
tombstone: a document deleted elsewhere meanwhile stays deleted.

Blocking calls, thread-safe: the document service runs them on its registry thread.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable
from typing import Any

import redis

from kvstore.remote_store import RemoteStore, StoreUnavailable
from ragserve.server.registry_cipher import RegistryCipher
from ragserve.server.registry_rows import SEALED, Row, RowError, decode_row, encode_row
from ragserve.server.stored_document import StoredDocument

logger = logging.getLogger(__name__)

PREFIX = "ragserve:registry:v1"
TOMBSTONE_TTL_S = 24 * 3600
_ROW = b"ragserve-row-v1\n"
_GONE = b"ragserve-gone-v1\n"
_FAILED = (StoreUnavailable, redis.RedisError)

# NOTE: one round trip that writes a row unless the key holds a tombstone (ARGV[3] = "1":
# unless the key holds anything), so a retry never brings back a deleted document.
_SET_UNLESS_GONE = """
local old = redis.call('GET', KEYS[1])
if old and (ARGV[3] == '1' or string.sub(old, 1, string.len(ARGV[2])) == ARGV[2]) then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[4])
return 1
"""


def row_key(model: str, namespace: str, doc_id: str, prefix: str = PREFIX) -> str:
    return f"{prefix}:{model}:{namespace}:{doc_id}"


def ids_key(model: str, namespace: str, prefix: str = PREFIX) -> str:
    return f"{prefix}:{model}:{namespace}:ids"


def pack_row(row: Row) -> bytes:
    """The store's value of a row (:func:`encode_row`'s columns): a magic line, a JSON
    head of the text columns, a newline, then the token column's bytes."""
    model, namespace, doc_id, blob, metadata, created, expire, digest = row
    head = json.dumps([model, namespace, doc_id, metadata, created, expire, digest])
    return _ROW + head.encode() + b"\n" + bytes(blob)


def unpack_row(value: bytes) -> Row:
    """The row as ``decode_row`` reads it (``row`` column 0). Raises RowError."""
    if not value.startswith(_ROW):
        raise RowError("not a registry row")
    head, sep, blob = value[len(_ROW) :].partition(b"\n")
    try:
        fields = json.loads(head) if sep else None
    except ValueError:
        fields = None
    if not isinstance(fields, list) or len(fields) != 7:
        raise RowError("malformed row head")
    model, namespace, doc_id, metadata, created, expire, digest = fields
    if isinstance(expire, int) and not isinstance(expire, bool):
        expire = float(expire)  # NOTE: JSON writes 5.0 as 5.0, but be lenient with ints
    return (0, model, namespace, doc_id, blob, metadata, created, expire, digest)


def _raw(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


class StoreRegistry:
    """Publishes this server's rows of ``model`` to ``store`` and reads other servers'.

    ``counts``: ``published`` (rows and tombstones written), ``adopted`` (rows taken from
    the store, counted by the caller through :meth:`adopted`), ``publish_failures``
    (attempts that failed; the write stays pending), ``rejected`` (store values that did
    not verify)."""

    def __init__(
        self,
        store: RemoteStore,
        model: str,
        cipher: RegistryCipher | None = None,
        prefix: str = PREFIX,
    ) -> None:
        self.store = store
        self.model = model
        self.cipher = cipher
        self.prefix = prefix
        self._lock = threading.Lock()
        self._counts = {"published": 0, "adopted": 0, "publish_failures": 0, "rejected": 0}
        # (namespace, id) -> the value to write (None: a tombstone); the latest wins.
        self._pending: dict[tuple[str, str], bytes | None] = {}
        # NOTE: set at start and when the store was unreachable (it may be back empty).
        self._offer_all = True
        self._script = store.client.register_script(_SET_UNLESS_GONE)

    @classmethod
    def connect(
        cls,
        url: str,
        model: str,
        cipher: RegistryCipher | None,
        timeout_s: float,
        retry_s: float,
    ) -> StoreRegistry:
        """A registry on its own connection pool and breaker (its outage and the KV
        tier's are told apart in logs and metrics). Sends nothing yet."""
        holder: list[StoreRegistry] = []
        store = RemoteStore(
            url, timeout_s=timeout_s, retry_s=retry_s, on_down=lambda: holder[0].store_down()
        )
        holder.append(cls(store, model, cipher))
        return holder[0]

    @property
    def counts(self) -> dict[str, int]:
        with self._lock:
            return {**self._counts, "pending": len(self._pending)}

    def _count(self, name: str, by: int = 1) -> None:
        with self._lock:
            self._counts[name] += by

    def adopted(self) -> None:
        self._count("adopted")

    def store_down(self) -> None:
        with self._lock:
            self._offer_all = True

    # -- writing -------------------------------------------------------------------------
    def publish(self, doc: StoredDocument) -> bool:
        """Write ``doc``'s row (upload, PATCH); False when it failed (kept pending)."""
        value = pack_row(encode_row(self.model, doc, self.cipher))
        return self._write(doc.namespace, doc.id, value, retry=False)

    def publish_gone(self, namespace: str, doc_id: str) -> bool:
        """Replace the document's row by a tombstone (DELETE, expiry)."""
        return self._write(namespace, doc_id, None, retry=False)

    def publish_expired(self, namespace: str, doc_id: str, now: float) -> bool:
        """A tombstone for a document that expired here, unless the store's row says it
        lives on (a PATCH on another server moved its expiry, as its own registry row
        decides for a shared directory). False when the store could not be read or written."""
        key = row_key(self.model, namespace, doc_id, self.prefix)
        try:
            value = self.store.call(lambda c: c.get(key))
        except _FAILED:
            value = None  # NOTE: expired here: the tombstone is written when it can be
        if value is not None and value != _GONE:
            try:
                expire = self._verify(namespace, doc_id, _raw(value)).expire_time
            except RowError:
                expire = None  # NOTE: unreadable: nothing says it lives on
            else:
                if expire is None or expire > now:
                    return True
        return self.publish_gone(namespace, doc_id)

    def retry(self, holding: Iterable[StoredDocument] = ()) -> int:
        """Write what is pending; after an outage (or at the first call) also offer the
        rows of ``holding`` (every document this server serves) where the store lacks
        them. Returns how many are still pending."""
        with self._lock:
            pending = list(self._pending.items())
            offer = self._offer_all
        for (namespace, doc_id), value in pending:
            if not self._write(namespace, doc_id, value, retry=True):
                return len(self._pending)
        if offer:
            try:
                self._offer(holding)
            except _FAILED as exc:
                self._count("publish_failures")
                logger.warning("shared document registry: rows not offered: %s", exc)
            else:
                with self._lock:
                    self._offer_all = False
        return len(self._pending)

    def _write(self, namespace: str, doc_id: str, value: bytes | None, retry: bool) -> bool:
        key = row_key(self.model, namespace, doc_id, self.prefix)
        ids = ids_key(self.model, namespace, self.prefix)

        def write(client: redis.Redis) -> None:
            if value is None:
                pipe = client.pipeline(transaction=True)
                pipe.set(key, _GONE, ex=TOMBSTONE_TTL_S)
                pipe.srem(ids, doc_id)
                pipe.execute()
            elif retry:
                self._script(keys=[key, ids], args=[value, _GONE, "0", doc_id], client=client)
            else:
                pipe = client.pipeline(transaction=True)
                pipe.set(key, value)
                pipe.sadd(ids, doc_id)
                pipe.execute()

        try:
            self.store.call(write)
        except _FAILED as exc:
            with self._lock:
                self._counts["publish_failures"] += 1
                if not retry:  # NOTE: a failed retry keeps what is pending (maybe newer)
                    self._pending[(namespace, doc_id)] = value
            if not retry:
                logger.warning(
                    "shared document registry: document %s not published yet (%s); "
                    "retried every watch round", doc_id, exc,
                )  # fmt: skip
            return False
        with self._lock:
            self._counts["published"] += 1
            if not retry or self._pending.get((namespace, doc_id), b"") is value:
                self._pending.pop((namespace, doc_id), None)
        return True

    def _offer(self, holding: Iterable[StoredDocument]) -> None:
        docs = list(holding)
        if not docs:
            return

        def offer(client: redis.Redis) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for doc in docs:
                value = pack_row(encode_row(self.model, doc, self.cipher))
                keys = [
                    row_key(self.model, doc.namespace, doc.id, self.prefix),
                    ids_key(self.model, doc.namespace, self.prefix),
                ]
                self._script(keys=keys, args=[value, _GONE, "1", doc.id], client=pipe)
            return list(pipe.execute())

        written = self.store.call(offer)
        self._count("published", sum(1 for done in written if done == 1))

    # -- reading -------------------------------------------------------------------------
    def listed(self, namespace: str) -> set[str]:
        """The ids the store lists for the tenant (may include rows that do not verify).
        Raises StoreUnavailable / redis.RedisError."""
        members = self.store.call(lambda c: c.smembers(ids_key(self.model, namespace, self.prefix)))
        return {m.decode() if isinstance(m, bytes) else str(m) for m in members}

    def fetch(self, namespace: str, doc_ids: list[str]) -> dict[str, StoredDocument]:
        """The verified rows of ``doc_ids`` the store holds, in one round trip; tombstones
        and absent keys are left out, values that do not verify are counted and left out.
        Raises StoreUnavailable / redis.RedisError."""
        if not doc_ids:
            return {}
        keys = [row_key(self.model, namespace, doc_id, self.prefix) for doc_id in doc_ids]
        values = self.store.call(lambda c: c.mget(keys))
        found: dict[str, StoredDocument] = {}
        for doc_id, value in zip(doc_ids, values, strict=True):
            if value is None or value == _GONE:
                continue
            try:
                found[doc_id] = self._verify(namespace, doc_id, _raw(value))
            except RowError as exc:
                self._count("rejected")
                logger.warning("shared document registry: row of %s ignored: %s", doc_id[:32], exc)
        return found

    def gone(self, keys: list[tuple[str, str]]) -> set[tuple[str, str]]:
        """Which of (namespace, id) ``keys`` the store holds a tombstone for, in one round
        trip. An absent key is not gone: the store may have evicted the row. Raises
        StoreUnavailable / redis.RedisError."""
        if not keys:
            return set()
        names = [row_key(self.model, ns, doc_id, self.prefix) for ns, doc_id in keys]
        values = self.store.call(lambda c: c.mget(names))
        return {key for key, value in zip(keys, values, strict=True) if value == _GONE}

    def _verify(self, namespace: str, doc_id: str, value: bytes) -> StoredDocument:
        row = unpack_row(value)
        # NOTE: the checksum covers the row's own model, tenant and id; the key must name
        # the same ones, or a row copied under another key would be served there.
        if tuple(row[1:4]) != (self.model, namespace, doc_id):
            raise RowError("the row names another model, tenant or document than its key")
        doc = decode_row(row, self.cipher)
        if self.cipher is not None and not bytes(row[4]).startswith(SEALED):
            raise RowError("a row in the clear where this server encrypts its rows")
        return doc

    def close(self) -> None:
        self.store.close()
