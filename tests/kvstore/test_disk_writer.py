"""The disk tier's writer on its own: a bounded queue that drops rather than blocks, and
records that cannot fit."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from kvstore.disk_index import DiskIndex
from kvstore.disk_writer import DiskWriter
from kvstore.record_format import encode_record
from kvstore.tier import BlockMeta, TierMetrics, record_key
from tests.kvstore.tier_blocks import SALT, SHAPE, make_meta, random_block


def make_writer(
    root: Path, capacity: int, shape: tuple[int, ...] = SHAPE, **options: int
) -> tuple[DiskIndex, DiskWriter]:
    index = DiskIndex(root, capacity)
    writer = DiskWriter(
        index,
        shape,
        torch.float32,
        num_writers=options.get("num_writers", 2),
        max_pending_writes=options.get("max_pending_writes", 64),
        disk_full_retry_s=30.0,
        fsync=True,
    )
    writer.start()
    return index, writer


def metrics(index: DiskIndex, writer: DiskWriter) -> TierMetrics:
    snapshot = TierMetrics()
    index.add_metrics(snapshot)
    writer.add_metrics(snapshot)
    return snapshot


def put(writer: DiskWriter, meta: BlockMeta, block: torch.Tensor, blocking: bool = False) -> bool:
    return writer.put(record_key(meta), meta, block, blocking)


def test_full_queue_drops_without_blocking(tmp_path: Path) -> None:
    shape = (4, 2, 16, 4, 64)  # 128 KiB blocks: each write + fsync outlasts a put
    block = torch.randn(shape)
    index, writer = make_writer(tmp_path, 1 << 30, shape, num_writers=1, max_pending_writes=2)
    latencies, accepted = [], 0
    for number in range(60):
        start = time.perf_counter()
        accepted += put(writer, make_meta(number), block)
        latencies.append(time.perf_counter() - start)
    writer.flush()
    stats = metrics(index, writer)
    writer.close()
    assert stats.dropped_demotions > 0, "a 2-deep queue behind fsync should overflow"
    assert stats.dropped_demotions == 60 - accepted
    assert stats.num_blocks == accepted == stats.store_count
    assert max(latencies) < 0.25, f"a put blocked for {max(latencies):.3f} s"


def test_a_queued_or_stored_block_is_not_written_twice(tmp_path: Path) -> None:
    index, writer = make_writer(tmp_path, 1 << 20)
    block = random_block(torch.float32, 0)
    assert put(writer, make_meta(0), block, blocking=True)
    assert put(writer, make_meta(0), block)  # queued or already written: a no-op
    writer.flush()
    assert put(writer, make_meta(0), block)
    writer.flush()
    stats = metrics(index, writer)
    assert (stats.store_count, stats.num_blocks, stats.dropped_demotions) == (1, 1, 0)
    assert stats.bytes_written == stats.used_bytes == len(encode_record(make_meta(0), block))
    writer.close()


def test_record_larger_than_capacity_is_dropped_without_evicting(tmp_path: Path) -> None:
    size = len(encode_record(make_meta(0), random_block(torch.float32, 0)))
    index, writer = make_writer(tmp_path, 2 * size + 64)
    for number in (0, 1):
        assert put(writer, make_meta(number), random_block(torch.float32, number), blocking=True)
    long_meta = BlockMeta(b"\x05" * 16, None, tuple(range(1000)), SALT)  # a big header
    assert put(writer, long_meta, random_block(torch.float32, 5))
    writer.flush()
    stats = metrics(index, writer)
    assert not index.contains(record_key(long_meta)) and stats.dropped_demotions == 1
    assert stats.evictions == 0 and stats.num_blocks == 2
    writer.close()
