"""The document registry's persistence glue: restore at start-up, take over other
models' documents, write and delete rows on the registry thread, follow the ingestions
of the servers sharing the directory (see :mod:`ragserve.server.registry_ingestions`),
and share the rows through the store (see :mod:`ragserve.server.store_registry`) when
there is one.

:class:`~ragserve.server.documents.DocumentService` inherits this; it owns the state
named below and the lifecycle these methods call back into (fit checks, registration,
KV purge).
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

import redis

from kvstore.remote_store import StoreUnavailable
from ragserve.engine.engine_info import KVModel
from ragserve.server.document_expiry import ExpirySweeper
from ragserve.server.document_locks import DocumentLocks
from ragserve.server.document_store import DocumentStore
from ragserve.server.document_watch import RegistryWatch
from ragserve.server.errors import APIError
from ragserve.server.prompts import PromptBuilder
from ragserve.server.registered_document import RegisteredDocument
from ragserve.server.store_registry import StoreRegistry
from ragserve.server.stored_document import PROGRESS, StoredDocument

# NOTE: the registry's log lines keep the logger name they had before this module split off.
logger = logging.getLogger("ragserve.server.documents")

_T = TypeVar("_T")


class RowGone(Exception):
    """The row a PATCH would rewrite is gone: another server deleted the document."""


class DocumentPersistence:
    """Restores, adopts and writes the registry's rows for ``DocumentService``.

    Contract with the subclass: it sets the attributes declared here and implements
    ``_check_fits``, ``_register`` and ``_purge``. Event-loop only; registry calls run
    on ``_store_thread`` (one thread: rows are written in the order asked for).
    """

    store: DocumentStore | None
    shared: StoreRegistry | None
    prompts: PromptBuilder
    expiry: ExpirySweeper
    watch: RegistryWatch
    locks: DocumentLocks
    _docs: dict[tuple[str, str], RegisteredDocument]
    _store_thread: ThreadPoolExecutor
    # Keys whose latest row (an upload's, a PATCH's) failed to be written, and keys whose
    # rows' delete failed: written again by the watch and at shutdown, so that a restart
    # neither forgets an answered upload nor brings back a deleted document.
    _unsaved: set[tuple[str, str]]
    _undeleted: set[tuple[str, str]]

    def _check_fits(self, num_tokens: int, num_prefix_tokens: int) -> None:
        raise NotImplementedError

    def _register(self, doc: RegisteredDocument) -> None:
        """Hold ``doc`` and start its ingestion."""
        raise NotImplementedError

    async def _purge(self, doc: RegisteredDocument, models: Sequence[KVModel | None]) -> None:
        raise NotImplementedError

    async def restore(self, tenants: set[str]) -> int:
        """Open the registry, register and re-ingest the stored documents of ``tenants``;
        returns how many.

        Never raises for a damaged database or row (see
        :mod:`ragserve.server.document_store`): what is damaged is reported and dropped.
        """
        self.expiry.start()
        if self.store is None:
            if self.shared is not None:
                self.watch.start()
            return 0
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._store_thread, self.store.open)
        stored = await loop.run_in_executor(self._store_thread, self.store.load)
        self.watch.start()
        restored = 0
        # NOTE: expired rows last, so their purge pairs them with every live document
        # (see :mod:`ragserve.server.purge_plan`).
        now = time.time()
        stored.sort(key=lambda entry: entry.expire_time is not None and entry.expire_time <= now)
        for entry in stored:
            if entry.namespace not in tenants or (entry.namespace, entry.id) in self._docs:
                continue
            doc = await self._from_row(entry)
            if doc is not None:
                doc.saved = True
                self._register(doc)
                restored += 1
        if stored:
            logger.info(
                "document registry %s: %d documents restored, %d kept for other tenants",
                self.store.path, restored, len(stored) - restored,
            )  # fmt: skip
        return restored + await self._adopt(tenants)

    async def _adopt(self, tenants: set[str]) -> int:
        """Take over the documents another model with this tokenizer ingested (see
        :mod:`ragserve.server.registry_models`): their rows are copied, the other model's
        rows and KV stay (a server of that model may be running on this directory). They
        are listed and answer at once; their KV is computed for this model at first use,
        not now: the other model's documents may be many and rarely used. Until then a
        response names ``different_model`` as why the document was not cached."""
        assert self.store is not None
        loop = asyncio.get_running_loop()
        try:
            adopted = await loop.run_in_executor(
                self._store_thread, self.store.adopt, tenants, self._fits
            )
        except sqlite3.Error as exc:
            logger.warning(
                "document registry %s: other models' documents: %s", self.store.path, exc
            )
            return 0
        count = 0
        for entry, model in adopted:
            doc = await self._from_row(entry)
            if doc is None or (doc.namespace, doc.id) in self._docs:
                continue
            doc.status, doc.previous_model, doc.saved = "ready", model, True
            self._docs[(doc.namespace, doc.id)] = doc
            count += 1
        if adopted:
            logger.info(
                "document registry %s: %d documents of other models with this tokenizer taken "
                "over (copied); their KV is computed again at first use",
                self.store.path, count,
            )  # fmt: skip
        return count

    def _fits(self, entry: StoredDocument) -> bool:
        """Whether a stored document fits this model (run on the registry thread)."""
        try:
            self._check_fits(
                len(entry.token_ids), len(self.prompts.document_prefix(entry.token_ids))
            )
        except APIError as exc:
            logger.warning("stored document %s not taken over: %s", entry.id, exc.message)
            return False
        return True

    async def _from_row(self, entry: StoredDocument) -> RegisteredDocument | None:
        """The document a stored row describes; None when it expired while no server ran
        (its row and KV go now) or does not fit this model (its row stays)."""
        prefix_ids = self.prompts.document_prefix(entry.token_ids)
        if entry.expire_time is not None and entry.expire_time <= time.time():
            await self._drop_expired(entry, prefix_ids)
            return None
        try:
            self._check_fits(len(entry.token_ids), len(prefix_ids))
        except APIError as exc:
            logger.warning("stored document %s not restored: %s", entry.id, exc.message)
            return None
        doc = RegisteredDocument(
            entry.id, entry.namespace, entry.token_ids, prefix_ids, entry.metadata, entry.created
        )
        doc.expire_time = entry.expire_time
        return doc

    async def _drop_expired(self, entry: StoredDocument, prefix_ids: list[int]) -> None:
        """A stored document that expired while no server ran: its expired rows go now,
        with the KV of this model and of each model whose row went."""
        key = (entry.namespace, entry.id)
        now = time.time()
        others = await self._store_call(
            "read", self._models_of_rows, entry.namespace, entry.id, "expired", now
        )
        doc = RegisteredDocument(
            entry.id, entry.namespace, entry.token_ids, prefix_ids, entry.metadata, entry.created
        )
        # NOTE: a live document of the same text keeps this model's blocks.
        mine: list[KVModel | None] = [] if key in self._docs else [None]
        await self._purge(doc, [*mine, *(others or [])])
        # NOTE: the rows go after the KV (see ``_remove``).
        await self._store_call("deleted", self._delete_expired_rows, entry.namespace, entry.id, now)
        logger.info("document %s expired while the server was down; deleted", entry.id)

    # NOTE: the local row is committed first; publishing to the store never raises (a
    # failed publish stays pending in ``shared``), so a store outage fails no upload.
    def _put_row(self, doc: StoredDocument, patch: bool = False, saved: bool = False) -> int:
        """Write the row of an upload (of a PATCH: ``patch``; of a document whose row was
        written before: ``saved``); returns the version the store gave it, 0 when it was
        not published (no store, failed, or a tombstone). An upload's row records its
        ingestion as started (a PATCH's leaves it be). Raises RowGone for a row written
        before and deleted since (by another server)."""
        started = None if patch else time.time()
        if self.store is not None and not self.store.put(doc, started, existing=patch and saved):
            raise RowGone(f"document {doc.id} was deleted by another server")
        if self.shared is not None:
            return self.shared.publish(doc, patch) or 0
        return 0

    async def _settle(self, doc: RegisteredDocument) -> None:
        """Settle the store's row of ``doc`` once its ingestion here ended (see
        :meth:`StoreRegistry.settle`), so the servers that learned it show its status.
        The document's lock is held."""
        if self.shared is None or not doc.ingested_here:
            return
        if self._docs.get((doc.namespace, doc.id)) is not doc:
            return  # NOTE: deleted (or replaced by an upload) meanwhile
        version = await self._store_call("settled", self.shared.settle, doc.stored(), doc.version)
        if version:  # NOTE: written over the row this server held: it holds this one now
            doc.version = version

    async def _settle_directory(self, doc: RegisteredDocument) -> None:
        """Record in the directory how the ingestion of ``doc`` here ended (see
        :mod:`ragserve.server.registry_ingestions`), so the servers sharing it that
        learned the document show its status. The document's lock is held."""
        if self.store is None or not self.store.is_open or not doc.ingested_here:
            return
        if self._docs.get((doc.namespace, doc.id)) is not doc:
            return  # NOTE: deleted (or replaced by an upload) meanwhile
        await self._store_call(
            "settled", self.store.settle, doc.namespace, doc.id, doc.status, doc.error
        )

    def _leases(self) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """The keys of the ingestions whose lease this server renews (its own) and of
        those whose lease it claims once lapsed (another server's)."""
        renewing = sorted(key for key, doc in self._docs.items() if doc.ingesting_here)
        claiming = sorted(key for key, doc in self._docs.items() if doc.ingesting_elsewhere)
        return renewing, claiming

    async def _sync_ingestions(self) -> None:
        """A watch round on the directory's ingestions, in one transaction: renew the
        leases of the ingestions running here; without a store (whose rows then carry
        the statuses, see ``_sync_shared``), claim the leases of learned documents still
        ``ingesting`` whose server stopped renewing them, take over those ingestions, and
        take the statuses of the others."""
        assert self.store is not None
        renewing, following = self._leases()
        if self.shared is not None:
            following = []  # NOTE: the store's rows carry the statuses (see _sync_shared)
        if not renewing and not following:
            return  # NOTE: an idle server takes no write lock
        read = await self._store_call(
            "followed", self.store.ingestions_round, renewing, following, time.time()
        )
        if read is None:
            return
        for key, (status, error) in read.statuses.items():
            doc = self._docs.get(key)
            if doc is not None and doc.learned and status != "ingesting":
                doc.status, doc.error = status, error
        await self._take_over(sorted(read.claimed), self.store.taken_over)

    def _copy_row(self, doc: StoredDocument) -> bool:
        """A row learned from the store, into this server's own registry only."""
        assert self.store is not None
        self.store.put(doc)
        return True

    def _models_of_rows(
        self, namespace: str, doc_id: str, rows: Literal["all", "expired"], now: float
    ) -> list[KVModel]:
        """The other models with this tokenizer whose KV of the document goes with its
        ``rows`` (every row, or those expired at ``now``)."""
        if self.store is None:
            return []
        if rows == "expired":
            return self.store.expired_models(namespace, doc_id, now)
        return self.store.sharing_models()

    def _delete_rows(self, namespace: str, doc_id: str) -> bool:
        """Every model's row; True once done."""
        if self.store is not None:
            self.store.delete(namespace, doc_id)
        if self.shared is not None:
            self.shared.publish_gone(namespace, doc_id)
        return True

    def _rewrite_row(self, doc: StoredDocument, saved: bool, learned: bool) -> int:
        """Write again a row whose write failed: a PATCH's over the row it changes
        (``saved``; ``learned``: another server's document, whose row is never written as
        an upload's here), else an upload's, with how its ingestion here ended since."""
        if saved or learned:
            return self._put_row(doc, patch=True, saved=saved)
        version = self._put_row(doc)
        if self.store is not None and doc.status != "ingesting":
            self.store.settle(doc.namespace, doc.id, doc.status, doc.error)
        return version

    @property
    def _has_registry(self) -> bool:
        return self.store is not None or self.shared is not None

    def _pending_write(self, doc: RegisteredDocument, written: bool) -> None:
        """Note whether ``doc``'s latest row was written (see ``_unsaved``)."""
        key = (doc.namespace, doc.id)
        if written or not self._has_registry:
            self._unsaved.discard(key)
            if not doc.learned:  # NOTE: its upload's row replaced the rows of a delete
                self._undeleted.discard(key)
        else:
            self._unsaved.add(key)

    async def _write_pending_rows(self) -> None:
        """Delete the rows whose delete failed and write those whose write failed (see
        ``_unsaved``), until one fails again: the registry is still failing then, and
        the rest wait for the next round rather than each waiting out its error."""
        for key in sorted(self._undeleted):
            async with self.locks.hold(*key):
                if key in self._docs:
                    continue  # NOTE: uploaded again since: its row write ends the delete
                if not await self._store_call("deleted", self._delete_rows, *key):
                    return
                self._undeleted.discard(key)
        for key in sorted(self._unsaved):
            async with self.locks.hold(*key):
                doc = self._docs.get(key)
                if doc is not None:
                    try:
                        version = await self._store_call(
                            "saved", self._rewrite_row, doc.stored(), doc.saved, doc.learned
                        )
                    except RowGone:  # NOTE: deleted elsewhere: the watch forgets it
                        version = 0
                    if version is None:
                        return
                    doc.saved, doc.version = True, version or doc.version
                    if not doc.learned:
                        self._undeleted.discard(key)
                    logger.info("document %s: registry row written", doc.id)
                self._unsaved.discard(key)

    def _delete_expired_rows(
        self, namespace: str, doc_id: str, now: float, version: int = 0
    ) -> None:
        """The rows that expired at ``now``; ``version``: of the store's row this server
        holds (see :meth:`StoreRegistry.publish_expired`)."""
        if self.store is not None:
            self.store.delete_expired(namespace, doc_id, now)
        if self.shared is not None:
            self.shared.publish_expired(namespace, doc_id, now, version)

    # -- the registry shared through the store -------------------------------------------
    async def _from_shared(
        self, namespace: str, doc_ids: list[str]
    ) -> dict[str, tuple[StoredDocument, int]]:
        """The verified rows the store holds for ``doc_ids``, with their versions (one
        round trip); {} without a store or when it cannot be reached."""
        if self.shared is None or not doc_ids:
            return {}
        found = await self._shared_call(self.shared.fetch, namespace, doc_ids)
        return found or {}

    async def learn_listed(self, namespace: str) -> None:
        """Learn the tenant's documents the store lists and this server does not know
        (for a listing): one round trip for the ids, one for the unknown rows."""
        if self.shared is None:
            return
        ids = await self._shared_call(self.shared.listed, namespace)
        unknown = sorted(doc_id for doc_id in ids or () if (namespace, doc_id) not in self._docs)
        if unknown:
            await self.learn(namespace, unknown)

    async def learn(self, namespace: str, doc_ids: Sequence[str]) -> int:
        raise NotImplementedError

    async def _sync_shared(self) -> int:
        """A watch round on the store: write what is pending (offering every row after an
        outage); in one round trip, read the stamps of every known document's row, renew
        the leases of the ingestions running here and claim those of learned documents
        whose ingestion's server stopped renewing them; forget the documents whose row
        another server replaced by a tombstone, take the newer rows (a PATCH or a settle
        on another server) of the others, take over the ingestions claimed, and settle the
        rows that say less of an ingestion here than this server knows (its own settle
        failed or came too early, or a PATCH elsewhere wrote an older status). Returns how
        many were forgotten."""
        assert self.shared is not None
        holding = [(doc.stored(), doc.version) for doc in self._docs.values()]
        await self._shared_call(self.shared.retry, holding)
        renewing, claiming = self._leases()
        read = await self._shared_call(
            self.shared.watch_round, sorted(self._docs), renewing, claiming
        )
        stamps = read.stamps if read is not None else {}
        # NOTE: rows the store lost (evicted, restarted empty), and rows of an older
        # version than this server holds (another server offered its older copy first).
        lost = (read.missing if read is not None else set()) | {
            key
            for key, stamp in stamps.items()
            if not stamp.gone and key in self._docs and stamp.version < self._docs[key].version
        }
        if lost:
            held = [
                (self._docs[key].stored(), self._docs[key].version)
                for key in sorted(lost)
                if key in self._docs
            ]
            await self._shared_call(self.shared.offer, held)
        for namespace in sorted(read.unlisted if read is not None else ()):
            listed = [
                i for (ns, i), stamp in sorted(stamps.items()) if ns == namespace and not stamp.gone
            ]
            await self._shared_call(self.shared.relist, namespace, listed)
        newer = [
            key
            for key, stamp in stamps.items()
            if not stamp.gone and key in self._docs and stamp.version > self._docs[key].version
        ]
        await self._refresh_shared(sorted(newer))
        if read is not None:
            await self._take_over(sorted(read.claimed), self.shared.taken_over)
        behind = [
            key
            for key, stamp in stamps.items()
            if not stamp.gone
            and key in self._docs
            and self._docs[key].ingested_here
            and PROGRESS[stamp.status] < PROGRESS[self._docs[key].status]
        ]
        for namespace, doc_id in sorted(behind):
            async with self.locks.hold(namespace, doc_id):
                doc = self._docs.get((namespace, doc_id))
                if doc is not None:
                    await self._settle(doc)
        gone = [key for key, stamp in stamps.items() if stamp.gone]
        forgotten = 0
        for namespace, doc_id in sorted(gone):
            doc = self._docs.get((namespace, doc_id))
            if doc is None:
                continue
            async with self.locks.hold(namespace, doc_id):
                # NOTE: checked again under the lock: an upload of this text may have
                # replaced it (and published its row) since the store was read.
                if self._docs.get((namespace, doc_id)) is not doc:
                    continue
                still = await self._shared_call(self.shared.gone, [(namespace, doc_id)])
                if not still:
                    continue
                if self.store is not None:  # NOTE: or the local watch would learn it back
                    await self._store_call("deleted", self.store.delete, namespace, doc_id)
                await self._remove(doc, rows="none")
            logger.info("document %s was deleted by another server (store); forgotten", doc_id)
            forgotten += 1
        return forgotten

    async def _take_over(self, keys: list[tuple[str, str]], counted: Callable[[], None]) -> None:
        """Ingest the learned documents ``keys`` here: this server claimed their lease (in
        the store, see :mod:`ragserve.server.ingest_leases`, or in the directory, see
        :mod:`ragserve.server.registry_ingestions`), so the server that was ingesting them
        stopped. This server then settles their rows (see ``_ingest``), as it does an
        upload's; ``counted`` counts each one taken over."""
        for namespace, doc_id in keys:
            async with self.locks.hold(namespace, doc_id):
                doc = self._docs.get((namespace, doc_id))
                # NOTE: a document forgotten or settled since the claim: its lease lapses.
                if doc is None or not doc.learned or doc.status != "ingesting":
                    continue
                doc.learned = False
                self._register(doc)
            counted()
            logger.warning(
                "document %s: its ingestion's server stopped renewing its lease; ingested here",
                doc_id,
            )

    async def _refresh_shared(self, keys: list[tuple[str, str]]) -> None:
        """Take the store's rows of known documents ``keys`` (one round trip a tenant)
        where they are newer than the ones held: what a PATCH changes (metadata, expiry)
        is served from then on, and kept in this server's own registry; a learned
        document takes its status too (its ingestion is another server's)."""
        assert self.shared is not None
        by_namespace: dict[str, list[str]] = {}
        for namespace, doc_id in keys:
            by_namespace.setdefault(namespace, []).append(doc_id)
        for namespace, doc_ids in by_namespace.items():
            rows = await self._from_shared(namespace, doc_ids)
            for doc_id, (entry, version) in sorted(rows.items()):
                async with self.locks.hold(namespace, doc_id):
                    # NOTE: under the lock, against what is held now: a PATCH here may
                    # have written a newer row since the store was read.
                    doc = self._docs.get((namespace, doc_id))
                    if doc is None or version <= doc.version:
                        continue
                    if self.store is not None and self.store.is_open:
                        await self._store_call("saved", self._copy_row, entry)
                    doc.metadata, doc.expire_time, doc.version = (
                        entry.metadata, entry.expire_time, version
                    )  # fmt: skip
                    if doc.learned:
                        doc.status, doc.error = entry.status, entry.error
                self.shared.refreshed()
                logger.info("document %s: newer row taken from the shared registry", doc_id)

    async def _remove(
        self, doc: RegisteredDocument, rows: Literal["all", "expired", "none"] = "all"
    ) -> RegisteredDocument:
        raise NotImplementedError

    async def _shared_call(self, call: Callable[..., _T], *args: Any) -> _T | None:
        """Run a store call on the registry thread (after the row writes asked for
        earlier); None when the store cannot be reached (it is logged by its breaker)."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._store_thread, call, *args)
        except (StoreUnavailable, redis.RedisError) as exc:
            logger.debug("shared document registry: %s", exc)
            return None

    async def _store_call(self, what: str, call: Callable[..., _T], *args: Any) -> _T | None:
        """Run a registry write on the registry thread; its result, or None when there is
        no registry or the write failed (errors are logged, never raised).

        NOTE: an upload, PATCH or delete whose row could not be written still succeeds in
        memory; its row is written later (see ``_write_pending_rows``)."""
        if not self._has_registry:
            return None
        try:
            return await asyncio.get_running_loop().run_in_executor(self._store_thread, call, *args)
        except (OSError, sqlite3.Error) as exc:
            where = self.store.path if self.store is not None else "(store)"
            logger.warning("document registry %s: document not %s: %s", where, what, exc)
            return None
