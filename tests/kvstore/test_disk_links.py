"""The disk tier's record links (block → parent) on real files: read from the headers
once, remembered for records read or written before, others' records read, removed
records forgotten."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import xxhash

from kvstore.disk_links import DiskLinks
from kvstore.disk_tier import DiskTier
from kvstore.tier import BlockMeta, salt_fingerprint
from tests.kvstore.tier_blocks import SALT, SHAPE, random_block

FINGERPRINT = salt_fingerprint(SALT)


def chain(length: int, start: int = 0) -> list[BlockMeta]:
    metas: list[BlockMeta] = []
    parent = None
    for index in range(start, start + length):
        block_hash = xxhash.xxh3_128_digest(SALT + index.to_bytes(8, "little"))
        metas.append(BlockMeta(block_hash, parent, (index,) * 4, SALT))
        parent = block_hash
    return metas


def write(tier: DiskTier, metas: list[BlockMeta]) -> None:
    for index, meta in enumerate(metas):
        assert tier.put(meta, random_block(torch.float32, index), blocking=True)
    tier.flush()


def expected(metas: list[BlockMeta]) -> list[tuple[bytes, bytes | None]]:
    return sorted((meta.block_hash, meta.parent_hash) for meta in metas)


def record_paths(root: Path) -> list[str]:
    return sorted(str(path) for path in (root / FINGERPRINT).glob("*.kv"))


def test_links_of_written_records_and_of_another_process(tmp_path: Path) -> None:
    ours, theirs = chain(5), chain(3, start=100)
    with DiskTier(SHAPE, torch.float32, 1 << 20, tmp_path) as tier:
        write(tier, ours)
        with DiskTier(SHAPE, torch.float32, 1 << 20, tmp_path) as other:
            write(other, theirs)  # another server on the directory
        assert sorted(tier.block_links(FINGERPRINT)) == expected(ours + theirs)


def test_a_known_link_is_not_read_again(tmp_path: Path) -> None:
    metas = chain(4)
    with DiskTier(SHAPE, torch.float32, 1 << 20, tmp_path) as tier:
        write(tier, metas)
    links = DiskLinks(max_records=1 << 20)
    assert sorted(links.links(FINGERPRINT, record_paths(tmp_path))) == expected(metas)
    for path in record_paths(tmp_path):
        os.truncate(path, 10)  # its header can no longer be read
    assert sorted(links.links(FINGERPRINT, record_paths(tmp_path))) == expected(metas)
    assert (
        DiskLinks(max_records=1 << 20).links(FINGERPRINT, record_paths(tmp_path)) == []
    )  # a fresh one must read them


def test_removed_records_are_forgotten(tmp_path: Path) -> None:
    metas = chain(1200)
    links = DiskLinks(max_records=1 << 20)
    with DiskTier(SHAPE, torch.float32, 1 << 30, tmp_path) as tier:
        write(tier, metas)
        assert len(links.links(FINGERPRINT, record_paths(tmp_path))) == 1200
        tier.purge(FINGERPRINT, [meta.block_hash for meta in metas[10:]])
    remaining = record_paths(tmp_path)
    assert sorted(links.links(FINGERPRINT, remaining)) == expected(metas[:10])
    assert len(links) == 10


def test_listing_one_tenant_keeps_what_another_tenant_read(tmp_path: Path) -> None:
    other_salt = xxhash.xxh3_128_digest(b"model-a|bs=4|tenant-2")
    other = salt_fingerprint(other_salt)
    theirs = [
        BlockMeta(meta.block_hash, meta.parent_hash, meta.token_ids, other_salt)
        for meta in chain(1500, 50)
    ]
    with DiskTier(SHAPE, torch.float32, 1 << 30, tmp_path) as tier:
        write(tier, chain(3))
        write(tier, theirs)
    links = DiskLinks(max_records=1 << 20)
    their_paths = sorted(str(path) for path in (tmp_path / other).glob("*.kv"))
    assert len(links.links(other, their_paths)) == 1500
    assert len(links.links(FINGERPRINT, record_paths(tmp_path))) == 3  # a small tenant's
    assert len(links) == 1503  # the large one's links stay


def test_links_of_records_never_purged_stay_within_the_tiers_budget() -> None:
    links = DiskLinks(max_records=100)
    for index in range(5000):  # written and evicted long since, never listed
        fingerprint = f"{index % 3:016x}"
        links.wrote(fingerprint, f"/kv/{fingerprint}/{index:032x}.kv", bytes(16), None)
    assert len(links) <= 2 * 100 + 1024
