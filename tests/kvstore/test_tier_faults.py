"""Real faults against the disk tier: damaged records, a full disk, unwritable directories,
a writer killed with SIGKILL, and two processes sharing one directory."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import xxhash

from kvstore.disk_index import FIT_INTERVAL_S
from kvstore.disk_tier import DiskTier, TierDirectoryError
from kvstore.record_format import PREFIX, encode_head, encode_record, tensor_bytes
from kvstore.tier import BlockMeta, salt_fingerprint
from tests.kvstore.tier_blocks import SALT, SHAPE, bit_equal, make_meta

BIG_SHAPE = (4, 2, 16, 4, 16)  # 32 KiB in float32
REPO = Path(__file__).resolve().parents[2]


def make_block(index: int, version: int = 0, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(index * 10 + version))


def record_path(root: Path, meta: BlockMeta) -> Path:
    return root / salt_fingerprint(meta.salt) / (meta.block_hash.hex() + ".kv")


def temp_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.tmp"))


def mount_tmpfs(target: Path, options: str) -> None:
    target.mkdir(exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root and mount rights): {done.stderr}")


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB filesystem: a real ENOSPC without filling the machine's disk."""
    target = tmp_path / "tiny"
    mount_tmpfs(target, "size=256k")
    yield target
    subprocess.run(["umount", "-l", str(target)], check=False)


@pytest.fixture
def readonly_tmpfs(tmp_path: Path) -> Iterator[Path]:
    target = tmp_path / "readonly"
    mount_tmpfs(target, "ro,size=64k")
    yield target
    subprocess.run(["umount", "-l", str(target)], check=False)


# ---------------------------------------------------------------------- damaged records
def truncate_payload(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 10)


def truncate_to_prefix(path: Path) -> None:
    os.truncate(path, PREFIX.size - 3)


def truncate_to_nothing(path: Path) -> None:
    os.truncate(path, 0)


def flip_byte(offset: int) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x10
        path.write_bytes(bytes(data))

    return damage


def replace_with_foreign_salt(path: Path) -> None:
    stranger = dataclasses.replace(make_meta(0), salt=xxhash.xxh3_128_digest(b"other model"))
    path.write_bytes(encode_record(stranger, make_block(0)))


def replace_with_next_version(path: Path) -> None:
    block = make_block(0)
    payload = tensor_bytes(block)
    path.write_bytes(encode_head(make_meta(0), block.dtype, SHAPE, payload, version=2) + payload)


@pytest.mark.parametrize(
    ("damage", "counter"),
    [
        (truncate_payload, "corrupt_records"),
        (truncate_to_prefix, "corrupt_records"),
        (truncate_to_nothing, "corrupt_records"),
        (flip_byte(-1), "corrupt_records"),  # payload: checksum
        (flip_byte(PREFIX.size + 9), "corrupt_records"),  # header bytes
        (flip_byte(0), "corrupt_records"),  # magic
        (replace_with_foreign_salt, "foreign_records"),
        (replace_with_next_version, "foreign_records"),
    ],
)
def test_damaged_record_is_a_miss_and_removed(
    tmp_path: Path, damage: Callable[[Path], None], counter: str
) -> None:
    with DiskTier(SHAPE, torch.float32, 1 << 20, tmp_path) as tier:
        assert tier.put(make_meta(0), make_block(0), blocking=True)
        tier.flush()
        path = record_path(tmp_path, make_meta(0))
        damage(path)
        assert tier.get(make_meta(0)) is None
        assert not path.exists()
        stats = tier.metrics()
        assert getattr(stats, counter) == 1 and stats.hits == 0 and stats.misses == 1
        assert stats.num_blocks == 0 and stats.used_bytes == 0
        assert not tier.contains(make_meta(0))
        # the block can be stored again and then served
        assert tier.put(make_meta(0), make_block(0), blocking=True)
        tier.flush()
        dest = torch.empty(SHAPE)
        assert tier.load_into(make_meta(0), dest) and bit_equal(dest, make_block(0))


