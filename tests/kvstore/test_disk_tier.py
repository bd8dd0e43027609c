"""The disk tier on real files: round trips, batched and staged reads, LRU within capacity,
restarts, two processes, tenants."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest
import torch
import xxhash

from kvstore.disk_tier import DiskTier
from kvstore.record_format import encode_record
from kvstore.tier import record_key, salt_fingerprint
from tests.kvstore.tier_blocks import SALT, SHAPE, bit_equal, make_meta, random_block


def record_size(index: int = 0, dtype: torch.dtype = torch.float32) -> int:
    return len(encode_record(make_meta(index), random_block(dtype, 0)))


def files(root: Path, pattern: str) -> list[Path]:
    return sorted(root.rglob(pattern))


def disk_usage(root: Path) -> int:
    """Bytes of all files under ``root``; files removed while listing count as 0."""
    total = 0
    for entry in root.rglob("*"):
        with contextlib.suppress(FileNotFoundError):
            total += entry.stat().st_size if entry.is_file() else 0
    return total


def fill(tier: DiskTier, indices: range | list[int], dtype: torch.dtype = torch.float32) -> None:
    for index in indices:
        assert tier.put(make_meta(index), random_block(dtype, index), blocking=True)
    tier.flush()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    with DiskTier(SHAPE, dtype, 1 << 20, tmp_path) as tier:
        fill(tier, range(4), dtype)
        for index in range(4):
            dest = torch.full(SHAPE, 3.0, dtype=dtype)
            assert tier.load_into(make_meta(index), dest)
            assert bit_equal(dest, random_block(dtype, index))
        assert not tier.load_into(make_meta(99), torch.empty(SHAPE, dtype=dtype))
        stats = tier.metrics()
    assert (stats.hits, stats.misses, stats.num_blocks, stats.store_count) == (4, 1, 4, 4)
    assert stats.bytes_written == stats.used_bytes == 4 * record_size(dtype=dtype)
    assert stats.bytes_read == 4 * record_size(dtype=dtype)
    assert stats.load_seconds_total > 0 and stats.store_seconds_total > 0
    group = tmp_path / salt_fingerprint(SALT)
    assert sorted(path.name for path in group.iterdir()) == sorted(
        make_meta(index).block_hash.hex() + ".kv" for index in range(4)
    )


def test_batched_restore_into_preallocated_tensor(tmp_path: Path) -> None:
    with DiskTier(SHAPE, torch.bfloat16, 1 << 20, tmp_path, num_readers=3) as tier:
        fill(tier, range(12), torch.bfloat16)
        metas = [make_meta(index) for index in [*range(12), 50]]
        dest = torch.zeros((13, *SHAPE), dtype=torch.bfloat16)
        assert tier.load_many_into(metas, dest) == [True] * 12 + [False]
        for index in range(12):
            assert bit_equal(dest[index], random_block(torch.bfloat16, index))
        rows = [torch.empty(SHAPE, dtype=torch.bfloat16) for _ in range(2)]
        assert tier.load_many_into([make_meta(3), make_meta(4)], rows) == [True, True]
        assert bit_equal(rows[1], random_block(torch.bfloat16, 4))


def test_non_contiguous_destination_goes_through_staging(tmp_path: Path) -> None:
    with DiskTier(SHAPE, torch.float32, 1 << 20, tmp_path) as tier:
        fill(tier, [0])
        dest = torch.zeros(tuple(reversed(SHAPE))).permute(4, 3, 2, 1, 0)
        assert not dest.is_contiguous() and tier.load_into(make_meta(0), dest)
        assert torch.equal(dest, random_block(torch.float32, 0))


def test_batch_through_staging_into_non_contiguous_destinations(tmp_path: Path) -> None:
    """Destinations that cannot be read into directly go through the readers' staging
    buffers; more records than buffers, so each buffer is reused."""
    metas = [make_meta(index) for index in range(9)]
    with DiskTier(SHAPE, torch.float32, 1 << 22, tmp_path, num_readers=2) as tier:
        for index, meta in enumerate(metas):
            path = tmp_path / record_key(meta).fingerprint / (meta.block_hash.hex() + ".kv")
            path.parent.mkdir(exist_ok=True)
            path.write_bytes(encode_record(meta, random_block(torch.float32, index)))
        backing = torch.zeros((9, *reversed(SHAPE)))
        dests = [backing[i].permute(4, 3, 2, 1, 0) for i in range(9)]
        assert not dests[0].is_contiguous()
        assert tier.load_many_into(metas, dests) == [True] * 9
        assert all(bit_equal(dests[i], random_block(torch.float32, i)) for i in range(9))


def test_rows_of_a_block_major_tensor_load_in_parallel(tmp_path: Path) -> None:
    with DiskTier(SHAPE, torch.float32, 1 << 20, tmp_path, num_readers=3) as tier:
        fill(tier, range(4))
        cache = torch.zeros((6, *SHAPE))
        rows = [5, 0, 3, 1, 2]
        found = tier.load_rows_into([make_meta(i) for i in (0, 1, 2, 9, 3)], cache, rows)
        assert found == [True, True, True, False, True]
        for index, row in zip((0, 1, 2, 3), (5, 0, 3, 2), strict=True):
            assert bit_equal(cache[row], random_block(torch.float32, index))
        with pytest.raises(ValueError, match="2 blocks to load but 1 destination rows"):
            tier.load_rows_into([make_meta(0), make_meta(1)], cache, [0])


def test_lru_eviction_keeps_capacity(tmp_path: Path) -> None:
    size = record_size()
    capacity = 5 * size + size // 2
    writers = 2
    with DiskTier(SHAPE, torch.float32, capacity, tmp_path, num_writers=writers) as tier:
        fill(tier, range(5))
        assert tier.load_into(make_meta(0), torch.empty(SHAPE))  # 0 becomes most recent
        fill(tier, [5, 6])
        # The least recently used record went first; 0, just read, stayed.
        assert tier.contains(make_meta(0)) and not tier.contains(make_meta(1))
        for index in range(7, 60):  # a workload far larger than the capacity
            tier.put(make_meta(index), random_block(torch.float32, index))
            # NOTE: a writer unlinks the record it evicted after its reservation is made,
            # so each may leave one on disk a moment longer.
            assert disk_usage(tmp_path) <= capacity + writers * size
        tier.flush()
        assert disk_usage(tmp_path) <= capacity
        stats = tier.metrics()
        assert stats.used_bytes <= capacity and stats.num_blocks == 5
        assert stats.evictions == stats.store_count - 5
        assert len(files(tmp_path, "*.kv")) == 5
        assert files(tmp_path, "*.tmp") == []


def test_restart_serves_records_written_before(tmp_path: Path) -> None:
    with DiskTier(SHAPE, torch.bfloat16, 1 << 20, tmp_path) as tier:
        fill(tier, range(6), torch.bfloat16)
    for age, index in enumerate([3, 0, 5, 1, 4, 2]):  # define LRU order through mtimes
        path = tmp_path / salt_fingerprint(SALT) / (make_meta(index).block_hash.hex() + ".kv")
        os.utime(path, ns=(1_000_000_000 * (age + 1),) * 2)
    with DiskTier(SHAPE, torch.bfloat16, 1 << 20, tmp_path) as restarted:
        assert restarted.lru_keys() == [record_key(make_meta(i)) for i in [3, 0, 5, 1, 4, 2]]
        assert restarted.metrics().used_bytes == 6 * record_size(dtype=torch.bfloat16)
        for index in range(6):
            dest = torch.empty(SHAPE, dtype=torch.bfloat16)
            assert restarted.load_into(make_meta(index), dest)
            assert bit_equal(dest, random_block(torch.bfloat16, index))


def test_restart_indexes_without_reading_payloads(tmp_path: Path) -> None:
    with DiskTier(SHAPE, torch.float32, 1 << 20, tmp_path) as tier:
        fill(tier, range(5))
    for path in files(tmp_path, "*.kv"):  # damage every payload: only a read can tell
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    with DiskTier(SHAPE, torch.float32, 1 << 20, tmp_path) as restarted:
        stats = restarted.metrics()
        assert (stats.num_blocks, stats.corrupt_records) == (5, 0)
        assert not restarted.load_into(make_meta(2), torch.empty(SHAPE))
        assert restarted.metrics().corrupt_records == 1


def test_index_of_many_records_is_fast(tmp_path: Path) -> None:
    """10k records index from names and sizes alone; no payload is opened."""
    group = tmp_path / salt_fingerprint(SALT)
    group.mkdir()
    record = encode_record(make_meta(0), random_block(torch.float32, 0))
    for index in range(10_000):
        (group / (make_meta(index).block_hash.hex() + ".kv")).write_bytes(record)
    (group / "README").write_text("not a record")
    (tmp_path / "not-a-group").mkdir()
    start = time.perf_counter()
    with DiskTier(SHAPE, torch.float32, 1 << 30, tmp_path) as tier:
        elapsed = time.perf_counter() - start
        assert tier.metrics().num_blocks == 10_000
        assert tier.load_into(make_meta(0), torch.empty(SHAPE))
    assert elapsed < 5.0, f"indexing 10k records took {elapsed:.2f} s"


def test_second_process_view_finds_new_records(tmp_path: Path) -> None:
    with DiskTier(SHAPE, torch.float32, 1 << 20, tmp_path) as reader:
        with DiskTier(SHAPE, torch.float32, 1 << 20, tmp_path) as writer:
            fill(writer, [7])
        dest = torch.empty(SHAPE)
        assert reader.contains(make_meta(7)) and reader.load_into(make_meta(7), dest)
        assert bit_equal(dest, random_block(torch.float32, 7))
        assert reader.metrics().used_bytes == record_size(7)


def test_tenants_are_grouped_and_isolated(tmp_path: Path) -> None:
    other_salt = xxhash.xxh3_128_digest(b"model-a|bs=4|tenant-2")
    with DiskTier(SHAPE, torch.float32, 1 << 20, tmp_path) as tier:
        fill(tier, [0])
        assert tier.put(make_meta(0, other_salt), random_block(torch.float32, 9), blocking=True)
        tier.flush()
        dest = torch.empty(SHAPE)
        assert tier.load_into(make_meta(0, other_salt), dest)
        assert bit_equal(dest, random_block(torch.float32, 9))
        assert tier.load_into(make_meta(0), dest)
        assert bit_equal(dest, random_block(torch.float32, 0))
    groups = sorted(path.name for path in tmp_path.iterdir())
    assert groups == sorted([salt_fingerprint(SALT), salt_fingerprint(other_salt)])


def test_discard_and_default_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with DiskTier(SHAPE, torch.float32, 1 << 20) as tier:
        assert tier.root == tmp_path / "xdg" / "ragserve" / "kv"
        assert tier.location == str(tier.root) and tier.capacity_bytes == 1 << 20
        fill(tier, [1])
        assert tier.discard(make_meta(1)) and not tier.discard(make_meta(1))
        assert files(tmp_path, "*.kv") == [] and tier.metrics().used_bytes == 0


def test_bad_arguments_raise_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="capacity must be > 0"):
        DiskTier(SHAPE, torch.float32, 0, tmp_path)
    with pytest.raises(ValueError, match="num_writers"):
        DiskTier(SHAPE, torch.float32, 1 << 20, tmp_path, num_writers=0)
    tier = DiskTier(SHAPE, torch.float32, 1 << 20, tmp_path)
    with pytest.raises(ValueError, match=r"dtype torch\.float32"):
        tier.put(make_meta(0), random_block(torch.float16, 0))
    tier.close()
    assert not tier.put(make_meta(0), random_block(torch.float32, 0))  # closed: dropped


@pytest.mark.gpu
def test_cuda_blocks_round_trip_through_disk(tmp_path: Path) -> None:
    with DiskTier(SHAPE, torch.bfloat16, 1 << 20, tmp_path) as tier:
        block = random_block(torch.bfloat16, 2).cuda()
        assert tier.put(make_meta(0), block, blocking=True)
        tier.flush()
        dest = torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda")
        assert tier.load_into(make_meta(0), dest)
        assert torch.equal(dest.cpu().view(torch.uint8), block.cpu().view(torch.uint8))


@pytest.mark.gpu
def test_batch_to_the_gpu_through_pinned_staging(tmp_path: Path) -> None:
    metas = [make_meta(index) for index in range(12)]
    with DiskTier(SHAPE, torch.float32, 1 << 22, tmp_path, num_readers=3) as tier:
        for index, meta in enumerate(metas):
            assert tier.put(meta, random_block(torch.float32, index))
        tier.flush()
        cache = torch.zeros((12, *SHAPE), device="cuda")
        assert tier.load_many_into(metas, [cache[11 - i] for i in range(12)]) == [True] * 12
        assert all(
            bit_equal(cache[11 - i].cpu(), random_block(torch.float32, i)) for i in range(12)
        )


def test_a_read_that_raises_fails_the_batch_after_every_other_read_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault that is not a bad record (a device error) fails the batch, but only once
    the other reads are over: one still running would write into blocks its caller has
    already given back."""
    from kvstore import disk_reader

    with DiskTier(SHAPE, torch.float32, 1 << 20, tmp_path, num_readers=4) as tier:
        fill(tier, range(6))
        read = disk_reader.read_record_into
        ended: list[int] = []

        def faulty(fd: int, size: int, meta: object, *args: object) -> None:
            if meta == make_meta(0):
                raise RuntimeError("device fault")
            time.sleep(0.2)
            read(fd, size, meta, *args)  # type: ignore[arg-type]
            ended.append(1)

        monkeypatch.setattr(disk_reader, "read_record_into", faulty)
        with pytest.raises(RuntimeError, match="device fault"):
            tier.load_many_into([make_meta(i) for i in range(6)], torch.empty((6, *SHAPE)))
        assert len(ended) == 5
