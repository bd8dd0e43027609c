"""Moves blocks between the device KV tensor and the tiers below it (CPU, disk).

Policy (write-back by default, write-through on request):
- a cached block evicted from the device is demoted: copied to the CPU tier, and from
  there to disk when the CPU tier evicts it (or straight to disk without a CPU tier);
- a block of a request marked ``persist`` (documents ingested through the document API)
  is written to disk as soon as it is computed, so it survives a crash or restart even
  if it is never evicted;
- a prefix lookup that runs out of device hits continues in the tiers, loading each hit
  into a fresh device block.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvstore.block_pool import BlockIdentity, BlockPool
from kvstore.tier_manager import TierManager


@dataclass
class TierTraffic:
    """Blocks moved by the link, per direction and tier."""

    loaded_from_cpu: int = 0
    loaded_from_disk: int = 0
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

    def contains(self, identity: BlockIdentity) -> bool:
        return self.tiers.lookup(identity) is not None

    def load(self, identity: BlockIdentity, block: int) -> bool:
        """Copy a verified block from a tier into device block ``block``."""
        started = time.perf_counter()
        source = self.tiers.load_into(identity, self.kv_cache[block])
        self.traffic.load_seconds += time.perf_counter() - started
        if source == "cpu":
            self.traffic.loaded_from_cpu += 1
        elif source == "disk":
            self.traffic.loaded_from_disk += 1
        return source is not None

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