def test_damaged_record_on_a_read_only_drive_is_a_miss(tiny_tmpfs: Path) -> None:
    """It cannot be removed, but the read is a miss all the same, never an error."""
    with DiskTier(SHAPE, torch.float32, 1 << 17, tiny_tmpfs) as tier:
        assert tier.put(make_meta(0), make_block(0), blocking=True)
        tier.flush()
        path = record_path(tiny_tmpfs, make_meta(0))
        flip_byte(-1)(path)
        subprocess.run(["mount", "-o", "remount,ro", str(tiny_tmpfs)], check=True)
        try:
            for _ in range(2):  # again: the file is still there, and still rejected
                assert not tier.load_into(make_meta(0), torch.empty(SHAPE))
            assert path.exists() and tier.metrics().corrupt_records == 2
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(tiny_tmpfs)], check=True)


def test_wrong_token_ids_are_a_mismatch(tmp_path: Path) -> None:
    with DiskTier(SHAPE, torch.float32, 1 << 20, tmp_path) as tier:
        tier.put(make_meta(0), make_block(0), blocking=True)
        tier.flush()
        collision = dataclasses.replace(make_meta(0), token_ids=(5, 6, 7, 8))
        assert not tier.load_into(collision, torch.empty(SHAPE))
        assert not record_path(tmp_path, make_meta(0)).exists()
        assert tier.metrics().mismatched_records == 1


