"""A device KV cache over a tier stack, without a model: the rig of the stack and manager tests."""

from __future__ import annotations

from pathlib import Path

import torch

from kvstore.block_pool import BlockIdentity, BlockPool
from kvstore.cpu_tier import CpuTier
from kvstore.disk_tier import DiskTier
from kvstore.hashing import ROOT_PARENT, hash_full_blocks, make_salt
from kvstore.kv_cache_manager import KVAllocation, KVCacheManager
from kvstore.remote_tier import RemoteTier
from kvstore.tier import KVTier, block_nbytes
from kvstore.tier_stack import TierStack

BS = 4
SHAPE = (2, 2, BS, 2, 8)
SALT = make_salt("batched-loads-test", BS, "float32")


def block_for(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def chain(tokens: list[int]) -> list[BlockIdentity]:
    """The identities of the full blocks of ``tokens`` under ``SALT``."""
    hashes = hash_full_blocks(SALT, tokens, BS)
    return [
        BlockIdentity(
            block_hash,
            hashes[index - 1] if index else ROOT_PARENT,
            SALT,
            tuple(tokens[index * BS : (index + 1) * BS]),
        )
        for index, block_hash in enumerate(hashes)
    ]


class TieredCache:
    """A real pool, device cache (a CPU tensor here), tier stack and manager.

    ``cpu_slots`` > 0 adds a CPU tier of that many blocks, ``disk_dir`` a disk tier below it,
    ``remote_url`` a remote tier beside them.
    """

    def __init__(
        self,
        num_blocks: int,
        cpu_slots: int,
        disk_dir: Path | None = None,
        remote_url: str | None = None,
    ) -> None:
        self.cache = torch.zeros((num_blocks, *SHAPE))
        self.pool = BlockPool(num_blocks)
        tiers: list[KVTier] = []
        if cpu_slots:
            tiers.append(
                CpuTier(SHAPE, torch.float32, cpu_slots * block_nbytes(SHAPE, torch.float32))
            )
        if disk_dir is not None:
            tiers.append(DiskTier(SHAPE, torch.float32, 1 << 24, disk_dir))
        if remote_url is not None:
            tiers.append(RemoteTier(SHAPE, torch.float32, remote_url))
        self.stack = TierStack(tiers, self.cache, self.pool)
        self.manager = KVCacheManager(self.pool, BS, True, tiers=self.stack)

    def tier(self, name: str) -> KVTier:
        return next(tier for tier in self.stack.tiers if tier.name == name)

    def alloc(self, tokens: list[int]) -> KVAllocation:
        alloc = KVAllocation(salt=SALT)
        self.manager.update_hashes(alloc, tokens)
        return alloc

    def compute(self, tokens: list[int], persist: bool = False) -> dict[int, torch.Tensor]:
        """'Prefill' ``tokens`` with random KV, register and release it; block index -> KV."""
        alloc = self.alloc(tokens)
        alloc.persist = persist
        assert self.manager.allocate(alloc, len(tokens))
        kv = {}
        for index, block in enumerate(alloc.block_table):
            self.cache[block] = block_for(1000 + index)
            kv[index] = self.cache[block].clone()
        self.manager.commit(alloc, tokens, len(tokens))
        self.manager.free(alloc)
        return kv

    def evict_to_tiers(self) -> None:
        self.pool.evict_all_free()
        self.stack.flush()
