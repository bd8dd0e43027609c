"""Moves blocks between the device KV tensor and the tiers below it (CPU, disk).

Policy (write-back by default, write-through on request):
- a cached block evicted from the device is demoted: copied to the CPU tier, and from
  there to disk when the CPU tier evicts it (or straight to disk without a CPU tier);
- a block of a request marked ``persist`` (documents ingested through the document API)
  is written to disk as soon as it is computed, so it survives a crash or restart even
  if it is never evicted;
- a prefix lookup that runs out of device hits continues in the tiers: a run of
  consecutive tier hits is loaded into fresh device blocks as one batch (``load_many``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.block_pool import BlockIdentity, BlockPool
from kvstore.tier_manager import TierManager


@dataclass
class TierTraffic:
    """Blocks moved by the link, per direction and tier.

    ``loaded_from_*`` count blocks served (the leading run of a batch, up to its first
    miss); ``discarded_loads`` counts blocks loaded past a miss of their batch and dropped.
    ``load_seconds`` is the host's wall time in load calls, verification included (CPU-tier
    copies may still be running when a call returns).
    """

    loaded_from_cpu: int = 0
    loaded_from_disk: int = 0
    discarded_loads: int = 0
    demoted: int = 0
    persisted: int = 0
    load_seconds: float = 0.0


class TierLink:
    def __init__(self, tiers: TierManager, kv_cache: torch.Tensor, pool: BlockPool) -> None:
        self.tiers = tiers
        self.kv_cache = kv_cache
        self.pool = pool
        self.traffic = TierTraffic()
        # Write-through blocks the disk queue had no room for yet, retried every step:
        # a document is persisted whole, however bursty its ingestion.
        self._backlog: dict[bytes, tuple[int, BlockIdentity]] = {}

    @property
    def block_nbytes(self) -> int:
        """Bytes of one device block (what one load moves)."""
        return self.kv_cache[0].nbytes

    def contains(self, identity: BlockIdentity) -> bool:
        return self.tiers.lookup(identity) is not None

    def load_many(self, identities: Sequence[BlockIdentity], blocks: Sequence[int]) -> int:
        """Load ``identities[i]`` into device block ``blocks[i]`` as one batch.

        Returns how many leading blocks were loaded and verified: the caller uses
        ``blocks[:n]`` and must treat the rest (from the first miss on) as garbage, even
        where a later block happened to load. The copies are queued on the device's current
        stream, so work queued there afterwards (the forward pass) sees the loaded blocks.
        """
        if len(identities) != len(blocks):
            raise ValueError(f"{len(identities)} blocks to load but {len(blocks)} device blocks")
        if not identities:
            return 0
        started = time.perf_counter()
        sources = self.tiers.load_rows_into(identities, self.kv_cache, blocks)
        self.traffic.load_seconds += time.perf_counter() - started
        loaded = next((i for i, source in enumerate(sources) if source is None), len(sources))
        self.traffic.loaded_from_cpu += sources[:loaded].count("cpu")
        self.traffic.loaded_from_disk += sources[:loaded].count("disk")
        self.traffic.discarded_loads += sum(source is not None for source in sources[loaded:])
        return loaded

    def demote(self, block: int, identity: BlockIdentity) -> None:
        """Eviction hook: the block's room is about to be reused on the device."""
        waiting = self._backlog.pop(identity.block_hash, None) is not None
        # NOTE: a write-through block still waiting for the disk queue has its last chance
        # now, so wait for room rather than lose a document's block.
        disk = self.tiers.disk
        if waiting and disk is not None and disk.put(identity, self.kv_cache[block], blocking=True):
            self.traffic.persisted += 1
        cpu = self.tiers.cpu
        if cpu is not None:
            # NOTE: a block already on disk (written through) still goes to the CPU tier,
            # the faster of the two to load it back from.
            if not cpu.contains(identity) and cpu.put(identity, self.kv_cache[block]):
                self.traffic.demoted += 1
        elif (
            disk is not None
            and not disk.contains(identity)
            and disk.put(identity, self.kv_cache[block])
        ):
            self.traffic.demoted += 1

    def persist(self, block: int, identity: BlockIdentity) -> None:
        """Write-through: queue a freshly computed block for disk now, or as soon as there is room."""
        disk = self.tiers.disk
        if disk is None:
            return
        if self._backlog or not disk.has_room():
            self._backlog[identity.block_hash] = (block, identity)
        elif disk.put(identity, self.kv_cache[block]):
            self.traffic.persisted += 1

    def drain_backlog(self, blocking: bool = False) -> None:
        """Queue backlogged write-through blocks still on the device (call between steps)."""
        disk = self.tiers.disk
        while self._backlog and disk is not None and (blocking or disk.has_room()):
            block_hash = next(iter(self._backlog))
            block, identity = self._backlog.pop(block_hash)
            if self.pool.identities[block] != identity:
                continue  # evicted meanwhile; its demotion went down the write-back path
            if disk.put(identity, self.kv_cache[block], blocking=blocking):
                self.traffic.persisted += 1

    def close(self) -> None:
        """Write the backlog, wait for queued disk writes, then release the tiers."""
        self.drain_backlog(blocking=True)
        self.tiers.flush()
        self.tiers.close()
