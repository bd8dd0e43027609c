"""Shared vocabulary of the KV tiers below the device: block identity, metrics, interface.

A tier stores whole KV blocks, each of shape ``block_shape`` =
``[num_layers, 2, block_size, num_kv_heads, head_dim]`` and one dtype, named by the block's
chained content hash. Every tier answers the same small interface (contains / load_into /
put / flush / close, with batched loads). A load is trusted only after the stored salt and
token ids equal the expected ones, so a hash collision can never hand out another prompt's
(or tenant's) KV. ``TierStack`` orders tiers fastest first and applies the one policy.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Protocol, TypeVar

import torch
import xxhash

HASH_BYTES = 16
TierT = TypeVar("TierT", bound="KVTier")


class BlockRecordKey(NamedTuple):
    """Index key of a stored block: the salt's fingerprint plus the block hash.

    The fingerprint (not the salt itself) is what a restarted disk tier can recover from
    file names alone; the full salt is verified on every read. A named tuple, not a
    dataclass: a document's restore builds one per block (8,192 for 128k tokens), and
    tuples are built, hashed and compared in C.
    """

    fingerprint: str
    block_hash: bytes


@functools.lru_cache(maxsize=1024)
def salt_fingerprint(salt: bytes) -> str:
    """Short, file-name-safe digest of a salt (model fingerprint + tenant namespace)."""
    return xxhash.xxh3_64_hexdigest(salt)


class BlockLike(Protocol):
    """Anything naming a full block: ``BlockMeta`` or the block pool's identity records."""

    @property
    def block_hash(self) -> bytes: ...
    @property
    def parent_hash(self) -> bytes | None: ...
    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def salt(self) -> bytes: ...


def record_key(meta: BlockLike) -> BlockRecordKey:
    return BlockRecordKey(salt_fingerprint(meta.salt), meta.block_hash)


def same_block(first: BlockLike, second: BlockLike) -> bool:
    """Equal identity: hash, parent, salt and token ids (the full hash preimage)."""
    return (
        first.block_hash == second.block_hash
        and first.parent_hash == second.parent_hash
        and first.salt == second.salt
        and tuple(first.token_ids) == tuple(second.token_ids)
    )


@dataclass(frozen=True)
class BlockMeta:
    """What the engine knows about one full block, and what a tier verifies on load.

    ``block_hash`` is ``xxh3_128(salt, parent_hash, token_ids)``; ``parent_hash`` is None for
    the first block of a sequence. ``salt`` binds model, block size, KV dtype and tenant.
    """

    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    salt: bytes

    def __post_init__(self) -> None:
        if len(self.block_hash) != HASH_BYTES:
            raise ValueError(f"block_hash must be {HASH_BYTES} bytes, got {len(self.block_hash)}")
        if self.parent_hash is not None and len(self.parent_hash) != HASH_BYTES:
            raise ValueError(
                f"parent_hash must be {HASH_BYTES} bytes or None, got {len(self.parent_hash)}"
            )
        if not isinstance(self.token_ids, tuple):
            # NOTE: a list would make the frozen meta unhashable and mutable behind our back.
            object.__setattr__(self, "token_ids", tuple(self.token_ids))


@dataclass
class TierMetrics:
    """Counters of one tier. ``metrics()`` returns a copy (a snapshot), never the live object.

    corrupt_records: damaged bytes (magic, truncation, checksums, lengths, undecodable header).
    foreign_records: a valid record that is not ours (other format version or salt).
    mismatched_records: ours, but another block (hash, token ids, dtype or shape differ).
    errors: failed calls to a remote store (time-outs, refused connections, its errors);
    breaker_openings: outages that opened its circuit breaker; breaker_open: one is on now.
    """

    capacity_bytes: int = 0
    used_bytes: int = 0
    num_blocks: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    load_seconds_total: float = 0.0
    load_count: int = 0
    load_copies: int = 0  # copies issued by loads: a run of adjacent blocks is one
    store_seconds_total: float = 0.0
    store_count: int = 0
    evictions: int = 0
    dropped_demotions: int = 0
    corrupt_records: int = 0
    foreign_records: int = 0
    mismatched_records: int = 0
    write_errors: int = 0
    disk_full_events: int = 0
    disk_full: bool = False
    disabled: bool = False
    errors: int = 0
    breaker_openings: int = 0
    breaker_open: bool = False

    def count_rejected(self, kind: str) -> None:
        """One record that failed verification, by its ``RecordError.kind``."""
        if kind == "corrupt":
            self.corrupt_records += 1
        elif kind == "foreign":
            self.foreign_records += 1
        else:
            self.mismatched_records += 1


EvictCallback = Callable[[BlockLike, torch.Tensor], None]


def block_nbytes(block_shape: Sequence[int], dtype: torch.dtype) -> int:
    numel = 1
    for dim in block_shape:
        numel *= int(dim)
    return numel * dtype.itemsize


