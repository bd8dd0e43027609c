"""The engine's block-major KV tensor and how many blocks a memory budget buys."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvstore.page_advice import advise_small_pages


@dataclass(frozen=True)
class KVCacheSpec:
    """The cache's layout. ``row_width`` is its last dim, elements of ``dtype`` per (slot,
    kv head): ``head_dim`` for a plain cache, ``head_dim + 4`` bytes for an 8-bit one
    (``uint8`` e4m3 or ``int8`` codes: a slot's bytes hold its heads' codes, then their
    scales, ``kernels/fp8_kv.py``)."""

    num_layers: int
    num_kv_heads: int
    row_width: int
    block_size: int
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """One block: all layers' K and V for ``block_size`` tokens, contiguous."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.row_width)

    @property
    def bytes_per_block(self) -> int:
        count = 1
        for dim in self.block_shape:
            count *= dim
        return count * self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size

    def num_blocks_for(self, budget_bytes: float) -> int:
        return int(budget_bytes // self.bytes_per_block)

    def allocate(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        shape = (num_blocks, *self.block_shape)
        if device.type != "cpu":
            return torch.zeros(shape, dtype=self.dtype, device=device)
        # NOTE: numpy's zeros is calloc: the OS hands out zero pages lazily, so the resident
        # size grows with the blocks actually used, not with the whole budget (torch.zeros
        # would write every page now). Zeros matter: masked-out slots must not hold NaNs.
        raw = np.zeros((num_blocks, self.bytes_per_block), dtype=np.uint8)
        advise_small_pages(raw)
        return torch.from_numpy(raw).view(self.dtype).view(shape)
