"""The cluster benchmark's CPU accounting, on real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ragserve.bench.process_cpu import Snapshot, cores_by_role, cpu_seconds_by_process

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

SPIN = "import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass\n"


def spinning(title: str, seconds: float, then_sleep: float = 0.0) -> subprocess.Popen[bytes]:
    # NOTE: the title is in the command line, as Ray names a Serve replica's process
    code = SPIN.format(seconds=seconds) + f"time.sleep({then_sleep})"
    return subprocess.Popen([sys.executable, "-c", code, title])


def test_each_role_counts_only_the_cpu_it_used_in_the_window() -> None:
    replica = spinning("ray::ServeReplica:app:replica-0", 6.0)
    ingress = spinning("ray::ServeReplica:app:ingress", 0.8, then_sleep=6.0)
    try:
        # NOTE: only this test's processes count (a real cluster may run beside it)
        ours = {os.getpid(), replica.pid, ingress.pid}

        def snapshot() -> Snapshot:
            return {pid: row for pid, row in cpu_seconds_by_process().items() if pid in ours}

        time.sleep(1.5)  # NOTE: both started; the ingress has spun and now sleeps
        before = snapshot()
        started = time.perf_counter()
        spin_until = time.time() + 1.0
        while time.time() < spin_until:
            pass  # the client's own CPU
        cores = cores_by_role(before, snapshot(), time.perf_counter() - started)
    finally:
        for process in (replica, ingress):
            process.kill()
            process.wait(30)
    # NOTE: loose bounds: the spinners share a machine with whatever else runs
    assert cores.get("replicas", 0.0) > 0.1, cores
    assert cores.get("client", 0.0) > 0.1, cores
    assert cores.get("ingress", 0.0) < 0.05, cores  # its earlier CPU is not the window's
