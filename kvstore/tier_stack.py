"""The tiers below the device KV tensor as one stack, with the one policy that moves blocks.

The stack is an ordered list of ``KVTier``s, fastest first: a chain of local tiers (CPU,
then disk) and, beside it, a shared tier (a remote store other engines use too; see
``kvstore.remote_tier`` for why it is beside the chain and read last). Policy:
- write-back: a cached block evicted from the device is demoted into the top tier of the
  chain; each chained tier's evictions go on to the tier below it (the CPU tier's to
  disk), and the bottom tier's are deleted. Without a CPU tier, demotions go straight to
  disk. The shared tier takes a copy of every demoted block it does not hold yet;
- write-through: a block of a request marked ``persist`` (a document ingested through the
  document API, or pinned) is queued for the first persistent tier of the chain as soon
  as it is computed, so it survives a crash or restart even if it is never evicted. What
  that tier's queue cannot take yet waits in a backlog retried between steps, and gets a
  blocking last chance when its device block is evicted: a document is persisted whole.
  It is also offered to the shared tier at once (never waiting: the network is not the
  step loop's to wait on; a dropped block is offered again when it is demoted);
- loads: a prefix lookup that runs out of device hits continues in the stack; a run of
  consecutive hits is loaded into fresh device blocks as one batch, each tier serving
  what the tiers above it missed (the CPU tier as one batch of copies, the disk tier
  with parallel readers, the shared tier with one round trip per batch), and the run is
  served up to its first miss.
A block loaded from a lower tier is not promoted: it is on the device now, and its next
demotion puts it in the top tier.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.block_pool import BlockIdentity, BlockPool
from kvstore.cpu_tier import CpuTier
from kvstore.disk_tier import DiskTier
from kvstore.record_cipher import RecordCipher
from kvstore.tier import BlockLike, EvictCallback, KVTier, TierMetrics

GIB = 1 << 30


@dataclass
class TierTraffic:
    """Blocks moved between the device and the stack, per direction and tier.

    ``loaded_from_*`` count blocks served (the leading run of a batch, up to its first
    miss); ``discarded_loads`` counts blocks loaded past a miss of their batch and dropped.
    ``demoted`` counts blocks the top tier took on eviction from the device, ``persisted``
    blocks queued for write-through, ``published`` blocks the shared tier took.
    ``load_seconds`` is the host's wall time in load calls, verification included (CPU-tier
    copies may still be running when a call returns).
    """

    loaded_from_cpu: int = 0
    loaded_from_disk: int = 0
    loaded_from_remote: int = 0
    discarded_loads: int = 0
    demoted: int = 0
    persisted: int = 0
    published: int = 0  # blocks offered to the shared tier and taken (or held already)
    load_seconds: float = 0.0


@dataclass(frozen=True)
class TierInfo:
    """What a tier is: its name, byte budget, and location (a directory; None in memory)."""

    name: str
    capacity_bytes: int
    location: str | None


class TierStack:
    """The tiers below the device of one engine, fastest first, and the policy above.

    Owns the tiers: ``close`` closes them. Holds the device KV tensor (block-major) and
    the block pool only to copy blocks out on eviction and in on loads; it is called from
    the engine thread (the tiers' own workers run their I/O). ``demote`` is registered as
    the pool's eviction hook by ``KVCacheManager``.
    """

    def __init__(self, tiers: Sequence[KVTier], kv_cache: torch.Tensor, pool: BlockPool) -> None:
        if not tiers:
            raise ValueError("a tier stack needs at least one tier")
        names = [tier.name for tier in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be distinct, got {names}")
        chain = [tier for tier in tiers if not tier.shared]
        shared = [tier for tier in tiers if tier.shared]
        if list(tiers) != chain + shared:
            raise ValueError(f"shared tiers come after the chained ones, got {names}")
        for upper in chain[:-1]:
            if upper.on_evict is not None:
                raise ValueError(f"the {upper.name} tier already has an eviction callback")
        for upper, lower in itertools.pairwise(chain):
            upper.on_evict = _handing_to(lower)
        self.tiers: tuple[KVTier, ...] = tuple(tiers)
        self._chain: tuple[KVTier, ...] = tuple(chain)
        self._shared: tuple[KVTier, ...] = tuple(shared)
        self.kv_cache = kv_cache
        self.pool = pool
        self.traffic = TierTraffic()
        self._durable = next((tier for tier in chain if tier.persistent), None)
        # Write-through blocks the durable tier had no room for yet, retried every step:
        # a document is persisted whole, however bursty its ingestion.
        self._backlog: dict[bytes, tuple[int, BlockIdentity]] = {}

    @classmethod
    def from_budgets(
        cls,
        kv_cache: torch.Tensor,
        pool: BlockPool,
        *,
        cpu_gib: float,
        disk_gib: float,
        disk_dir: str | os.PathLike[str] | None = None,
        cipher: RecordCipher | None = None,
        remote_url: str | None = None,
        remote_timeout_s: float = 0.5,
        remote_retry_s: float = 5.0,
    ) -> TierStack:
        """A CPU tier over a disk tier from the engine's ``kv_cpu_gib`` / ``kv_disk_gib`` /
        ``kv_disk_dir``, and a remote tier beside them at ``remote_url``; a budget of 0
        leaves that tier out (one tier must be there).

        Raises ``TierDirectoryError`` (an ``OSError``) if the disk directory is unusable,
        ValueError if the remote URL is. A remote store that is down is no error.
        """
        block_shape, dtype = tuple(kv_cache.shape[1:]), kv_cache.dtype
        tiers: list[KVTier] = []
        if cpu_gib > 0:
            tiers.append(CpuTier(block_shape, dtype, int(cpu_gib * GIB)))
        if disk_gib > 0:
            tiers.append(DiskTier(block_shape, dtype, int(disk_gib * GIB), disk_dir, cipher=cipher))
        if remote_url:
            # NOTE: imported here: the store's client (redis-py) costs about 0.3 s of
            # start-up, paid only by engines that have a remote tier.
            from kvstore.remote_tier import RemoteTier

            remote = RemoteTier(
                block_shape,
                dtype,
                remote_url,
                timeout_s=remote_timeout_s,
                retry_s=remote_retry_s,
                cipher=cipher,
            )
            tiers.append(remote)
        return cls(tiers, kv_cache, pool)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one device block (what one load moves)."""
        return self.kv_cache[0].nbytes

    def describe(self) -> tuple[TierInfo, ...]:
        """Each tier's name, budget in bytes and resolved location, fastest first."""
        return tuple(TierInfo(tier.name, tier.capacity_bytes, tier.location) for tier in self.tiers)

    def metrics(self) -> dict[str, TierMetrics]:
        """A snapshot of each tier's counters, by tier name, fastest first."""
        return {tier.name: tier.metrics() for tier in self.tiers}

    # -- loads ------------------------------------------------------------------------------
    def contains(self, identity: BlockLike) -> bool:
        """Some tier indexes the block (no payload read; a load may still miss)."""
        return any(tier.contains(identity) for tier in self.tiers)

    def persisted(self, identity: BlockLike) -> bool:
        """The first persistent tier of the chain indexes the block (a restart finds it
        there); False without one. The CPU and shared tiers do not count: they forget."""
        return self._durable is not None and self._durable.contains(identity)

    def leading_present(self, identities: Sequence[BlockLike], window: int = 64) -> int:
        """How many leading ``identities`` some tier holds (a load may still miss).

        The chained tiers are asked block by block up to their first miss; the shared
        tiers, past that point, about at most ``window`` blocks in one call each (one round
        trip), so a prompt that no tier holds costs one round trip per lookup at most."""
        count = 0
        while count < len(identities) and any(t.contains(identities[count]) for t in self._chain):
            count += 1
        if count == len(identities) or not self._shared:
            return count
        rest = identities[count : count + window]
        found = [False] * len(rest)
        for tier in self._shared:
            answers = tier.contains_many(rest)
            found = [was or now for was, now in zip(found, answers, strict=True)]
        for present in found:
            if not (present or any(t.contains(identities[count]) for t in self._chain)):
                break
            count += 1
        return count

    def keep_for_load(self, identities: Sequence[BlockLike]) -> None:
        """Make the chained tiers evict these blocks last: the device room for their load
        is made by evictions that demote other blocks into those tiers."""
        for tier in self._chain:
            tier.keep_for_load(identities)

    def load_many(
        self,
        identities: Sequence[BlockIdentity],
        blocks: Sequence[int],
        served: dict[str, int] | None = None,
    ) -> int:
        """Load ``identities[i]`` into device block ``blocks[i]`` as one batch.

        Returns how many leading blocks were loaded and verified: the caller uses
        ``blocks[:n]`` and must treat the rest (from the first miss on) as garbage, even
        where a later block happened to load. The copies are queued on the device's current
        stream, so work queued there afterwards (the forward pass) sees the loaded blocks.
        ``served``, when given, gains the blocks served per tier name.
        """
        if len(identities) != len(blocks):
            raise ValueError(f"{len(identities)} blocks to load but {len(blocks)} device blocks")
        if not identities:
            return 0
        started = time.perf_counter()
        sources = self._load_rows(identities, blocks)
        self.traffic.load_seconds += time.perf_counter() - started
        loaded = next((i for i, source in enumerate(sources) if source is None), len(sources))
        per_tier = Counter(sources[:loaded])
        self.traffic.loaded_from_cpu += per_tier["cpu"]
        self.traffic.loaded_from_disk += per_tier["disk"]
        self.traffic.loaded_from_remote += per_tier["remote"]
        self.traffic.discarded_loads += sum(source is not None for source in sources[loaded:])
        if served is not None:
            for name, count in per_tier.items():
                if name is not None:
                    served[name] = served.get(name, 0) + count
        return loaded

    def _load_rows(
        self, identities: Sequence[BlockIdentity], rows: Sequence[int]
    ) -> list[str | None]:
        """Each tier in turn loads what the tiers above it missed; the serving tier's name
        per block, or None where every tier missed."""
        sources: list[str | None] = [None] * len(identities)
        missing = list(range(len(identities)))
        for tier in self.tiers:
            if not missing:
                break
            found = tier.load_rows_into(
                [identities[i] for i in missing], self.kv_cache, [rows[i] for i in missing]
            )
            for i, hit in zip(missing, found, strict=True):
                if hit:
                    sources[i] = tier.name
            missing = [i for i, hit in zip(missing, found, strict=True) if not hit]
        return sources

    # -- stores -----------------------------------------------------------------------------
    def demote(self, block: int, identity: BlockIdentity) -> None:
        """Eviction hook: the device block's room is about to be reused (write-back)."""
        if self._backlog.pop(identity.block_hash, None) is not None:
            # NOTE: a write-through block still waiting for room has its last chance now,
            # so wait for room rather than lose a document's block.
            self._write_through(block, identity, blocking=True)
        # NOTE: a block already in a lower tier (written through) still goes to the top
        # tier, the fastest one to load it back from.
        if self._chain:
            top = self._chain[0]
            if not top.contains(identity) and top.put(identity, self.kv_cache[block]):
                self.traffic.demoted += 1
        self._publish(block, identity)

    def _publish(self, block: int, identity: BlockIdentity) -> None:
        """Offer the block to the shared tiers (each skips what it knows it holds)."""
        for tier in self._shared:
            if tier.put(identity, self.kv_cache[block]):
                self.traffic.published += 1

    def persist(self, block: int, identity: BlockIdentity) -> None:
        """Write-through: queue a freshly computed block for the first persistent tier of
        the chain now, or as soon as it has room (see ``drain_backlog``), and offer it to
        the shared tiers. A no-op without either."""
        self._publish(block, identity)
        durable = self._durable
        if durable is None:
            return
        if self._backlog or not durable.has_room():
            self._backlog[identity.block_hash] = (block, identity)
        else:
            self._write_through(block, identity)

    def drain_backlog(self, blocking: bool = False) -> None:
        """Queue backlogged write-through blocks still on the device (call between steps)."""
        durable = self._durable
        while self._backlog and durable is not None and (blocking or durable.has_room()):
            block_hash = next(iter(self._backlog))
            block, identity = self._backlog.pop(block_hash)
            if self.pool.identities[block] != identity:
                continue  # evicted meanwhile; its demotion went down the write-back path
            self._write_through(block, identity, blocking=blocking)

    def _write_through(self, block: int, identity: BlockIdentity, blocking: bool = False) -> None:
        assert self._durable is not None
        if self._durable.put(identity, self.kv_cache[block], blocking=blocking):
            self.traffic.persisted += 1

    # -- purge ------------------------------------------------------------------------------
    def block_links(self, fingerprint: str) -> list[tuple[bytes, bytes | None]]:
        """(hash, parent hash) of the blocks every tier holds under salt ``fingerprint``."""
        return [link for tier in self.tiers for link in tier.block_links(fingerprint)]

    def purge(self, fingerprint: str, hashes: set[bytes]) -> dict[str, int]:
        """Remove ``hashes`` from every tier, top down, and from the write-through backlog;
        returns the blocks removed per tier.

        NOTE: top down, because an upper tier hands its evictions to the one below: once
        the CPU tier has dropped a block, no later eviction can carry it to disk."""
        for block_hash in hashes:
            self._backlog.pop(block_hash, None)
        return {tier.name: tier.purge(fingerprint, hashes) for tier in self.tiers}

    # -- lifetime ---------------------------------------------------------------------------
    def flush_shared(self, timeout: float | None = None) -> bool:
        """Wait until the shared tiers have sent what they accepted before this call;
        False if that took over ``timeout`` seconds. Safe from any thread: it only waits
        on their write queues."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for tier in self._shared:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not tier.flush_queued(left):
                return False
        return True

    def flush(self) -> None:
        """Wait until every tier has stored what it accepted (queued disk and remote writes)."""
        for tier in self.tiers:
            tier.flush()

    def close(self) -> None:
        """Write the backlog, wait for queued writes, then close the tiers top down.

        Blocks held only by a non-persistent tier are lost, as they would be in a crash.
        """
        self.drain_backlog(blocking=True)
        self.flush()
        for tier in self.tiers:
            tier.close()


def _handing_to(lower: KVTier) -> EvictCallback:
    """An eviction callback that puts the evicted block into ``lower`` (never waiting)."""

    def hand_on(meta: BlockLike, block: torch.Tensor) -> None:
        lower.put(meta, block)

    return hand_on