@pytest.mark.parametrize(
    ("dtype", "shape"), [(torch.float16, SHAPE), (torch.bfloat16, (2, 2, 4, 8, 2))]
)
def test_other_layout_is_a_mismatch(
    tmp_path: Path, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    with DiskTier(SHAPE, torch.bfloat16, 1 << 20, tmp_path) as writer:
        writer.put(make_meta(0), make_block(0).to(torch.bfloat16), blocking=True)
    with DiskTier(shape, dtype, 1 << 20, tmp_path) as reader:
        assert reader.get(make_meta(0)) is None
        assert reader.metrics().mismatched_records == 1
    assert not record_path(tmp_path, make_meta(0)).exists()


def test_file_removed_behind_the_index_is_a_plain_miss(tmp_path: Path) -> None:
    with DiskTier(SHAPE, torch.float32, 1 << 20, tmp_path) as tier:
        tier.put(make_meta(0), make_block(0), blocking=True)
        tier.flush()
        record_path(tmp_path, make_meta(0)).unlink()
        assert not tier.load_into(make_meta(0), torch.empty(SHAPE))
        stats = tier.metrics()
        assert (stats.misses, stats.corrupt_records, stats.num_blocks) == (1, 0, 0)


def test_directory_removed_while_running_is_recreated(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with DiskTier(SHAPE, torch.float32, 1 << 20, tmp_path) as tier:
        tier.put(make_meta(0), make_block(0), blocking=True)
        tier.flush()
        shutil.rmtree(tmp_path / salt_fingerprint(SALT))
        tier.put(make_meta(1), make_block(1), blocking=True)
        tier.flush()
        assert tier.metrics().write_errors == 1 and not tier.contains(make_meta(1))
        assert not tier.load_into(make_meta(0), torch.empty(SHAPE))
        tier.put(make_meta(2), make_block(2), blocking=True)
        tier.flush()
        dest = torch.empty(SHAPE)
        assert tier.load_into(make_meta(2), dest) and bit_equal(dest, make_block(2))
        assert tier.metrics().num_blocks == 1
    assert "cannot write a KV record" in caplog.text


# ---------------------------------------------------------------------- disk full
def test_full_disk_pauses_writes_then_keeps_the_newest_records(
    tiny_tmpfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A budget larger than the drive: once full, writes pause, then the tier fits its
    capacity to the drive and its oldest records make room; it grows back with the room."""
    caplog.set_level(logging.INFO, logger="kvstore")
    tier = DiskTier(
        BIG_SHAPE, torch.float32, 1 << 30, tiny_tmpfs, num_writers=1, disk_full_retry_s=0.5
    )
    other_program = tiny_tmpfs / "other-program.bin"
    other_program.write_bytes(bytes(96 * 1024))
    written = []
    for index in range(40):
        tier.put(make_meta(index), make_block(index, shape=BIG_SHAPE), blocking=True)
        tier.flush()
        if tier.metrics().disk_full:
            break
        written.append(index)
    stats = tier.metrics()
    assert stats.disk_full and stats.disk_full_events == 1 and len(written) >= 2
    assert temp_files(tiny_tmpfs) == [], "the failed record must not stay behind"

    start = time.perf_counter()
    assert not tier.put(make_meta(100), make_block(100, shape=BIG_SHAPE))
    assert time.perf_counter() - start < 0.1
    assert tier.metrics().dropped_demotions >= 1

    dest = torch.empty(BIG_SHAPE)  # serving goes on
    for index in written:
        assert tier.load_into(make_meta(index), dest)
        assert bit_equal(dest, make_block(index, shape=BIG_SHAPE))

    time.sleep(0.6)  # after the pause: the oldest record makes room for the newest
    assert tier.put(make_meta(101), make_block(101, shape=BIG_SHAPE), blocking=True)
    tier.flush()
    stats = tier.metrics()
    assert tier.contains(make_meta(101)) and not tier.contains(make_meta(written[0]))
    assert not stats.disk_full and stats.disk_full_events == 1
    assert stats.capacity_bytes < 160 * 1024 and stats.evictions >= 1
    assert tier.load_into(make_meta(101), dest) and bit_equal(
        dest, make_block(101, shape=BIG_SHAPE)
    )

    fitted = stats.capacity_bytes
    other_program.unlink()  # room appears: the capacity grows back
    time.sleep(FIT_INTERVAL_S)  # the drive is asked once a second at most
    assert tier.put(make_meta(102), make_block(102, shape=BIG_SHAPE), blocking=True)
    tier.flush()
    assert tier.contains(make_meta(101)) and tier.contains(make_meta(102))
    assert tier.metrics().capacity_bytes >= fitted + 64 * 1024
    tier.close()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "full" in warnings[0].getMessage()
    assert "accepts writes again" in caplog.text


# ---------------------------------------------------------------------- unwritable dirs
def test_directory_under_a_file_raises_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a regular file, not a directory")
    target = blocker / "sub"
    with pytest.raises(TierDirectoryError, match="not a writable directory") as caught:
        DiskTier(SHAPE, torch.float32, 1 << 20, target)
    assert isinstance(caught.value, OSError)
    assert caught.value.filename == str(target) and str(target) in str(caught.value)
    assert caught.value.errno == errno.ENOTDIR


def test_unwritable_directory_can_disable_the_tier(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    tier = DiskTier(SHAPE, torch.float32, 1 << 20, blocker / "sub", disable_on_error=True)
    assert tier.metrics().disabled
    assert not tier.put(make_meta(0), make_block(0))
    assert not tier.contains(make_meta(0))
    assert not tier.load_into(make_meta(0), torch.empty(SHAPE))
    tier.flush()
    tier.close()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "disabled" in warnings[0].getMessage()


def test_read_only_filesystem_raises_a_clear_error(readonly_tmpfs: Path) -> None:
    with pytest.raises(TierDirectoryError) as caught:
        DiskTier(SHAPE, torch.float32, 1 << 20, readonly_tmpfs)
    assert caught.value.errno == errno.EROFS and caught.value.filename == str(readonly_tmpfs)


# ---------------------------------------------------------------------- crashes and sharing
def test_temp_files_of_dead_writers_are_removed_live_ones_kept(tmp_path: Path) -> None:
    with DiskTier(SHAPE, torch.float32, 1 << 20, tmp_path) as tier:
        tier.put(make_meta(0), make_block(0), blocking=True)
    group = tmp_path / salt_fingerprint(SALT)
    whole = encode_record(make_meta(1), make_block(1))
    dead = group / f".{make_meta(1).block_hash.hex()}.999999.deadbeef.tmp"
    dead.write_bytes(whole)  # complete bytes, but never renamed: must never count
    live = group / f".{make_meta(2).block_hash.hex()}.{os.getpid()}.cafe0000.tmp"
    live_fd = os.open(live, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(live_fd, fcntl.LOCK_EX)
    try:
        with DiskTier(SHAPE, torch.float32, 1 << 20, tmp_path) as restarted:
            assert not dead.exists() and live.exists()
            assert restarted.temp_files_removed == 1
            assert restarted.metrics().num_blocks == 1
            assert restarted.get(make_meta(1)) is None
    finally:
        os.close(live_fd)


def writer_main(directory: str, version: int, order: str, count: int) -> None:
    """Body of the writer subprocesses: blocking puts of deterministic blocks."""
    indices = range(count) if order == "forward" else range(count - 1, -1, -1)
    tier = DiskTier(BIG_SHAPE, torch.float32, 1 << 30, directory, num_writers=2)
    for index in indices:
        tier.put(make_meta(index), make_block(index, version, BIG_SHAPE), blocking=True)
    tier.close()


def spawn_writer(directory: Path, version: int, order: str, count: int) -> subprocess.Popen[bytes]:
    code = (
        f"import sys; sys.path[:0] = [{str(REPO)!r}]; "
        "import tests.kvstore.test_tier_faults as t; "
        f"t.writer_main({str(directory)!r}, {version}, {order!r}, {count})"
    )
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stderr=subprocess.PIPE)


@pytest.mark.e2e
def test_writer_killed_mid_write_leaves_only_valid_records(tmp_path: Path) -> None:
    writer = spawn_writer(tmp_path, version=1, order="forward", count=100_000)
    deadline = time.monotonic() + 45
    while len(list(tmp_path.rglob("*.kv"))) < 60:
        assert writer.poll() is None, writer.stderr.read() if writer.stderr else ""
        assert time.monotonic() < deadline, "the writer made no progress"
        time.sleep(0.02)
    os.kill(writer.pid, signal.SIGKILL)
    assert writer.wait(timeout=10) == -signal.SIGKILL

    by_hash = {make_meta(index).block_hash: index for index in range(20_000)}
    with DiskTier(BIG_SHAPE, torch.float32, 1 << 30, tmp_path) as tier:
        assert temp_files(tmp_path) == []
        keys = tier.lru_keys()
        assert len(keys) >= 60
        dest = torch.empty(BIG_SHAPE)
        for key in keys:
            index = by_hash[key.block_hash]
            assert tier.load_into(make_meta(index), dest), f"record {index} did not verify"
            assert bit_equal(dest, make_block(index, 1, BIG_SHAPE))
        stats = tier.metrics()
    assert stats.corrupt_records == 0 and stats.hits == len(keys)


@pytest.mark.e2e
def test_two_processes_share_one_directory(tmp_path: Path) -> None:
    count = 80
    reader = DiskTier(BIG_SHAPE, torch.float32, 1 << 30, tmp_path)
    writers = [
        spawn_writer(tmp_path, version=1, order="forward", count=count),
        spawn_writer(tmp_path, version=2, order="backward", count=count),
    ]
    expected = {
        index: (make_block(index, 1, BIG_SHAPE), make_block(index, 2, BIG_SHAPE))
        for index in range(count)
    }
    dest = torch.empty(BIG_SHAPE)
    rng = random.Random(0)
    while any(writer.poll() is None for writer in writers):
        index = rng.randrange(count)
        if reader.load_into(make_meta(index), dest):
            assert any(bit_equal(dest, version) for version in expected[index])
        time.sleep(0.001)  # NOTE: leave the (few) cores to the writers
    for writer in writers:
        assert writer.wait() == 0, writer.stderr.read() if writer.stderr else ""
    assert reader.metrics().corrupt_records == 0
    reader.close()

    with DiskTier(BIG_SHAPE, torch.float32, 1 << 30, tmp_path) as restarted:
        assert temp_files(tmp_path) == []
        assert restarted.metrics().num_blocks == count
        for index in range(count):
            assert restarted.load_into(make_meta(index), dest)
            assert any(bit_equal(dest, version) for version in expected[index])
        assert restarted.metrics().corrupt_records == 0
