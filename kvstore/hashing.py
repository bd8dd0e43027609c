"""Content hashes of KV blocks: ``h_i = xxh3_128(salt, h_{i-1}, token ids of block i)``.

A block's hash names its content *and* everything before it, so equal hashes mean an
equal prefix. The salt binds what else decides the KV values (model fingerprint, block
size, KV dtype) and the tenant namespace, so two tenants never share a hash.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgpack
import numpy as np
import xxhash

BlockHash = bytes  # 16-byte xxh3_128 digest
ROOT_PARENT = b"\x00" * 16  # the "previous hash" of a sequence's first block


def make_salt(fingerprint: str, block_size: int, kv_dtype: str, namespace: str = "") -> bytes:
    """A 16-byte digest of everything besides token ids that KV content depends on."""
    fields = msgpack.packb(["ragserve-kv-v1", fingerprint, block_size, kv_dtype, namespace])
    return xxhash.xxh3_128_digest(fields)


def hash_block(salt: bytes, parent: BlockHash, token_bytes: bytes) -> BlockHash:
    """The chained hash of one full block, given its token ids as little-endian int32 bytes."""
    # NOTE: one call over the joined bytes (the same digest as three updates): a 128k-token
    # prompt hashes 8,192 blocks per request, and the calls were most of the cost.
    return xxhash.xxh3_128_digest(salt + parent + token_bytes)


def token_bytes(token_ids: Sequence[int]) -> bytes:
    # NOTE: fromiter reads a list of ints 1.4x faster than asarray (131k ids: 2.9 ms).
    return np.fromiter(token_ids, dtype="<i4", count=len(token_ids)).tobytes()


def hash_full_blocks(
    salt: bytes,
    token_ids: Sequence[int],
    block_size: int,
    parent: BlockHash = ROOT_PARENT,
    start_block: int = 0,
) -> list[BlockHash]:
    """Hashes of the full blocks from ``start_block`` on, chained from ``parent``.

    ``parent`` must be the hash of block ``start_block - 1`` (or ``ROOT_PARENT``).
    """
    data = token_bytes(token_ids[start_block * block_size :])
    stride = block_size * 4
    hashes: list[BlockHash] = []
    for offset in range(0, len(data) - stride + 1, stride):
        parent = hash_block(salt, parent, data[offset : offset + stride])
        hashes.append(parent)
    return hashes
