"""A real ``ragserve serve`` in a subprocess on loopback (see
:mod:`ragserve.server.process`), and helpers to talk to it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from ragserve.server.process import ServerProcess as _BaseServerProcess

REPO = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 16
# Small KV cache: plenty for the tests, light on a shared machine.
BASE_ARGS = ("--kv-cache-gib", "0.25", "--max-num-batched-tokens", "512")


class ServerProcess(_BaseServerProcess):
    """The shared server helper plus what the tests read from a running server.

    ``scrape_headers``: what ``metrics`` sends (a key when the server has keys)."""

    scrape_headers: dict[str, str] | None = None

    def metrics(self) -> dict[str, float]:
        headers = self.scrape_headers or {}
        response = requests.get(f"{self.url}/metrics", headers=headers, timeout=30)
        assert response.status_code == 200, response.text[:300]
        return parse_metrics(response.text)


def start_server(*args: str, log_path: Path, timeout: float = 180.0) -> ServerProcess:
    process = ServerProcess([*BASE_ARGS, *args], log_path, start_timeout=timeout)
    key = _scrape_key(args)
    process.scrape_headers = {"Authorization": f"Bearer {key}"} if key else {}
    return process.start()


def _scrape_key(args: tuple[str, ...]) -> str | None:
    """A key that opens /metrics: the metrics key, else the first API key, if any."""
    for flag in ("--metrics-key", "--api-key"):
        if flag in args:
            return args[args.index(flag) + 1]
    if "--api-key-file" in args:
        lines = Path(args[args.index("--api-key-file") + 1]).read_text().splitlines()
        return next(line.strip() for line in lines if line.strip() and not line.startswith("#"))
    return None


@contextmanager
def running_server(*args: str, log_path: Path) -> Iterator[ServerProcess]:
    with start_server(*args, log_path=log_path) as server:
        yield server


def module_server(*args: str, api_key_file: str | None = None) -> Any:
    """A module-scoped fixture: one server, started once for the test module.

    ``api_key_file``: contents of a key file passed as ``--api-key-file``.
    """

    @pytest.fixture(scope="module")
    def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
        directory = tmp_path_factory.mktemp("server")
        extra: tuple[str, ...] = ()
        if api_key_file is not None:
            (directory / "keys.txt").write_text(api_key_file)
            extra = ("--api-key-file", str(directory / "keys.txt"))
        with running_server(*args, *extra, log_path=directory / "server.log") as process:
            yield process

    return server


def parse_metrics(text: str) -> dict[str, float]:
    """Samples by ``name{label="value",...}`` (labels sorted), e.g. ``ragserve_kv_blocks{state="used"}``."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def assert_error(
    response: requests.Response, status: int, code: str | None = None
) -> dict[str, Any]:
    """The response is ``status`` with an OpenAI-style error body; returns the error object."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]
    if code is not None:
        assert error["code"] == code, error
    return dict(error)


def wait_for(predicate: Any, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def wait_ready(
    url: str, doc_id: str, headers: dict[str, str] | None = None, timeout: float = 60.0
) -> dict[str, Any]:
    """Poll a document until it leaves ``ingesting``; returns its final state."""
    state: dict[str, Any] = {}

    def done() -> bool:
        nonlocal state
        state = requests.get(f"{url}/v1/documents/{doc_id}", headers=headers, timeout=30).json()
        return state.get("status") != "ingesting"

    assert wait_for(done, timeout, interval=0.2), state
    return state


def cached_tokens(url: str, doc_id: str, headers: dict[str, str]) -> int:
    """Prompt tokens served from cache for a one-token question naming ``doc_id``."""
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Which code has shelf 7?"}],
        "documents": [doc_id],
        "max_tokens": 1,
        "temperature": 0,
    }
    response = requests.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
