"""Random and adversarial requests to every endpoint while another tenant works normally.

Hypothesis draws method, route, body shape and values (deep JSON, huge numbers, odd
unicode, NUL bytes, wrong types) for every route of the API. Every answer must be a
clean 2xx/4xx (an OpenAI-shaped error body for 4xx), never a 5xx; the server must stay
healthy; and a second tenant's greedy chats, sent throughout, must all succeed with the
same answer they give on a quiet server.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.server.server_fixtures import ServerProcess, assert_error, module_server

pytestmark = pytest.mark.e2e

KEY_HOSTILE, KEY_VICTIM = "key-hostile", "key-victim"
HOSTILE = {"Authorization": f"Bearer {KEY_HOSTILE}"}
VICTIM = {"Authorization": f"Bearer {KEY_VICTIM}"}
server = module_server(
    "--api-key", KEY_HOSTILE, "--api-key", KEY_VICTIM,
    "--max-model-len", "1024", "--max-queue-seconds", "0", "--max-request-bytes", "65536",
)  # fmt: skip

VICTIM_CHAT = {
    "model": "SmolLM2-135M-Instruct",
    "messages": [{"role": "user", "content": "Name a colour."}],
    "max_tokens": 8,
    "temperature": 0,
}

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.sampled_from(["\x00", "<|im_start|>system", "\ud7ff" * 3, "a" * 3000, "-1", "1e309"]),
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = [
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "n", "seed", "stop", "stop_token_ids", "logprobs", "top_logprobs",
    "stream", "stream_options", "documents", "text", "metadata", "texts", "chunk_tokens",
    "max_summary_tokens", "role", "content", "echo", "min_tokens", "ignore_eos",
]  # fmt: skip
BODIES = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=6),
    JSON_VALUES,
    st.binary(max_size=200),
)
IDS = st.one_of(
    st.text(max_size=20), st.sampled_from(["..", "%00", "doc-0", "a/b", " ", "9" * 300])
)
ROUTES = st.one_of(
    st.tuples(
        st.just("POST"),
        st.sampled_from(
            ["/v1/chat/completions", "/v1/completions", "/v1/documents", "/v1/pipelines/summarize"]
        ),
    ),
    st.tuples(st.sampled_from(["GET", "DELETE"]), IDS.map(lambda i: f"/v1/documents/{i}")),
    st.tuples(
        st.sampled_from(["GET", "DELETE"]), IDS.map(lambda i: f"/v1/pipelines/summarize/{i}")
    ),
    st.tuples(
        st.sampled_from(["GET", "PUT", "PATCH"]),
        st.sampled_from(["/v1/models", "/v1/nowhere", "/metrics"]),
    ),
)


class Victim:
    """Tenant B's greedy chats, one after another, until stopped."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answers: list[tuple[int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def ask(self) -> tuple[int, str]:
        response = requests.post(
            f"{self.url}/v1/chat/completions", json=VICTIM_CHAT, headers=VICTIM, timeout=120
        )
        if response.status_code != 200:
            return response.status_code, response.text[:300]
        return 200, response.json()["choices"][0]["message"]["content"]

    def _run(self) -> None:
        while not self._stop.is_set():
            self.answers.append(self.ask())

    def __enter__(self) -> Victim:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=180)


@pytest.fixture(scope="module")
def victim(server: ServerProcess) -> Iterator[tuple[Victim, str]]:
    quiet = Victim(server.url).ask()
    assert quiet[0] == 200, quiet
    with Victim(server.url) as running:
        yield running, quiet[1]


def send(server: ServerProcess, method: str, path: str, body: Any) -> requests.Response:
    if isinstance(body, bytes):
        data, headers = body, {**HOSTILE, "Content-Type": "application/json"}
        return requests.request(method, server.url + path, data=data, headers=headers, timeout=120)
    return requests.request(method, server.url + path, json=body, headers=HOSTILE, timeout=120)


@settings(max_examples=80, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(route=ROUTES, body=BODIES)
def test_hostile_requests_get_clean_errors_and_spare_the_victim(
    server: ServerProcess, victim: tuple[Victim, str], route: tuple[str, str], body: Any
) -> None:
    method, path = route
    try:
        response = send(server, method, path, body if method in ("POST", "PUT", "PATCH") else None)
    except ValueError:
        return  # the client library itself refuses the URL (e.g. a control character)
    event(f"{method} {response.status_code}")
    assert response.status_code < 500, (method, path, response.status_code, response.text[:300])
    if response.status_code >= 400:
        assert_error(response, response.status_code)


def test_the_victim_was_unaffected_and_the_server_is_healthy(
    server: ServerProcess, victim: tuple[Victim, str]
) -> None:
    running, quiet_answer = victim
    running.__exit__()
    assert running.answers, "the victim sent nothing"
    assert all(answer == (200, quiet_answer) for answer in running.answers), running.answers[:5]
    assert requests.get(f"{server.url}/health", timeout=30).status_code == 200
