"""The server-process helper: a failed start reports the log; a CPU server runs with its
thread policy (OpenMP workers sleep instead of spinning) unless the user chose one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import requests

from ragserve.server.process import ServerProcess, ServerStartError
from tests.server.server_fixtures import BASE_ARGS

pytestmark = pytest.mark.e2e


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(): v.decode(errors="replace") for k, v in pairs}


def test_a_failed_start_quotes_the_log(tmp_path: Path) -> None:
    server = ServerProcess(["--max-num-seqs", "zero"], tmp_path / "bad.log", start_timeout=60)
    with pytest.raises(ServerStartError) as caught:
        server.start()
    assert "exited with code 2" in str(caught.value)
    assert "--max-num-seqs" in str(caught.value)  # argparse's own complaint, from the log
    assert not server.running and server.stop() == 2


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
@pytest.mark.parametrize("user_policy", [None, "ACTIVE"])
def test_cpu_server_thread_policy(tmp_path: Path, user_policy: str | None) -> None:
    env = {} if user_policy is None else {"OMP_WAIT_POLICY": user_policy}
    if user_policy is None and "OMP_WAIT_POLICY" in os.environ:
        pytest.skip("OMP_WAIT_POLICY is set in this environment")
    args = [*BASE_ARGS, "--device", "cpu"]
    with ServerProcess(args, tmp_path / "server.log", env=env, start_timeout=180) as server:
        assert requests.get(f"{server.url}/health", timeout=10).status_code == 200
        policy = environ_of(server.pid).get("OMP_WAIT_POLICY")
        log = server.log()
    assert server.wait(0) == 0  # stopped gracefully by the with block
    if user_policy is None:
        assert policy == "PASSIVE" and "restarting with OMP_WAIT_POLICY=PASSIVE" in log
    else:
        assert policy == "ACTIVE" and "restarting with" not in log
