"""The disk tier's index on its own: where the directory is, the start-up scan, the LRU order
and the byte budget with reservations."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvstore.disk_index import DiskIndex, resolve_disk_dir
from kvstore.record_format import encode_record
from kvstore.tier import TierMetrics, record_key, salt_fingerprint
from tests.kvstore.tier_blocks import SALT, make_meta, random_block


def write_records(root: Path, indices: range | list[int]) -> int:
    """Record files of blocks ``indices``, the i-th with mtime i+1 s; the size of one."""
    group = root / salt_fingerprint(SALT)
    group.mkdir(parents=True, exist_ok=True)
    for age, index in enumerate(indices):
        data = encode_record(make_meta(index), random_block(torch.float32, index))
        path = group / (make_meta(index).block_hash.hex() + ".kv")
        path.write_bytes(data)
        os.utime(path, ns=(1_000_000_000 * (age + 1),) * 2)
    return len(data)


def usage(index: DiskIndex) -> tuple[int, int, int]:
    """(num_blocks, used_bytes, evictions)."""
    snapshot = TierMetrics()
    index.add_metrics(snapshot)
    return snapshot.num_blocks, snapshot.used_bytes, snapshot.evictions


def keys(*indices: int) -> list[object]:
    return [record_key(make_meta(index)) for index in indices]


def test_resolve_disk_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_disk_dir(None) == tmp_path / "xdg" / "ragserve" / "kv"
    assert resolve_disk_dir("") == tmp_path / "xdg" / "ragserve" / "kv"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resolve_disk_dir(None) == tmp_path / "home" / ".cache" / "ragserve" / "kv"
    assert resolve_disk_dir("~/kv") == tmp_path / "home" / "kv"
    assert resolve_disk_dir(tmp_path / "kv") == tmp_path / "kv"


def test_scan_orders_records_by_mtime_and_ignores_strangers(tmp_path: Path) -> None:
    size = write_records(tmp_path, [3, 0, 5, 1])
    (tmp_path / salt_fingerprint(SALT) / "README").write_text("not a record")
    (tmp_path / "not-a-group").mkdir()
    index = DiskIndex(tmp_path, 1 << 20)
    index.scan()
    assert index.lru_keys() == keys(3, 0, 5, 1)
    assert usage(index) == (4, 4 * size, 0)


def test_scan_with_a_smaller_capacity_evicts_the_oldest(tmp_path: Path) -> None:
    size = write_records(tmp_path, range(6))
    index = DiskIndex(tmp_path, 2 * size)
    index.scan()
    assert index.lru_keys() == keys(4, 5)
    assert usage(index) == (2, 2 * size, 4)
    assert len(list(tmp_path.rglob("*.kv"))) == 2


def test_reservations_evict_the_least_recently_used(tmp_path: Path) -> None:
    size = write_records(tmp_path, range(3))
    index = DiskIndex(tmp_path, 3 * size + size // 2)
    index.scan()
    zero = record_key(make_meta(0))
    index.touch(zero, size, os.stat(index.path(zero)).st_ino)  # 0 becomes most recent
    assert index.reserve(size)  # 1 goes to make room
    assert index.lru_keys() == keys(2, 0) and usage(index) == (2, 3 * size, 1)
    assert not (
        tmp_path / salt_fingerprint(SALT) / (make_meta(1).block_hash.hex() + ".kv")
    ).exists()
    index.commit(record_key(make_meta(7)), size)
    assert index.lru_keys() == keys(2, 0, 7) and usage(index) == (3, 3 * size, 1)

    assert not index.reserve(4 * size)  # larger than the capacity: nothing is evicted
    assert usage(index) == (3, 3 * size, 1)
    assert index.reserve(size)
    index.unreserve(size)  # the write failed
    assert usage(index) == (2, 2 * size, 2)


def test_adopt_forget_and_discard(tmp_path: Path) -> None:
    index = DiskIndex(tmp_path, 1 << 20)
    index.scan()
    size = write_records(tmp_path, [4])  # written by another process after the scan
    key = record_key(make_meta(4))
    assert not index.contains(key)
    assert index.adopt(key) and index.contains(key) and usage(index) == (1, size, 0)
    assert index.reserve(size)
    index.commit(key, size)  # a write of the same record replaces the adopted copy
    assert usage(index) == (1, size, 0)
    assert index.forget(key) and not index.forget(key) and usage(index) == (0, 0, 0)
    assert Path(index.path(key)).exists()
    assert index.adopt(key) and index.discard(key)
    assert not Path(index.path(key)).exists() and not index.adopt(key)


def test_a_record_evicted_while_it_was_read_is_not_indexed_again(tmp_path: Path) -> None:
    size = write_records(tmp_path, range(2))
    index = DiskIndex(tmp_path, 2 * size)
    index.scan()
    oldest = record_key(make_meta(0))
    with open(index.path(oldest), "rb") as reader:  # NOTE: a restore reads the oldest record
        inode = os.fstat(reader.fileno()).st_ino
        assert index.reserve(size)  # a write evicts it meanwhile
        assert len(reader.read()) == size  # the open file still reads whole
    index.touch(oldest, size, inode)  # the read ends: its file is gone
    assert not index.contains(oldest)
    index.commit(record_key(make_meta(7)), size)
    assert usage(index) == (2, 2 * size, 1)  # the budget counts files that exist
    write_records(tmp_path, [0])  # written again (another inode): read and found
    rewritten = os.stat(index.path(oldest)).st_ino
    index.touch(oldest, size, rewritten)
    assert index.contains(oldest)
