"""A ``python -m ragserve serve`` subprocess on loopback: start, wait until healthy, stop.

Used by the tests, the load-test runner and ``ragserve bench serve``. The server binds
port 0 and logs the URL it got, so parallel runs never race for a port. Its output goes
to a log file (a pipe nobody drains would block it), and every failure quotes the end of
that log. ``stop`` is graceful (SIGTERM, the server's own shutdown), then SIGKILL after a
timeout; it also runs when ``start`` fails and when a ``with`` block raises.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TypeVar

PACKAGE_ROOT = Path(__file__).resolve().parents[2]
_SERVING = re.compile(r"ragserve serving .* at (http://\S+)/v1")
_POLL_S = 0.2
_S = TypeVar("_S", bound="ServerProcess")


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time; the message ends with its log."""


class ServerProcess:
    """One server subprocess. ``args`` are ``ragserve serve`` flags (engine flags included).

    ``log_level`` goes before the subcommand (``ragserve --log-level X serve``); ``env``
    adds to (or overrides) this process's environment. After :meth:`start`, ``url`` is
    ``http://host:port`` without ``/v1``.
    """

    def __init__(
        self,
        args: Sequence[str],
        log_path: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        log_level: str | None = None,
        env: Mapping[str, str] | None = None,
        start_timeout: float = 300.0,
        stop_timeout: float = 30.0,
    ) -> None:
        if start_timeout <= 0 or stop_timeout < 0:
            raise ValueError(
                f"start_timeout must be > 0 and stop_timeout >= 0, got {start_timeout}, {stop_timeout}"
            )
        self.log_path = Path(log_path)
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        level = ["--log-level", log_level] if log_level else []
        self.command = [sys.executable, "-m", "ragserve", *level, "serve"]
        self.command += ["--host", host, "--port", "0", *args]
        self._extra_env = dict(env or {})
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    # -- life cycle ------------------------------------------------------------------------
    def start(self: _S) -> _S:
        """Spawn, read the URL from the log, wait for ``GET /health`` = 200.

        Raises ServerStartError (after stopping the process) when it exits or is not
        healthy within ``start_timeout`` seconds.
        """
        if self.process is not None:
            raise RuntimeError("this server was already started")
        pythonpath = os.pathsep.join(
            p for p in (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")) if p
        )
        env = {
            **os.environ,
            "PYTHONPATH": pythonpath,
            "TOKENIZERS_PARALLELISM": "false",
            **self._extra_env,
        }
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, cwd=PACKAGE_ROOT, env=env
            )
        try:
            self._wait_healthy(time.monotonic() + self.start_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            self.check_alive()
            if not self.url:
                match = _SERVING.search(self.log())
                if match:
                    self.url = match.group(1)
            if self.url and _health_ok(self.url):
                return
            time.sleep(_POLL_S)
        raise ServerStartError(
            f"the server did not become healthy in {self.start_timeout:.0f} s:\n{self.log_tail()}"
        )

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM, then SIGKILL if it is still there after ``timeout`` (default
        ``stop_timeout``) or if waiting is interrupted. Returns the exit code (None if it
        was never started)."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(self.stop_timeout if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                pass
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        return process.returncode

    def __enter__(self: _S) -> _S:
        return self.start() if self.process is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    # -- state -----------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        return self._started().pid

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def send_signal(self, sig: int) -> None:
        self._started().send_signal(sig)

    def wait(self, timeout: float) -> int:
        """The exit code; ``subprocess.TimeoutExpired`` if it is still running after ``timeout``."""
        return self._started().wait(timeout)

    def _started(self) -> subprocess.Popen[bytes]:
        if self.process is None:
            raise RuntimeError("the server has not been started")
        return self.process

    def check_alive(self) -> None:
        """ServerStartError (with the log's end) if the process has exited."""
        if self.process is not None and self.process.poll() is not None:
            raise ServerStartError(
                f"the server exited with code {self.process.returncode}:\n{self.log_tail()}"
            )

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, chars: int = 4000) -> str:
        return self.log()[-chars:]


# NOTE: no proxies: the server is on loopback whatever HTTP_PROXY says.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _health_ok(url: str) -> bool:
    try:
        with _OPENER.open(f"{url}/health", timeout=5) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, OSError):
        return False
