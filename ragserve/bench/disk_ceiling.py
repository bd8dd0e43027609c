"""The drive's own best sequential read: large ``O_DIRECT`` reads of one file, several in
flight, so neither the page cache nor a Python read loop sets the reference a tier is held to.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REQUEST_BYTES = 16 << 20  # NOTE: large enough that per-request costs vanish on NVMe
PROBE_MAX_BYTES = 4 << 30  # NOTE: O_DIRECT skips the page cache; more only costs time


def write_probe_file(path: Path, nbytes: int) -> int:
    """A file of ``nbytes`` (rounded up to whole requests) of incompressible bytes, on the
    drive (fsynced); returns its size."""
    chunk = os.urandom(REQUEST_BYTES)
    requests = max(1, -(-nbytes // REQUEST_BYTES))
    with path.open("wb", buffering=0) as handle:
        for _ in range(requests):
            handle.write(chunk)
        os.fsync(handle.fileno())
    return requests * REQUEST_BYTES


def direct_read_gbps(path: Path, threads: int) -> float | None:
    """Read ``path`` whole with ``O_DIRECT`` requests of ``REQUEST_BYTES``, ``threads`` in
    flight; None where the file system refuses ``O_DIRECT`` (tmpfs, some overlays)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError:
        return None
    size = os.fstat(fd).st_size
    offsets = list(range(0, size, REQUEST_BYTES))
    local = threading.local()

    def read(offset: int) -> int:
        if not hasattr(local, "buffer"):
            local.buffer = mmap.mmap(-1, REQUEST_BYTES)  # page-aligned, as O_DIRECT needs
        return os.preadv(fd, [local.buffer], offset)

    try:
        started = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(read, offsets))
        seconds = time.perf_counter() - started
    except OSError:
        return None  # EINVAL: the file system took the open but not the aligned reads
    finally:
        os.close(fd)
    return total / seconds / 1e9


def drive_read_ceiling(directory: Path, nbytes: int) -> dict[str, float | None]:
    """GB/s of ``O_DIRECT`` sequential reads of a probe file of ``nbytes`` (at most
    ``PROBE_MAX_BYTES``) in ``directory``, by requests in flight (1, 4, 16, 64); the probe
    file is deleted afterwards."""
    probe = directory / ".read-ceiling-probe"
    try:
        write_probe_file(probe, min(nbytes, PROBE_MAX_BYTES))
        return {str(n): direct_read_gbps(probe, n) for n in (1, 4, 16, 64)}
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