def check_block_shape(block_shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(int(dim) for dim in block_shape)
    if not shape or any(dim < 1 for dim in shape):
        raise ValueError(f"block_shape must be non-empty with positive dims, got {shape}")
    return shape


class KVTier(abc.ABC):
    """A store of KV blocks below the device.

    Contract: ``load_into`` writes a block into ``dest`` and returns True only after the
    record is verified against ``meta``; on False the contents of ``dest`` are unspecified
    and must not be used. ``put`` never raises for capacity reasons: a tier that cannot
    take a block drops it (and counts it).

    Roles in a stack: ``name`` labels the tier's metrics and traffic; a ``persistent`` tier
    keeps its blocks across restarts (persisted documents are written through to the first
    one). A tier whose eviction can hand the evicted block on calls ``on_evict(meta, block)``
    before the block's room is reused; the callee copies what it needs before returning.
    Tiers that delete evicted blocks (a file, a remote key) never call it.

    A ``shared`` tier (a store other engines use too) is not in the eviction chain: it
    takes a copy of each block the device demotes and of each persisted block, and is read
    after the chained tiers (see ``TierStack``).
    """

    name: ClassVar[str]
    persistent: ClassVar[bool] = False
    shared: ClassVar[bool] = False
    block_shape: tuple[int, ...]
    dtype: torch.dtype
    capacity_bytes: int
    on_evict: EvictCallback | None = None

    @property
    def location(self) -> str | None:
        """Where the blocks live outside this process (a directory, a URL); None in memory."""
        return None

    @abc.abstractmethod
    def contains(self, meta: BlockLike) -> bool:
        """Cheap index check (no payload read); a later load may still miss."""

    def contains_many(self, metas: Sequence[BlockLike]) -> list[bool]:
        """``contains`` of each block; a remote tier answers a run in one round trip."""
        return [self.contains(meta) for meta in metas]

    def keep_for_load(self, metas: Sequence[BlockLike]) -> None:  # noqa: B027 (a hint)
        """Make the blocks about to be loaded the last this tier evicts: the device's room
        for them is made by evictions that demote blocks into this tier."""

    @abc.abstractmethod
    def load_into(self, meta: BlockLike, dest: torch.Tensor) -> bool:
        """Copy the verified block named by ``meta`` into ``dest`` (shape ``block_shape``)."""

    @abc.abstractmethod
    def put(self, meta: BlockLike, block: torch.Tensor, *, blocking: bool = False) -> bool:
        """Store a copy of ``block``; True if stored or queued, False if dropped.

        An asynchronous tier with a full queue drops the block unless ``blocking``, which
        waits for room instead (a block's last chance before its source is overwritten).
        """

    @abc.abstractmethod
    def discard(self, meta: BlockLike) -> bool:
        """Forget the block; True if it was present."""

    @abc.abstractmethod
    def metrics(self) -> TierMetrics:
        """A snapshot of this tier's counters."""

    def has_room(self) -> bool:
        """True if a ``put`` now would be stored or queued rather than dropped."""
        return True

    def block_links(self, fingerprint: str) -> list[tuple[bytes, bytes | None]]:
        """(block hash, parent hash) of every block stored under salt ``fingerprint``."""
        raise NotImplementedError(f"the {self.name} tier cannot list its blocks")

    def purge(self, fingerprint: str, hashes: Collection[bytes]) -> int:
        """Remove the blocks ``hashes`` under ``fingerprint`` for good, writes still queued
        for them included; returns how many were stored. After it returns, no storage of
        this tier holds their bytes (a file is unlinked, a host slot is zeroed)."""
        raise NotImplementedError(f"the {self.name} tier cannot purge blocks")

    def flush(self) -> None:  # noqa: B027 (synchronous tiers have nothing to flush)
        """Wait until every accepted ``put`` is durable in this tier."""

    def flush_queued(self, timeout: float | None = None) -> bool:
        """Wait until the ``put``s accepted before this call are durable, not the ones
        accepted since; False if ``timeout`` seconds passed first."""
        self.flush()
        return True

    def close(self) -> None:  # noqa: B027
        """Flush and release resources; later calls behave as misses/drops."""

    def get(self, meta: BlockLike) -> torch.Tensor | None:
        """The verified block in a new CPU tensor, or None on a miss."""
        dest = torch.empty(self.block_shape, dtype=self.dtype)
        return dest if self.load_into(meta, dest) else None

    def load_many_into(
        self, metas: Sequence[BlockLike], dests: torch.Tensor | Sequence[torch.Tensor]
    ) -> list[bool]:
        """Load ``metas[i]`` into ``dests[i]`` (one batch tensor, or a list of blocks)."""
        self.check_batch(metas, dests)
        return [self.load_into(meta, dests[i]) for i, meta in enumerate(metas)]

    def load_rows_into(
        self, metas: Sequence[BlockLike], cache: torch.Tensor, rows: Sequence[int]
    ) -> list[bool]:
        """Load ``metas[i]`` into ``cache[rows[i]]`` (a block-major tensor, e.g. the device
        KV cache); a row whose block misses is left unspecified. Copies to a GPU may still
        run on return, queued on its current stream (see each tier)."""
        if len(rows) != len(metas):
            raise ValueError(f"{len(metas)} blocks to load but {len(rows)} destination rows")
        return self.load_many_into(metas, [cache[row] for row in rows])

    def check_block(self, tensor: torch.Tensor, role: str) -> None:
        if tuple(tensor.shape) != self.block_shape or tensor.dtype != self.dtype:
            raise ValueError(
                f"{role} must have shape {self.block_shape} and dtype {self.dtype}, "
                f"got {tuple(tensor.shape)} {tensor.dtype}"
            )

    def check_batch(
        self, metas: Sequence[BlockLike], dests: torch.Tensor | Sequence[torch.Tensor]
    ) -> None:
        if len(dests) != len(metas):
            raise ValueError(f"{len(metas)} blocks to load but {len(dests)} destinations")

    def __enter__(self: TierT) -> TierT:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
