"""Small KV blocks and their identities, shared by the tier tests."""

from __future__ import annotations

import torch
import xxhash

from kvstore.tier import BlockMeta

SHAPE = (2, 2, 4, 2, 8)  # layers, K/V, block size, KV heads, head_dim
SALT = xxhash.xxh3_128_digest(b"model-a|bs=4|tenant-1")


def make_meta(index: int, salt: bytes = SALT) -> BlockMeta:
    """The identity of the ``index``-th 4-token block under ``salt``."""
    return BlockMeta(
        block_hash=xxhash.xxh3_128_digest(salt + index.to_bytes(8, "little")),
        parent_hash=None,
        token_ids=tuple(range(index * 4, index * 4 + 4)),
        salt=salt,
    )


def random_block(dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(dtype)


def bit_equal(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Equal bit for bit (unlike ``torch.equal``, NaNs and signed zeros count)."""
    return torch.equal(first.contiguous().view(torch.uint8), second.contiguous().view(torch.uint8))
