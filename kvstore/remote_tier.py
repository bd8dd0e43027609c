"""Remote KV tier: verified block records in a Redis-protocol store shared by engines.

Values are the disk tier's records (``record_format``: header checksum, salt, block
hash, token ids or their keyed digest, layout, payload checksum; sealed with AES-GCM when
a key is set), under keys namespaced by the salt's fingerprint (model, block size, KV
dtype, tenant) and the block hash (``remote_keys``). A value that is corrupt, foreign or
another block's is a miss, and is deleted from the store; it never reaches attention.

Where it sits. The local tiers form a chain, device -> CPU -> disk, each handing its
evictions to the next. The remote tier is *beside* that chain (``shared``), not in it:
- the store evicts by itself (``maxmemory`` with ``allkeys-lru``) and deletes what it
  evicts, so a tier below it would never receive anything, and one above it would have
  to evict into the network in the step loop;
- other engines read it: a block is worth publishing when it leaves this engine's
  device (write-back), and a document's blocks as soon as they are computed
  (write-through), not only after they trickled down the local chain;
- it is read last, after the CPU and disk tiers: those cost no network round trip and
  hold this engine's own recent blocks; the store is the last resort before computing,
  and the place where a fresh replica finds what another one computed.

Guarantees: writes are asynchronous and batched (``remote_writer``: a bounded queue, one
pipeline per batch, drops counted, never waits in the step loop); a run of blocks is
read with one MGET per ``batch_blocks`` (one round trip), and existence checks of a run
with one pipeline. The store being slow, down or restarted costs at most one time-out
per call: failures open a circuit breaker (``remote_store``), during which every lookup
misses and every write is dropped at once, and a probe after ``retry_s`` closes it again.
Capacity is the store's: ``capacity_bytes`` is its ``maxmemory`` when it says (0 when
unlimited or unknown); an evicted value is a miss.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Collection, Sequence
from typing import Any

import redis
import torch

from kvstore.record_bytes import decode_value_into
from kvstore.record_cipher import RecordCipher
from kvstore.record_format import PREFIX, RecordError, decode_head
from kvstore.remote_keys import (
    DEFAULT_KEY_PREFIX,
    KnownKeys,
    block_key,
    fingerprint_pattern,
)
from kvstore.remote_store import RemoteStore, StoreUnavailable
from kvstore.remote_writer import RemoteWriter
from kvstore.tier import BlockLike, KVTier, TierMetrics, check_block_shape
from kvstore.warn_once import WarnOnce

logger = logging.getLogger(__name__)

# NOTE: a record's head is ~200 bytes for 16-token blocks; one GETRANGE of this many
# bytes fetches nearly every head whole (a longer one takes a second).
_HEAD_PROBE_BYTES = 4096


class RemoteTier(KVTier):
    """Blocks of one shape and dtype in the store at ``url`` (see the module docstring).

    ``timeout_s`` bounds every round trip; ``failure_threshold`` consecutive failures
    open the breaker for ``retry_s``. At most ``max_pending_writes`` blocks wait to be
    written. Reads and existence checks go out ``batch_blocks`` at a time. A key written
    or read is taken as present for ``known_for_s`` (the store may evict it or restart
    empty meanwhile); then the store is asked again.
    """

    name = "remote"
    persistent = True
    shared = True

    def __init__(
        self,
        block_shape: Sequence[int],
        dtype: torch.dtype,
        url: str,
        *,
        timeout_s: float = 0.5,
        retry_s: float = 5.0,
        failure_threshold: int = 3,
        max_pending_writes: int = 256,
        batch_blocks: int = 64,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        cipher: RecordCipher | None = None,
        known_for_s: float = 30.0,
    ) -> None:
        self.block_shape = check_block_shape(block_shape)
        self.dtype = dtype
        if max_pending_writes < 1 or batch_blocks < 1:
            raise ValueError(
                "max_pending_writes and batch_blocks must be >= 1, got "
                f"{max_pending_writes}, {batch_blocks}"
            )
        # NOTE: sealed records live apart, by key: engines of another key (or none) that
        # share the store would otherwise take each other's records for damaged ones.
        self.key_prefix = key_prefix if cipher is None else f"{key_prefix}:sealed-{cipher.key_id}"
        self.batch_blocks = batch_blocks
        self.cipher = cipher
        self._known = KnownKeys(present_memory_s=known_for_s)
        self.store = RemoteStore(
            url,
            timeout_s=timeout_s,
            retry_s=retry_s,
            failure_threshold=failure_threshold,
            on_down=self._known.clear,
        )
        self._writer = RemoteWriter(
            self.store,
            self._known,
            self.block_shape,
            dtype,
            max_pending_writes=max_pending_writes,
            batch_blocks=batch_blocks,
            cipher=cipher,
        )
        self._lock = threading.Lock()
        self._counts = TierMetrics()
        self._warn = WarnOnce(logger)
        self._closed = False
        self.capacity_bytes = self._probe()
        self._writer.start()

    @property
    def location(self) -> str:
        """The store's URL, password redacted."""
        return self.store.url

    def _probe(self) -> int:
        """The store's ``maxmemory`` (0: unlimited or not disclosed); a store that is down
        is logged and retried later, never an error."""
        try:
            info = self.store.call(lambda client: client.info("memory"))
        except StoreUnavailable as exc:
            logger.warning("remote KV store: %s; lookups miss until it answers", exc)
            return 0
        except redis.RedisError:
            return 0
        maxmemory = int(info.get("maxmemory", 0) or 0)
        policy = str(info.get("maxmemory_policy", ""))
        if maxmemory == 0 or not policy.startswith("allkeys"):
            logger.warning(
                "remote KV store %s has maxmemory=%d and policy %r: set maxmemory and "
                "maxmemory-policy allkeys-lru, or it fills up and refuses writes",
                self.store.url, maxmemory, policy,
            )  # fmt: skip
        return maxmemory

    def _key(self, meta: BlockLike) -> bytes:
        return block_key(self.key_prefix, meta)

    # -- lookups ----------------------------------------------------------------------------
    def contains(self, meta: BlockLike) -> bool:
        return self.contains_many([meta])[0]

    def contains_many(self, metas: Sequence[BlockLike]) -> list[bool]:
        """Known keys answer locally; the rest are asked in one pipeline of EXISTS per
        ``batch_blocks``. A store that cannot be asked answers False."""
        if self._closed:
            return [False] * len(metas)
        keys = [self._key(meta) for meta in metas]
        found = [self._known.state(key) for key in keys]
        unknown = [i for i, state in enumerate(found) if state is None]
        for start in range(0, len(unknown), self.batch_blocks):
            chunk = unknown[start : start + self.batch_blocks]
            answers = self._exists([keys[i] for i in chunk])
            for i, present in zip(chunk, answers, strict=True):
                found[i] = present
                if present is None:
                    continue
                # NOTE: an absent key is remembered for a moment too: a long prompt being
                # prefilled asks about its next blocks every step.
                (self._known.present if present else self._known.missed)(keys[i])
        return [bool(state) for state in found]

    def _exists(self, keys: list[bytes]) -> list[bool | None]:
        def ask(client: redis.Redis) -> list[object]:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return list(pipe.execute())

        try:
            return [bool(answer) for answer in self.store.call(ask)]
        except (StoreUnavailable, redis.RedisError):
            return [None] * len(keys)  # unknown: absent now, asked again next time

    # -- loads ------------------------------------------------------------------------------
    def load_into(self, meta: BlockLike, dest: torch.Tensor) -> bool:
        return self.load_many_into([meta], [dest])[0]

    def load_many_into(
        self, metas: Sequence[BlockLike], dests: torch.Tensor | Sequence[torch.Tensor]
    ) -> list[bool]:
        """One MGET per ``batch_blocks`` blocks; each value is verified, then copied."""
        self.check_batch(metas, dests)
        for dest in dests:
            self.check_block(dest, "destination")
        found: list[bool] = []
        for start in range(0, len(metas), self.batch_blocks):
            stop = start + self.batch_blocks
            found += self._load_batch(
                metas[start:stop], [dests[i] for i in range(start, min(stop, len(metas)))]
            )
        return found

    def _load_batch(self, metas: Sequence[BlockLike], dests: Sequence[torch.Tensor]) -> list[bool]:
        keys = [self._key(meta) for meta in metas]
        started = time.perf_counter()
        values: list[Any] = [None] * len(keys)
        if not self._closed:
            # NOTE: a store that cannot answer leaves every value None: misses.
            with contextlib.suppress(StoreUnavailable, redis.RedisError):
                values = list(self.store.call(lambda client: client.mget(keys)))
        found = [False] * len(keys)
        rejected: list[tuple[bytes, RecordError]] = []
        read = 0
        for i, (key, value) in enumerate(zip(keys, values, strict=True)):
            if value is None:
                self._known.missed(key)
                continue
            try:
                decode_value_into(
                    value, metas[i], self.dtype, self.block_shape, dests[i], self.cipher
                )
            except RecordError as err:
                self._known.missed(key)
                rejected.append((key, err))
                continue
            self._known.present(key)
            found[i] = True
            read += len(value)
        elapsed = time.perf_counter() - started
        if rejected:
            self._delete_rejected(rejected)
        hits = sum(found)
        with self._lock:
            counts = self._counts
            counts.hits += hits
            counts.misses += len(keys) - hits
            counts.bytes_read += read
            counts.load_count += hits
            counts.load_copies += hits
            counts.load_seconds_total += elapsed
        return found

    def _delete_rejected(self, rejected: list[tuple[bytes, RecordError]]) -> None:
        """Count and delete values that failed verification.

        NOTE: another engine may have rewritten a key between our read and this delete;
        its good value is lost then, which costs a miss, never a wrong hit."""
        with self._lock:
            for _, err in rejected:
                self._counts.count_rejected(err.kind)
        for key, err in rejected:
            self._warn(f"reject-{err.kind}", "deleted remote KV value %r: %s", key, err)
        keys = [key for key, _ in rejected]
        # NOTE: if this fails, the value is verified again (and deleted) at its next read.
        with contextlib.suppress(StoreUnavailable, redis.RedisError):
            self.store.call(lambda client: client.delete(*keys))

    # -- stores -----------------------------------------------------------------------------
    def put(self, meta: BlockLike, block: torch.Tensor, *, blocking: bool = False) -> bool:
        """Queue a copy of ``block``; never waits on the store (see ``remote_writer``)."""
        self.check_block(block, "block")
        if self._closed:
            return False
        return self._writer.put(self._key(meta), meta, block, blocking)

    def has_room(self) -> bool:
        return not self._closed and self._writer.has_room()

    def discard(self, meta: BlockLike) -> bool:
        key = self._key(meta)
        self._known.forget(key)
        if self._closed:
            return False
        try:
            return bool(self.store.call(lambda client: client.delete(key)))
        except (StoreUnavailable, redis.RedisError):
            return False

    def block_links(self, fingerprint: str) -> list[tuple[bytes, bytes | None]]:
        """Scans the keys under ``fingerprint`` (other engines' too) and reads each head;
        values that cannot be read are left out, and a store that is down yields none.
        NOTE: SCAN walks the whole keyspace, so a purge takes time in proportion to the
        store's size; purges are rare (a document deleted or expired)."""
        if self._closed:
            return []
        self.flush()
        try:
            keys = self.store.call(
                lambda client: list(
                    client.scan_iter(
                        match=fingerprint_pattern(self.key_prefix, fingerprint), count=1000
                    )
                )
            )
            links = []
            for start in range(0, len(keys), self.batch_blocks):
                links += self._read_links(keys[start : start + self.batch_blocks])
            return links
        except (StoreUnavailable, redis.RedisError) as exc:
            self._warn("links", "cannot list remote KV blocks for a purge: %s", exc)
            return []

    def _read_links(self, keys: list[bytes]) -> list[tuple[bytes, bytes | None]]:
        def heads(client: redis.Redis, length: int) -> list[bytes]:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.getrange(key, 0, length - 1)
            # NOTE: a key of another type under the prefix answers an error alone.
            return list(pipe.execute(raise_on_error=False))

        links = []
        for key, head in zip(
            keys, self.store.call(lambda c: heads(c, _HEAD_PROBE_BYTES)), strict=True
        ):
            if not isinstance(head, bytes) or len(head) < PREFIX.size:
                continue
            head_len = PREFIX.size + PREFIX.unpack_from(head, 0)[1]
            if head_len > len(head):
                head = self.store.call(functools.partial(_getrange, key=key, length=head_len))
            try:
                header = decode_head(head[:head_len])
            except RecordError:
                continue
            links.append((header.block_hash, header.parent_hash))
        return links

    def purge(self, fingerprint: str, hashes: Collection[bytes]) -> int:
        """Waits for queued writes first, so none of them lands after the purge. A store
        that cannot be reached keeps the values (until it evicts them): logged."""
        if self._closed:
            return 0
        self.flush()
        keys = [f"{self.key_prefix}:{fingerprint}:{h.hex()}".encode() for h in hashes]
        removed = 0
        for key in keys:
            self._known.forget(key)
        for start in range(0, len(keys), 512):
            chunk = keys[start : start + 512]
            try:
                removed += int(self.store.call(functools.partial(_delete, keys=chunk)))
            except (StoreUnavailable, redis.RedisError) as exc:
                self._warn(
                    "purge", "cannot purge remote KV blocks (they stay until evicted): %s", exc
                )
        return removed

    # -- state ------------------------------------------------------------------------------
    def metrics(self) -> TierMetrics:
        with self._lock:
            snapshot = TierMetrics(
                capacity_bytes=self.capacity_bytes,
                hits=self._counts.hits,
                misses=self._counts.misses,
                bytes_read=self._counts.bytes_read,
                load_count=self._counts.load_count,
                load_copies=self._counts.load_copies,
                load_seconds_total=self._counts.load_seconds_total,
                corrupt_records=self._counts.corrupt_records,
                foreign_records=self._counts.foreign_records,
                mismatched_records=self._counts.mismatched_records,
            )
        self._writer.add_metrics(snapshot)
        snapshot.errors = self.store.errors
        snapshot.breaker_openings = self.store.breaker.openings
        snapshot.breaker_open = self.store.breaker.is_open
        snapshot.disabled = self._closed
        return snapshot

    def flush(self) -> None:
        if not self._closed:
            self._writer.flush()

    def flush_queued(self, timeout: float | None = None) -> bool:
        return self._closed or self._writer.flush_queued(timeout)

    def close(self) -> None:
        """Send queued writes (or drop them if the store is down), stop, disconnect."""
        if self._closed:
            return
        self._writer.close()
        self._closed = True
        self.store.close()


def _getrange(client: redis.Redis, *, key: bytes, length: int) -> Any:
    return client.getrange(key, 0, length - 1)


def _delete(client: redis.Redis, *, keys: list[bytes]) -> Any:
    return client.delete(*keys)
