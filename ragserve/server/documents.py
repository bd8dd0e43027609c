"""The document registry: upload once, prefill in the background, pin the blocks.

A document's id is a content hash of its tenant and text, so uploading the same text again
finds the existing document and computes nothing. Ingestion prefills the document's
prompt prefix (see :mod:`ragserve.server.prompts`) with a one-token greedy request, then
pins its full blocks so they are never evicted while the document exists. A question on a
document still ingesting does not wait: the engine makes it share the blocks being
computed.

With a :class:`~ragserve.server.document_store.DocumentStore` (a server with a disk KV
tier) each upload writes the document's row and each delete removes it before the response
is sent, and :meth:`DocumentService.restore` brings them back at start-up: each stored
document of a current tenant is registered again and re-ingested in the background, which
is cheap because its blocks come back from the disk tier. Rows of tenants the server no
longer has a key for stay untouched until a server with that key starts.

Several servers, of one model or of several sharing a tokenizer, may serve from one
directory: a start copies the other models' documents (see ``_adopt``), a DELETE removes
every model's row and KV, and a server forgets within seconds a document whose row
another server deleted (see :mod:`ragserve.server.document_watch`), and learns at first
use a document another server uploaded (see ``learn``: replicas of one cluster share the
registry this way). The directory keeps each ingestion's status and lease beside its row
(see :mod:`ragserve.server.registry_ingestions`): a server that learned a document shows
its status, and takes its ingestion over when the uploading server died mid-ingestion.
Servers that share no directory share the registry through the remote tier's store
instead (see :mod:`ragserve.server.store_registry`): their rows are published there,
``learn`` and the listing read them, the watch reads tombstones and statuses. An
ingestion there holds a lease that its server renews: when that server dies
mid-ingestion, a server that learned the document ingests it instead (see
:mod:`ragserve.server.ingest_leases`). Upload, PATCH and DELETE of one document take turns
(see :mod:`ragserve.server.document_locks`).

This module holds the lifecycle (upload, ingest, PATCH, DELETE, expiry, purge);
:mod:`ragserve.server.document_persistence` the registry rows and restore, and
:mod:`ragserve.server.registered_document` the document itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from ragserve.document_ids import document_id
from ragserve.engine.async_engine import AsyncEngine, EngineDeadError
from ragserve.engine.engine_info import KVModel
from ragserve.sampling_params import SamplingParams
from ragserve.server.admission import WorkAdmission
from ragserve.server.admission_checks import check_work
from ragserve.server.config import ServerConfig
from ragserve.server.document_expiry import ExpirySweeper
from ragserve.server.document_lifecycle import DocumentPatch, expire_time_from
from ragserve.server.document_locks import DocumentLocks
from ragserve.server.document_orders import DocumentOrders
from ragserve.server.document_persistence import DocumentPersistence, RowGone
from ragserve.server.document_readers import DocumentReaders
from ragserve.server.document_store import DocumentStore
from ragserve.server.document_watch import RegistryWatch
from ragserve.server.errors import APIError, bad_request
from ragserve.server.prompts import PromptBuilder
from ragserve.server.purge_plan import purge_plan
from ragserve.server.registered_document import RegisteredDocument, check_document_id
from ragserve.server.store_registry import StoreRegistry
from ragserve.server.tenant_limits import DocumentLimits, check_documents, check_metadata

logger = logging.getLogger(__name__)

# NOTE: the longest a shared document waits for its blocks to reach the shared store.
PUBLISH_WAIT_S = 10.0


class DocumentService(DocumentPersistence):
    """Owns every tenant's documents and their ingestion tasks. Event-loop only.

    ``admission``: ingestion counts as work there, and an upload that would wait too long
    gets a 503. ``store``: where the registry persists (None: in memory only). ``limits``:
    what one tenant's documents may take (default: ``ServerConfig``'s); an upload past
    them gets a 429, and pins past the tenant's share leave the document unpinned.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        prompts: PromptBuilder,
        admission: WorkAdmission | None = None,
        store: DocumentStore | None = None,
        default_ttl: float | None = None,
        limits: DocumentLimits | None = None,
        shared: StoreRegistry | None = None,
    ) -> None:
        self.engine = engine
        self.prompts = prompts
        self.admission = admission
        self.store = store
        self.shared = shared
        self.limits = limits or DocumentLimits.from_config(ServerConfig())
        self.block_size = engine.info.block_size
        self.default_ttl = default_ttl
        self.expiry = ExpirySweeper(self._expiring, self._expire)
        self.watch = RegistryWatch(self.sync)
        self.readers = DocumentReaders()
        self.orders = DocumentOrders()
        self.locks = DocumentLocks()
        self._docs: dict[tuple[str, str], RegisteredDocument] = {}
        self._ids = itertools.count()
        self._unsaved: set[tuple[str, str]] = set()
        self._undeleted: set[tuple[str, str]] = set()
        # NOTE: one thread, so registry writes happen in the order they were asked for
        # (an upload's row is written before a later delete removes it).
        self._store_thread = ThreadPoolExecutor(1, thread_name_prefix="registry")

    def get(self, namespace: str, doc_id: str, param: str = "id") -> RegisteredDocument:
        doc = self._docs.get((namespace, check_document_id(doc_id, param)))
        if doc is None or doc.expired(time.time()):  # NOTE: expired is gone, swept or not
            raise _not_found(doc_id, param)
        return doc

    async def learn(self, namespace: str, doc_ids: Sequence[str]) -> int:
        """Register the documents of ``doc_ids`` that this server does not know but whose
        row another server on the registry (its directory, else the store) wrote; returns
        how many. Ids that are malformed or absent stay unknown (``get`` answers them). A
        row read from the store is copied into this server's own registry.

        NOTE: a learned document is not ingested here: its KV is found at first use in a
        shared tier (the remote store) or computed by that first question, so a cluster
        computes each document once, on the replica the router sent it to. Its status is
        that replica's ingestion's, as the store's row says (``ingesting`` until that
        replica settles it, see :mod:`ragserve.server.store_values`; a row the store lacks
        reads as ``ready``), or without a store, as the directory says (see
        :mod:`ragserve.server.registry_ingestions`). When that replica dies before it
        settles, one of the servers that learned the document takes the ingestion over
        (see ``_take_over``)."""
        local = self.store is not None and self.store.is_open
        if not local and self.shared is None:
            return 0
        # NOTE: a document deleted here whose rows could not be deleted yet is not learned
        # back from them (see ``_undeleted``).
        unknown = [
            doc_id
            for doc_id in doc_ids
            if isinstance(doc_id, str)
            and (namespace, doc_id) not in self._docs
            and (namespace, doc_id) not in self._undeleted
        ]
        # NOTE: one round trip for all of them, whether or not this server's own registry
        # has them (most often it has none: the document was uploaded elsewhere).
        shared = await self._from_shared(namespace, unknown)
        learned = 0
        for doc_id in unknown:
            if (namespace, doc_id) in self._docs:
                continue
            # NOTE: under the lock a DELETE holds until its row is gone (or noted in
            # ``_undeleted``): a document being deleted here is never learned back from it.
            async with self.locks.hold(namespace, doc_id):
                if (namespace, doc_id) in self._docs or (namespace, doc_id) in self._undeleted:
                    continue
                entry = None
                if local:
                    assert self.store is not None
                    entry = await self._store_call("read", self.store.find, namespace, doc_id)
                adopted = entry is None and doc_id in shared
                version = 0  # NOTE: its own registry's row: the watch takes a newer one
                if adopted:
                    entry, version = shared[doc_id]
                doc = await self._from_row(entry) if entry is not None else None
                if doc is None or (namespace, doc_id) in self._docs:
                    continue
                doc.version = version
                saved = True
                if adopted:
                    assert self.shared is not None and entry is not None
                    if local:  # NOTE: this server's durable copy (restored after a restart)
                        saved = bool(await self._store_call("saved", self._copy_row, entry))
                    self.shared.adopted()
                doc.status, doc.saved, doc.learned = "ready", saved, True
                if doc_id in shared:  # NOTE: with a store, its rows' statuses alone count
                    doc.status, doc.error = shared[doc_id][0].status, shared[doc_id][0].error
                elif self.shared is None and entry is not None:  # the directory's
                    doc.status, doc.error = entry.status, entry.error
                self._docs[(namespace, doc_id)] = doc
            logger.info("document %s: learned from the shared registry", doc_id)
            learned += 1
        return learned

    def known(self, namespace: str, doc_id: str) -> RegisteredDocument | None:
        """The registered document, expired or not; None when unknown (never raises)."""
        return self._docs.get((namespace, doc_id))

    def list_for(self, namespace: str) -> list[RegisteredDocument]:
        """The tenant's documents, oldest first; expired ones are gone, swept or not (as
        for ``get``)."""
        now = time.time()
        docs = [
            doc for (ns, _), doc in self._docs.items() if ns == namespace and not doc.expired(now)
        ]
        return sorted(docs, key=lambda doc: (doc.created, doc.id))

    def count_by_status(self) -> dict[str, int]:
        counts = {"ingesting": 0, "ready": 0, "failed": 0}
        for doc in self._docs.values():
            counts[doc.status] += 1
        return counts

    def token_lists(self, namespace: str, doc_ids: list[str]) -> list[list[int]]:
        """The documents' tokens, in order, for a prompt; 404 for any id the tenant lacks.
        The calling task holds a reading of them until its engine requests are queued."""
        docs = [self.get(namespace, doc_id, "documents") for doc_id in doc_ids]
        self.readers.open(namespace, doc_ids)
        self.orders.note(namespace, doc_ids)
        reading = self.readers.current()
        for doc in docs:
            # NOTE: a computation that failed is tried again, or the document would stay
            # uncached (and reported different_model) for good.
            if doc.previous_model is not None and (doc.task is None or doc.task.done()):
                self._recompute(doc, reading.queued if reading is not None else None)
        return [doc.token_ids for doc in docs]

    def cached_prefix_tokens(self, namespace: str, doc_ids: list[str]) -> int:
        """Leading prompt tokens a request on ``doc_ids`` can count on finding cached: its
        first document's pinned tokens, or its full blocks while its ingestion here (whose
        own work is counted) computes them; 0 otherwise.

        NOTE: a ready document that could not be pinned (pins are capped) may have been
        evicted, so it counts as computed again: better to overestimate the work."""
        if not doc_ids:
            return 0
        doc = self._docs.get((namespace, doc_ids[0]))
        if doc is None or doc.status == "failed":
            return 0
        if doc.status == "ready" or doc.learned:  # NOTE: a learned one is ingested elsewhere
            return doc.pinned_tokens
        return len(doc.prefix_ids) // self.block_size * self.block_size

    def existing(self, namespace: str, text: str) -> RegisteredDocument | None:
        """The live document holding exactly this text, if any. A failed one does not count,
        unless it was taken over from another model: its computation is tried again at
        the next question, and replacing it would delete the other model's row too."""
        doc = self._docs.get((namespace, document_id(namespace, text)))
        if doc is None or doc.expired(time.time()):
            return None
        if doc.status == "failed" and doc.previous_model is None:
            return None
        return doc

    async def add(
        self,
        namespace: str,
        text: str,
        metadata: dict[str, Any],
        ttl: float | None = None,
        expire_time: float | str | None = None,
    ) -> tuple[RegisteredDocument, bool]:
        """Register and start ingesting; returns (document, whether it is new).

        ``ttl`` / ``expire_time``: see :mod:`ragserve.server.document_lifecycle`; an
        upload of a known text keeps the known document as it is, unless another server
        deleted it meanwhile. 400 for metadata over
        its size limit; 429 when the tenant's documents are at their count or token limit
        (checked again after tokenizing, since uploads run at once)."""
        expires = expire_time_from(ttl, expire_time, time.time(), self.default_ttl)
        existing = self.existing(namespace, text)
        deleted = (
            existing if existing is not None and await self._deleted_elsewhere(existing) else None
        )
        if existing is not None and deleted is None:
            return existing, False
        doc_id = document_id(namespace, text)
        check_metadata(self.limits, metadata)
        check_documents(self.limits, *self._holding(namespace, doc_id))
        token_ids = await self.prompts.run(self.prompts.document_ids, text)
        prefix_ids = self.prompts.document_prefix(token_ids)
        self._check_fits(len(token_ids), len(prefix_ids))

        async def register() -> tuple[RegisteredDocument, bool]:
            existing = self.existing(namespace, text)  # another upload may have won the race
            if existing is not None and existing is not deleted:
                return existing, False
            check_documents(self.limits, *self._holding(namespace, doc_id), len(token_ids))
            if self.admission is not None:
                check_work(self.admission, len(prefix_ids), 1, tenant=namespace)
            stale = self._docs.get((namespace, doc_id))
            if stale is not None:  # expired (not swept yet), failed or deleted: it goes first
                # NOTE: its row is replaced below; other models' rows of this text stay
                # unless their own expiry passed (their servers may be serving them).
                expired = stale.expired(time.time())
                await self._remove(stale, rows="expired" if expired else "none")
            doc = RegisteredDocument(
                doc_id, namespace, token_ids, prefix_ids, metadata, int(time.time())
            )
            doc.expire_time = expires
            self._register(doc)
            logger.info("document %s: %d tokens, ingesting", doc_id, len(token_ids))
            version = await self._store_call("saved", self._put_row, doc.stored())
            doc.saved, doc.version = version is not None, version or 0
            self._pending_write(doc, written=version is not None)
            return doc, True

        # NOTE: a DELETE of this text still running finishes first (its row delete and
        # purge must not reach the document registered here).
        return await self.locks.run(namespace, doc_id, register)

    async def _deleted_elsewhere(self, doc: RegisteredDocument) -> bool:
        """Whether another server deleted ``doc``'s row since this one last looked (its
        watch would forget the document within a round): an upload of its text then
        registers it anew, where answering with the known one lost it."""
        key = (doc.namespace, doc.id)
        gone = await self._shared_call(self.shared.gone, [key]) if self.shared else None
        if gone:  # NOTE: None (unreachable) or empty: the directory may still know
            return True
        if doc.saved and self.store is not None and self.store.is_open:
            return await self._store_call("read", self.store.has, *key) is False
        return False

    def _holding(self, namespace: str, replacing: str) -> tuple[int, int]:
        """(documents, tokens) the tenant keeps, without the failed one ``replacing`` would
        replace."""
        docs = [doc for doc in self.list_for(namespace) if doc.id != replacing]
        return len(docs), sum(len(doc.token_ids) for doc in docs)

    def _register(self, doc: RegisteredDocument) -> None:
        self._docs[(doc.namespace, doc.id)] = doc
        doc.task = asyncio.create_task(self._ingest(doc), name=f"ingest-{doc.id}")

    def _recompute(self, doc: RegisteredDocument, after: asyncio.Event | None) -> None:
        """Ingest a document taken over from another model, once ``after`` is set.

        NOTE: ``after`` is its first question's reading: that question reaches the engine
        first and computes the blocks; ingestion then finds them and pins them."""

        async def ingest() -> None:
            if after is not None:
                await after.wait()
            doc.status = "ingesting"
            await self._ingest(doc)

        doc.task = asyncio.create_task(ingest(), name=f"recompute-{doc.id}")

    def _check_fits(self, num_tokens: int, num_prefix_tokens: int) -> None:
        max_len = self.engine.max_model_len
        if num_prefix_tokens >= max_len:
            raise bad_request(
                f"the document has {num_tokens} tokens ({num_prefix_tokens} with the document "
                f"template) but the model's context is {max_len} tokens, and questions need room",
                "text",
                "context_length_exceeded",
            )
        num_blocks = self.engine.info.num_kv_blocks
        needed = -(-(num_prefix_tokens + 1) // self.block_size)
        if needed > num_blocks:
            raise bad_request(
                f"the document needs {needed} KV blocks but the cache holds {num_blocks}",
                "text",
                "context_length_exceeded",
            )

    async def _ingest(self, doc: RegisteredDocument) -> None:
        params = SamplingParams(max_tokens=1, temperature=0.0)
        request_id = f"ingest-{doc.id[:16]}-{next(self._ids)}"
        started = time.perf_counter()
        admission = self.admission
        ticket = (
            admission.admit(len(doc.prefix_ids), 1, tenant=doc.namespace)
            if admission is not None
            else None
        )
        try:
            stream = self.engine.generate(doc.prefix_ids, params, request_id, doc.namespace)
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for output in stream:
                    if admission is not None and ticket is not None and output.finished:
                        computed = len(output.prompt_token_ids) - output.num_cached_tokens
                        generated = len(output.outputs[0].token_ids) if output.outputs else 0
                        admission.progress(
                            ticket,
                            prompt=len(doc.prefix_ids),
                            computed=computed,
                            generated=generated,
                        )
            pinned = await self.engine.pin_prefix(
                doc.pin_id, doc.prefix_ids, doc.namespace, self.limits.tenant_pin_share
            )
            await self._publish_blocks(doc.id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the document records why; the server goes on
            doc.status, doc.error = "failed", str(exc)
            logger.warning("document %s: ingestion failed: %s", doc.id, exc)
        else:
            doc.status, doc.pinned_tokens, doc.previous_model = "ready", pinned, None
            logger.info(
                "document %s: ready in %.2fs, %d tokens pinned",
                doc.id,
                time.perf_counter() - started,
                pinned,
            )
        finally:
            if admission is not None and ticket is not None:
                admission.release(ticket)
        if self.shared is None and self.store is None:  # NOTE: no row to settle: no lock
            return
        if self._docs.get((doc.namespace, doc.id)) is not doc:
            # NOTE: removed: the remover holds the lock and waits for this task to end, so
            # waiting for the lock here (had its cancellation been lost) would wait forever.
            return
        # NOTE: under the lock, so after the upload's own write of the row (whose version
        # the settle names) and in turn with a PATCH's. A row this server has neither
        # written nor read yet (a restored document's, version 0) is settled by the watch
        # where the store's says less: a start sends no row for it.
        async with self.locks.hold(doc.namespace, doc.id):
            await self._settle_directory(doc)
            if doc.version:
                await self._settle(doc)

    async def _publish_blocks(self, doc_id: str) -> None:
        """Hold a document back from ``ready`` until its blocks have reached the shared KV
        store, if there is one, so that another replica answers it from the store at once
        (the writes are queued as the blocks are computed; under load they can land seconds
        later)."""
        if not await self.engine.flush_shared_tiers(PUBLISH_WAIT_S):
            logger.warning(
                "document %s: its blocks were still being written to the shared KV store "
                "after %.0f s; marked ready anyway", doc_id, PUBLISH_WAIT_S,
            )  # fmt: skip

    async def update(self, namespace: str, doc_id: str, patch: DocumentPatch) -> RegisteredDocument:
        """PATCH: change the expiry and/or the metadata; the row is rewritten before return."""
        self.get(namespace, doc_id)  # NOTE: 400 / 404 before waiting for the lock
        if patch.metadata is not None:
            check_metadata(self.limits, patch.metadata)
        return await self.locks.run(
            namespace, doc_id, lambda: self._update(self.get(namespace, doc_id), patch)
        )

    async def _update(self, doc: RegisteredDocument, patch: DocumentPatch) -> RegisteredDocument:
        fields = patch.model_fields_set
        if "ttl" in fields or "expire_time" in fields:
            if patch.ttl is None and patch.expire_time is None:
                doc.expire_time = None  # null: never expires
            else:
                doc.expire_time = expire_time_from(patch.ttl, patch.expire_time, time.time())
        if patch.metadata is not None:
            doc.metadata = patch.metadata
        # NOTE: its rows never replace a tombstone or bring back a deleted row: deleted on
        # another server meanwhile, the document is forgotten (here at once where the
        # directory tells, else at the next watch round).
        try:
            version = await self._store_call("saved", self._put_row, doc.stored(), True, doc.saved)
        except RowGone:
            await self._remove(doc, rows="none")
            logger.info("document %s was deleted by another server; forgotten", doc.id)
            raise _not_found(doc.id) from None
        if version is not None:
            doc.saved = True
        if version:
            doc.version = version
        self._pending_write(doc, written=version is not None)
        return doc

    def _expiring(self) -> list[tuple[str, str, float]]:
        return [
            (doc.namespace, doc.id, doc.expire_time)
            for doc in self._docs.values()
            if doc.expire_time is not None
        ]

    async def remove(self, namespace: str, doc_id: str) -> RegisteredDocument:
        """DELETE: unpin, purge the KV every model with this tokenizer wrote (see
        ``_purge``), then delete the rows of every model; 404 for an unknown or expired
        document."""
        self.get(namespace, doc_id)  # NOTE: 400 / 404 before waiting for the lock
        return await self.locks.run(
            namespace, doc_id, lambda: self._remove(self.get(namespace, doc_id))
        )

    async def _expire(self, namespace: str, doc_id: str) -> None:
        """The expiry sweep's removal: like a DELETE, but only the rows whose own
        expire_time passed go, and only those models' KV with this one's."""

        async def expire() -> None:
            doc = self._docs.get((namespace, doc_id))
            if doc is not None and doc.expired(time.time()):  # NOTE: a PATCH may have won
                await self._remove(doc, rows="expired")

        await self.locks.run(namespace, doc_id, expire)

    async def sync(self) -> int:
        """Learn the documents another server on the directory uploaded (see ``learn``)
        and forget those whose row another server deleted (see
        :mod:`ragserve.server.document_watch`): unpinned, this model's KV purged here;
        then follow the ingestions (see ``_sync_ingestions``). Returns how many were
        forgotten."""
        await self._write_pending_rows()
        forgotten = await self._sync_shared() if self.shared is not None else 0
        if self.store is None or not self.store.is_open:
            return forgotten
        keys = await self._store_call("read", self.store.keys)
        if keys is None:
            return forgotten
        fresh: dict[str, list[str]] = {}
        for namespace, doc_id in keys - self._docs.keys() - self._undeleted:
            fresh.setdefault(namespace, []).append(doc_id)
        for namespace, ids in fresh.items():  # uploaded through another server
            await self.learn(namespace, ids)
        missing = [doc for key, doc in self._docs.items() if doc.saved and key not in keys]
        for doc in missing:
            async with self.locks.hold(doc.namespace, doc.id):
                # NOTE: checked again under the lock: an upload of this text may have
                # replaced it, or written its row, since the keys were read.
                if self._docs.get((doc.namespace, doc.id)) is not doc:
                    continue
                if (
                    await self._store_call("read", self.store.has, doc.namespace, doc.id)
                    is not False
                ):
                    continue
                await self._remove(doc, rows="none")
                logger.info("document %s was deleted by another server; forgotten", doc.id)
                forgotten += 1
        await self._sync_ingestions()
        return forgotten

    async def _remove(
        self, doc: RegisteredDocument, rows: Literal["all", "expired", "none"] = "all"
    ) -> RegisteredDocument:
        """Unregister ``doc``, its ``rows`` and its KV (``none``: no row goes: another
        server deleted them, or an upload replaces this model's). The document's lock is
        held."""
        del self._docs[(doc.namespace, doc.id)]
        if doc.task is not None and not doc.task.done():
            doc.task.cancel()
            await asyncio.gather(doc.task, return_exceptions=True)
        if self.engine.is_alive:
            # NOTE: calls run in order on the engine thread, so this unpin also undoes a
            # pin that a just-cancelled ingestion had already queued. One that times out
            # still runs when the engine gets to it: the removal goes on.
            try:
                await self.engine.unpin_prefix(doc.pin_id)
            except EngineDeadError as exc:
                logger.warning("document %s: unpin not confirmed: %s", doc.id, exc)
        now = time.time()
        others: list[KVModel] | None = None
        if rows != "none":
            others = await self._store_call(
                "read", self._models_of_rows, doc.namespace, doc.id, rows, now
            )
        # NOTE: requests that read the document before it was removed above reach the
        # engine before the purge, which then keeps them from caching it again.
        await self.readers.settled(doc.namespace, doc.id)
        await self._purge(doc, [None, *(others or [])])
        # NOTE: the rows go last: a crash before here restores the document (its DELETE
        # was never answered), where rows deleted first left a deleted document's KV on
        # disk with nothing to say it should go.
        if rows == "expired":
            await self._store_call(
                "deleted", self._delete_expired_rows, doc.namespace, doc.id, now, doc.version
            )
        elif rows == "all":
            deleted = await self._store_call("deleted", self._delete_rows, doc.namespace, doc.id)
            if deleted is None and self._has_registry:
                self._undeleted.add((doc.namespace, doc.id))
        self._unsaved.discard((doc.namespace, doc.id))
        self.orders.forget(doc.namespace, doc.id)
        return doc

    async def _purge(self, doc: RegisteredDocument, models: Sequence[KVModel | None]) -> None:
        """Remove the document's KV from every tier, in prompts that named it after other
        documents too (see :mod:`ragserve.server.purge_plan`); blocks of another live
        document of its tenant stay (a re-upload of the same text among them). ``models``:
        whose blocks go, one engine call each (None: this model's). Errors are logged: the
        document is gone either way."""
        if not self.engine.is_alive:
            return
        others = {
            other.id: other.token_ids for other in self.list_for(doc.namespace) if other is not doc
        }
        preceding = self.orders.preceding(doc.namespace, doc.id)
        plan = purge_plan(doc.token_ids, others, preceding, self.prompts.document_prefix)
        for model in models:
            try:
                removed = await self.engine.purge_prefixes(
                    plan.purge, doc.namespace, plan.keep, model=model
                )
            except Exception as exc:  # NOTE: a failed purge must not fail the DELETE
                logger.warning("document %s: KV purge failed: %s", doc.id, exc)
                continue
            whose = "" if model is None else f" of model {model.fingerprint[:12]}"
            logger.info("document %s: KV%s purged (%s blocks)", doc.id, whose, removed)

    async def close(self) -> None:
        await self.expiry.stop()
        await self.watch.stop()
        tasks = [doc.task for doc in self._docs.values() if doc.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.locks.drain()  # NOTE: uploads, PATCHes and DELETEs whose clients left
        await self._write_pending_rows()  # NOTE: a last try, so a restart loses none
        if self.store is not None:
            await asyncio.get_running_loop().run_in_executor(self._store_thread, self.store.close)
        if self.shared is not None:
            await asyncio.get_running_loop().run_in_executor(self._store_thread, self.shared.close)
        self._store_thread.shutdown(wait=False)


def _not_found(doc_id: str, param: str = "id") -> APIError:
    return APIError(404, f"document {doc_id} not found", param=param, code="document_not_found")
