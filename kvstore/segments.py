"""Segments: a document's KV computed on its own, right after the fixed template tokens
that precede documents, kept in blocks like any other KV so that a prompt naming the
document at any position can reuse it (after moving its keys there).

A segment is the chain of full blocks of ``template + document`` hashed under the
*segment salt*, a digest of the ordinary salt (model fingerprint, block size, KV dtype,
tenant namespace) in a separate domain. So segment keys never equal prefix-chain keys,
and a tenant's segments are as private as its prefixes. Everything else is shared with
prefix blocks: the pool, the prefix index, demotion to the CPU and disk tiers, record
verification (stored token ids and salt), purges by chain.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvstore.hashing import BlockHash, hash_full_blocks
from kvstore.kv_cache_manager import KVAllocation, KVCacheManager
from kvstore.tier import BlockMeta

SEGMENT_DOMAIN = b"ragserve-segment-v1"


def segment_salt(salt: bytes) -> bytes:
    """The salt of segment chains for blocks otherwise salted by ``salt``."""
    return xxhash.xxh3_128_digest(SEGMENT_DOMAIN + salt)


@dataclass(frozen=True)
class Segment:
    """The KV of ``document`` computed after ``template``, stored under ``salt``.

    Only full blocks are stored: the document's last ``len(token_ids) % block_size``
    tokens are never in a segment (they are always computed).
    """

    salt: bytes  # a segment salt (see ``segment_salt``)
    token_ids: tuple[int, ...]  # template + document
    template_len: int
    block_size: int
    hashes: tuple[BlockHash, ...]

    @property
    def key(self) -> BlockHash:
        """Names the whole segment: the hash of its last full block."""
        return self.hashes[-1] if self.hashes else b""

    @property
    def stored_document_tokens(self) -> int:
        """Leading document tokens held by the segment's full blocks."""
        return max(0, len(self.hashes) * self.block_size - self.template_len)


def make_segment(
    salt: bytes, template: Sequence[int], document: Sequence[int], block_size: int
) -> Segment:
    """The segment of ``document`` after ``template`` for the ordinary salt ``salt``."""
    seg_salt = segment_salt(salt)
    tokens = (*template, *document)
    hashes = tuple(hash_full_blocks(seg_salt, tokens, block_size))
    return Segment(seg_salt, tokens, len(template), block_size, hashes)


@dataclass
class SegmentHold:
    """A segment's blocks shared (or loaded) onto the device for one read; release it after.

    ``tokens``: the segment's leading tokens held now. ``waiting``: the next block is being
    computed by a sequence, or can be loaded from a tier in a later step.
    """

    alloc: KVAllocation
    tokens: int
    waiting: bool
    block_size: int

    def slots(self, start: int, end: int) -> list[int]:
        """Cache slots of the segment's tokens ``start..end-1`` (segment positions)."""
        if end > self.tokens:
            raise ValueError(f"the hold has {self.tokens} tokens, asked for up to {end}")
        size, table = self.block_size, self.alloc.block_table
        return [table[i // size] * size + i % size for i in range(start, end)]


def hold_segment(manager: KVCacheManager, segment: Segment) -> SegmentHold:
    """Share the segment's cached blocks (device hits; tier hits are loaded within the
    step's load budget). The caller must ``release_segment`` the hold."""
    alloc = KVAllocation(salt=segment.salt, block_hashes=list(segment.hashes))
    try:
        held = manager.match_prefix(alloc, segment.token_ids, 0, leave_one=False)
        waiting = held < len(segment.hashes) * segment.block_size and (
            manager.waits_for_other(alloc, held)
            or manager.has_more_to_load(alloc, segment.token_ids, held)
        )
    except BaseException:  # NOTE: a tier copy fault: the device hits shared so far go back
        manager.free(alloc)
        raise
    return SegmentHold(alloc, held, waiting, segment.block_size)


def release_segment(manager: KVCacheManager, hold: SegmentHold) -> None:
    """Drop the hold's references; the blocks stay cached."""
    manager.free(hold.alloc)


def segment_stored(manager: KVCacheManager, segment: Segment) -> bool:
    """Whether every full block of ``segment`` is on the device or in a tier now."""
    tiers = manager.tiers
    for index, block_hash in enumerate(segment.hashes):
        if manager.pool.cached_identity(block_hash) is not None:
            continue
        start = index * segment.block_size
        meta = BlockMeta(
            block_hash,
            segment.hashes[index - 1] if index else None,
            segment.token_ids[start : start + segment.block_size],
            segment.salt,
        )
        if tiers is None or not tiers.contains(meta):
            return False
    return True
