"""Disk-tier records encrypted at rest: no token ids in the bytes, round trips with the
key, and a wrong or missing key (or a plain record under a key) is a miss, never garbage."""

from __future__ import annotations

import struct
from pathlib import Path

import msgpack
import pytest
import torch

from kvstore.disk_tier import DiskTier
from kvstore.record_cipher import RecordCipher
from kvstore.tier import BlockMeta
from tests.kvstore.tier_blocks import SALT, SHAPE, bit_equal, random_block

KEY = b"k" * 32
TOKENS = (70001, 70002, 70003, 70004)
META = BlockMeta(b"\x11" * 16, None, TOKENS, SALT)


def tier(root: Path, key: bytes | None) -> DiskTier:
    cipher = RecordCipher(key) if key is not None else None
    return DiskTier(SHAPE, torch.float32, 1 << 22, root, cipher=cipher)


def write(root: Path, key: bytes | None) -> torch.Tensor:
    block = random_block(torch.float32, 3)
    with tier(root, key) as disk:
        assert disk.put(META, block, blocking=True)
        disk.flush()
    return block


def record_bytes(root: Path) -> bytes:
    (path,) = root.rglob("*.kv")
    return path.read_bytes()


def test_round_trip_without_plaintext(tmp_path: Path) -> None:
    block = write(tmp_path, KEY)
    raw = record_bytes(tmp_path)
    for needle in (b"".join(msgpack.packb(t) for t in TOKENS), struct.pack("<4I", *TOKENS)):
        assert needle not in raw
    assert block.numpy().tobytes() not in raw  # the payload is sealed too
    with tier(tmp_path, KEY) as disk:
        loaded = disk.get(META)
        assert loaded is not None and bit_equal(loaded, block)


@pytest.mark.parametrize("reader_key", [b"w" * 32, None])
def test_wrong_or_missing_key_misses(tmp_path: Path, reader_key: bytes | None) -> None:
    write(tmp_path, KEY)
    with tier(tmp_path, reader_key) as disk:
        assert disk.get(META) is None
        assert (
            disk.metrics().misses + disk.metrics().foreign_records + disk.metrics().corrupt_records
            >= 1
        )


def test_a_plain_record_misses_under_a_key(tmp_path: Path) -> None:
    write(tmp_path, None)
    with tier(tmp_path, KEY) as disk:
        assert disk.get(META) is None


def test_short_keys_are_refused() -> None:
    with pytest.raises(ValueError):
        RecordCipher(b"short")
