"""The tiers below the device as one store: CPU first, then disk."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from kvstore.cpu_tier import CpuTier
from kvstore.disk_tier import DiskTier
from kvstore.tier import BlockLike, TierMetrics

TierName = Literal["cpu", "disk"]
GIB = 1 << 30


class TierManager:
    """Fans puts and loads out over an optional CPU tier and an optional disk tier.

    Policy:
    - ``put`` (a block demoted from the device) goes to the CPU tier; with
      ``write_through`` it is also queued for disk at once, so blocks survive a restart
      or a crash. Without a CPU tier it goes to disk.
    - A block the CPU tier evicts is handed to the disk tier (a no-op when write-through
      already stored or queued it). Without write-through, blocks only in the CPU tier
      are lost at shutdown.
    - Loads try CPU, then disk. A disk hit is not promoted to the CPU tier: the block is
      now on the device, and its next demotion puts it back in the CPU tier.
    """

    def __init__(
        self, cpu: CpuTier | None, disk: DiskTier | None, *, write_through: bool = True
    ) -> None:
        self.cpu = cpu
        self.disk = disk
        self.write_through = write_through
        if cpu is not None and disk is not None:
            if cpu.on_evict is not None:
                raise ValueError("the CPU tier already has an eviction callback")
            cpu.on_evict = self._demote

    @classmethod
    def from_budget(
        cls,
        block_shape: Sequence[int],
        dtype: torch.dtype,
        *,
        cpu_gib: float,
        disk_gib: float,
        disk_dir: str | os.PathLike[str] | None = None,
        write_through: bool = True,
        **disk_options: Any,
    ) -> TierManager:
        """Tiers from the engine's ``kv_cpu_gib`` / ``kv_disk_gib`` / ``kv_disk_dir``.

        A budget of 0 leaves that tier out. ``disk_options`` go to ``DiskTier``
        (e.g. ``disable_on_error=True``, ``num_writers``).
        """
        cpu = CpuTier(block_shape, dtype, int(cpu_gib * GIB)) if cpu_gib > 0 else None
        disk = (
            DiskTier(block_shape, dtype, int(disk_gib * GIB), disk_dir, **disk_options)
            if disk_gib > 0
            else None
        )
        return cls(cpu, disk, write_through=write_through)

    def _demote(self, meta: BlockLike, block: torch.Tensor) -> None:
        assert self.disk is not None
        self.disk.put(meta, block)

    def lookup(self, meta: BlockLike) -> TierName | None:
        """Which tier holds the block (index check only; a load may still miss)."""
        if self.cpu is not None and self.cpu.contains(meta):
            return "cpu"
        if self.disk is not None and self.disk.contains(meta):
            return "disk"
        return None

    def match_prefix(self, metas: Sequence[BlockLike]) -> int:
        """How many leading blocks of a hash chain some tier holds."""
        for count, meta in enumerate(metas):
            if self.lookup(meta) is None:
                return count
        return len(metas)

    def put(self, meta: BlockLike, block: torch.Tensor) -> bool:
        """Store a block leaving the device; True if some tier took it (or queued it)."""
        if block.device.type != "cpu" and self.cpu is not None and self.disk is not None:
            block = block.to("cpu")  # NOTE: one device-to-host copy feeds both tiers.
        stored = False
        if self.cpu is not None:
            stored = self.cpu.put(meta, block)
        if self.disk is not None and (self.cpu is None or self.write_through):
            stored = self.disk.put(meta, block) or stored
        return stored

    def load_into(self, meta: BlockLike, dest: torch.Tensor) -> TierName | None:
        """Load a verified block into ``dest``; the tier it came from, or None on a miss."""
        if self.cpu is not None and self.cpu.load_into(meta, dest):
            return "cpu"
        if self.disk is not None and self.disk.load_into(meta, dest):
            return "disk"
        return None

    def load_many_into(
        self, metas: Sequence[BlockLike], dests: torch.Tensor | Sequence[torch.Tensor]
    ) -> list[TierName | None]:
        """``load_into`` for many blocks: one batch from the CPU tier, its misses from disk
        with parallel readers. Copies to a device may still run on return (see ``CpuTier``)."""
        if len(dests) != len(metas):
            raise ValueError(f"{len(metas)} blocks to load but {len(dests)} destinations")
        sources: list[TierName | None] = [None] * len(metas)
        if self.cpu is not None:
            found = self.cpu.load_many_into(metas, dests)
            sources = ["cpu" if hit else None for hit in found]
        self._load_rest_from_disk(metas, lambda i: dests[i], sources)
        return sources

    def load_rows_into(
        self, metas: Sequence[BlockLike], cache: torch.Tensor, rows: Sequence[int]
    ) -> list[TierName | None]:
        """Load ``metas[i]`` into ``cache[rows[i]]`` (the device KV cache); the tier each
        block came from, or None on a miss (that row's contents are then unspecified).

        CPU hits are one batch of asynchronous copies (merged where rows and slots are
        consecutive); the CPU misses are read from disk by parallel readers. Copies to the
        device are queued on its current stream and may still run on return.
        """
        if len(rows) != len(metas):
            raise ValueError(f"{len(metas)} blocks to load but {len(rows)} destination rows")
        sources: list[TierName | None] = [None] * len(metas)
        if self.cpu is not None:
            found = self.cpu.load_rows_into(metas, cache, rows)
            sources = ["cpu" if hit else None for hit in found]
        self._load_rest_from_disk(metas, lambda i: cache[rows[i]], sources)
        return sources

    def _load_rest_from_disk(
        self,
        metas: Sequence[BlockLike],
        dest: Callable[[int], torch.Tensor],
        sources: list[TierName | None],
    ) -> None:
        rest = [i for i, source in enumerate(sources) if source is None]
        if self.disk is None or not rest:
            return
        found = self.disk.load_many_into([metas[i] for i in rest], [dest(i) for i in rest])
        for i, hit in zip(rest, found, strict=True):
            sources[i] = "disk" if hit else None

    def metrics(self) -> dict[TierName, TierMetrics]:
        result: dict[TierName, TierMetrics] = {}
        if self.cpu is not None:
            result["cpu"] = self.cpu.metrics()
        if self.disk is not None:
            result["disk"] = self.disk.metrics()
        return result

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        """Close the CPU tier first: with write-through its blocks are already queued."""
        if self.cpu is not None:
            self.cpu.close()
        if self.disk is not None:
            self.disk.close()
