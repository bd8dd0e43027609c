"""Bad input, overload, disconnects and shutdown against a real ``ragserve serve``.

The server has a short context (1024), a 64 KiB body limit and room for 3 requests in
flight (and no limit on queued work), so every limit is cheap to reach.
"""

from __future__ import annotations

import http.client
import json
import signal
import time
from typing import Any
from urllib.parse import urlsplit

import pytest
import requests
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.server.server_fixtures import ServerProcess, assert_error, module_server, wait_for

pytestmark = pytest.mark.e2e

MAX_MODEL_LEN = 1024
MAX_WAITING = 3
MODEL = "ragserve/smol"
server = module_server(
    "--served-model-name", MODEL,
    "--max-model-len", str(MAX_MODEL_LEN),
    "--max-waiting-requests", str(MAX_WAITING),
    "--max-queue-seconds", "0",  # the count limit alone (work admission: test_server_admission)
    "--max-request-bytes", "65536",
    "--shutdown-timeout", "2",
)  # fmt: skip

C, CH, D = "/v1/completions", "/v1/chat/completions", "/v1/documents"
HI = [{"role": "user", "content": "hi"}]
LONG_TEXT = "hello " * 1200  # about 1200 tokens, beyond the 1024-token context
JSON = "application/json"

# (name, path, body, content type, status, code, param)
BAD_REQUESTS: list[tuple[str, str, Any, str, int, str | None, str | None]] = [
    ("broken json", C, b'{"prompt": "x",', JSON, 400, "invalid_json", None),
    ("array body", C, b"[1, 2]", JSON, 400, "invalid_json", None),
    ("invalid utf-8", C, b'{"prompt": "\xff"}', JSON, 400, "invalid_json", None),
    ("deep nesting", C, b"[" * 50000, JSON, 400, "invalid_json", None),
    ("lone surrogate", C, b'{"prompt": "\\ud800"}', JSON, 400, "invalid_json", None),
    ("NaN temperature", C, b'{"prompt": "x", "temperature": NaN}', JSON, 400, None, "temperature"),
    ("missing prompt", C, {}, JSON, 400, None, "prompt"),
    ("prompt of wrong type", C, {"prompt": 5}, JSON, 400, None, "prompt"),
    ("max_tokens as string", C, {"prompt": "x", "max_tokens": "5"}, JSON, 400, None, "max_tokens"),
    ("negative max_tokens", C, {"prompt": "x", "max_tokens": -3}, JSON, 400, None, "max_tokens"),
    (
        "huge max_tokens",
        C,
        {"prompt": "x", "max_tokens": 10**9},
        JSON,
        400,
        "context_length_exceeded",
        "max_tokens",
    ),
    (
        "enormous max_tokens",
        C,
        {"prompt": "x", "max_tokens": 10**40},
        JSON,
        400,
        "context_length_exceeded",
        "max_tokens",
    ),
    (
        "temperature as string",
        C,
        {"prompt": "x", "temperature": "hot"},
        JSON,
        400,
        None,
        "temperature",
    ),
    ("temperature too high", C, {"prompt": "x", "temperature": 3}, JSON, 400, None, "temperature"),
    ("top_p zero", C, {"prompt": "x", "top_p": 0}, JSON, 400, None, "top_p"),
    ("n as bool", C, {"prompt": "x", "n": True}, JSON, 400, None, "n"),
    ("n zero", C, {"prompt": "x", "n": 0}, JSON, 400, None, "n"),
    ("n too large", C, {"prompt": "x", "n": 17}, JSON, 400, None, "n"),
    ("logprobs too many", C, {"prompt": "x", "logprobs": 21}, JSON, 400, None, "logprobs"),
    ("seed beyond 64 bits", C, {"prompt": "x", "seed": 2**70}, JSON, 400, None, "seed"),
    ("empty stop string", C, {"prompt": "x", "stop": [""]}, JSON, 400, None, None),
    (
        "min_tokens above max_tokens",
        C,
        {"prompt": "x", "max_tokens": 2, "min_tokens": 5},
        JSON,
        400,
        None,
        None,
    ),
    ("penalty", C, {"prompt": "x", "presence_penalty": 1.0}, JSON, 400, None, None),
    ("repetition penalty", C, {"prompt": "x", "repetition_penalty": 1.5}, JSON, 400, None, None),
    ("min_p", C, {"prompt": "x", "min_p": 0.1}, JSON, 400, None, None),
    (
        "stop token beyond the vocabulary",
        C,
        {"prompt": "x", "stop_token_ids": [10**9]},
        JSON,
        400,
        None,
        None,
    ),
    ("stop token ids not a list", C, {"prompt": "x", "stop_token_ids": 30}, JSON, 400, None, None),
    (
        "stream_options without stream",
        C,
        {"prompt": "x", "stream_options": {"include_usage": True}},
        JSON,
        400,
        None,
        None,
    ),
    ("empty prompt", C, {"prompt": ""}, JSON, 400, None, "prompt"),
    ("empty prompt list", C, {"prompt": []}, JSON, 400, None, "prompt"),
    ("token id beyond the vocabulary", C, {"prompt": [10**9]}, JSON, 400, None, None),
    ("negative token id", C, {"prompt": [-1]}, JSON, 400, None, None),
    (
        "prompt beyond the context",
        C,
        {"prompt": LONG_TEXT},
        JSON,
        400,
        "context_length_exceeded",
        "prompt",
    ),
    ("unknown model", C, {"prompt": "x", "model": "gpt-9"}, JSON, 404, "model_not_found", "model"),
    (
        "unknown document",
        C,
        {"prompt": "x", "documents": ["0" * 32]},
        JSON,
        404,
        "document_not_found",
        "documents",
    ),
    (
        "malformed document id",
        C,
        {"prompt": "x", "documents": ["../etc"]},
        JSON,
        400,
        "invalid_document_id",
        "documents",
    ),
    ("documents not a list", C, {"prompt": "x", "documents": "abc"}, JSON, 400, None, "documents"),
    (
        "wrong content type",
        C,
        b'{"prompt": "x"}',
        "text/plain",
        415,
        "unsupported_media_type",
        None,
    ),
    ("oversized body", C, {"prompt": "x" * 70000}, JSON, 413, "request_too_large", None),
    ("messages as string", CH, {"messages": "hi"}, JSON, 400, None, "messages"),
    ("no messages", CH, {"messages": []}, JSON, 400, None, "messages"),
    (
        "unknown role",
        CH,
        {"messages": [{"role": "wizard", "content": "x"}]},
        JSON,
        400,
        None,
        "messages",
    ),
    (
        "content of wrong type",
        CH,
        {"messages": [{"role": "user", "content": 5}]},
        JSON,
        400,
        None,
        "messages",
    ),
    (
        "image content",
        CH,
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        },
        JSON,
        400,
        None,
        "messages",
    ),
    (
        "top_logprobs without logprobs",
        CH,
        {"messages": HI, "top_logprobs": 2},
        JSON,
        400,
        None,
        None,
    ),
    ("tools", CH, {"messages": HI, "tools": [{"type": "function"}]}, JSON, 400, None, None),
    (
        "chat beyond the context",
        CH,
        {"messages": [{"role": "user", "content": LONG_TEXT}]},
        JSON,
        400,
        "context_length_exceeded",
        "messages",
    ),
    (
        "chat max_tokens beyond the context",
        CH,
        {"messages": HI, "max_completion_tokens": 5000},
        JSON,
        400,
        "context_length_exceeded",
        "max_completion_tokens",
    ),
    ("empty document", D, {"text": ""}, JSON, 400, None, "text"),
    ("document of wrong type", D, {"text": 5}, JSON, 400, None, "text"),
    ("metadata not an object", D, {"text": "x", "metadata": [1]}, JSON, 400, None, "metadata"),
    (
        "document beyond the context",
        D,
        {"text": LONG_TEXT},
        JSON,
        400,
        "context_length_exceeded",
        "text",
    ),
    ("document as plain text", D, b"hello", "text/plain", 415, "unsupported_media_type", None),
]


def post(
    server: ServerProcess, path: str, body: Any, content_type: str = JSON
) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(
        f"{server.url}{path}", data=data, headers={"Content-Type": content_type}, timeout=60
    )


@pytest.mark.parametrize(
    ("path", "body", "content_type", "status", "code", "param"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
def test_bad_request_gets_its_error(
    server: ServerProcess,
    path: str,
    body: Any,
    content_type: str,
    status: int,
    code: str | None,
    param: str | None,
) -> None:
    error = assert_error(post(server, path, body, content_type), status, code)
    if param is not None:
        assert error["param"] == param, error
    if code == "context_length_exceeded":
        assert str(MAX_MODEL_LEN) in error["message"], error  # the numbers are in the message


def test_served_model_name(server: ServerProcess) -> None:
    models = requests.get(f"{server.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert requests.get(f"{server.url}/v1/models/{MODEL}", timeout=10).json()["id"] == MODEL
    out = post(server, C, {"model": MODEL, "prompt": "x", "max_tokens": 1}).json()
    assert out["model"] == MODEL
    assert_error(
        post(server, C, {"model": "SmolLM2-135M-Instruct", "prompt": "x"}), 404, "model_not_found"
    )


def test_error_statuses_outside_handlers(server: ServerProcess) -> None:
    assert_error(
        requests.get(f"{server.url}/v1/documents/xyz", timeout=10), 400, "invalid_document_id"
    )
    assert_error(requests.post(f"{server.url}/health", timeout=10), 405)
    assert_error(requests.get(f"{server.url}/nowhere", timeout=10), 404)
    big = {"file": ("big.txt", b"x" * 70000)}
    assert_error(requests.post(f"{server.url}{D}", files=big, timeout=30), 413, "request_too_large")
    metrics = server.metrics()
    assert metrics['ragserve_http_requests_total{endpoint="/v1/completions",status="400"}'] >= 20
    assert (
        metrics.get('ragserve_http_requests_total{endpoint="/v1/completions",status="500"}', 0) == 0
    )


# -- fuzz: random JSON in every field never yields a 5xx -----------------------------------
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def _field(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a plausible value, one time in five any JSON at all: so bodies are often valid."""
    return st.integers(0, 4).flatmap(lambda roll: _json if roll == 0 else valid)


# max_tokens is always there, never null and never a count between 4 and 10**6, so a valid
# request stays short; larger values hit the context check.
_max_tokens = _field(st.integers(1, 3)).filter(
    lambda v: v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 3 < v < 10**6)
)
_common = {
    "model": _field(st.just(MODEL)),
    "temperature": _field(st.floats(0, 2)),
    "top_p": _field(st.floats(0.01, 1)),
    "n": _field(st.integers(1, 3)),
    "stream": _field(st.booleans()),
    "stream_options": _field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "stop": _field(st.lists(st.text(min_size=1, max_size=3), max_size=2)),
    "seed": _field(st.integers(-(2**63), 2**63 - 1)),
    "user": _field(st.text(max_size=8)),
    "min_tokens": _field(st.integers(0, 1)),
    "documents": _field(
        st.lists(st.text("0123456789abcdef", min_size=32, max_size=32), max_size=1)
    ),
}
_message = st.fixed_dictionaries(
    {
        "role": _field(st.sampled_from(["system", "user", "assistant"])),
        "content": _field(st.text(max_size=20)),
    }
)
CHAT_BODIES = st.fixed_dictionaries(
    {"messages": _field(st.lists(_message, min_size=1, max_size=3)), "max_tokens": _max_tokens},
    optional={
        **_common,
        "logprobs": _field(st.booleans()),
        "top_logprobs": _field(st.integers(0, 20)),
    },
)
COMPLETION_BODIES = st.fixed_dictionaries(
    {
        "prompt": _field(
            st.one_of(
                st.text(min_size=1, max_size=30),
                st.lists(st.integers(0, 49151), min_size=1, max_size=4),
                st.lists(st.text(min_size=1, max_size=8), max_size=2),
            )
        ),
        "max_tokens": _max_tokens,
    },
    optional={**_common, "logprobs": _field(st.integers(0, 20)), "echo": _field(st.just(False))},
)
_FUZZ = settings(
    max_examples=50, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


def _check_fuzz_response(response: requests.Response) -> None:
    event(f"status {response.status_code}")
    assert response.status_code < 500, (response.status_code, response.text[:300])
    if response.status_code >= 400:
        assert_error(response, response.status_code)
    elif response.headers["Content-Type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n")
        assert '"error"' not in response.text
    else:
        assert response.json()["choices"]


@_FUZZ
@given(body=CHAT_BODIES)
def test_fuzzed_chat_bodies_never_fail_the_server(
    server: ServerProcess, body: dict[str, Any]
) -> None:
    _check_fuzz_response(post(server, CH, body))


@_FUZZ
@given(body=COMPLETION_BODIES)
def test_fuzzed_completion_bodies_never_fail_the_server(
    server: ServerProcess, body: dict[str, Any]
) -> None:
    _check_fuzz_response(post(server, C, body))


# -- disconnects, overload, shutdown -------------------------------------------------------
class OpenStream:
    """A streaming completion read over a raw connection, so the test decides when it ends."""

    def __init__(self, server: ServerProcess, max_tokens: int = MAX_MODEL_LEN - 50) -> None:
        parts = urlsplit(server.url)
        self.connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=60)
        body = {
            "prompt": "Count: one, two,",
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
        }
        self.connection.request("POST", C, json.dumps(body), {"Content-Type": JSON})
        self.response = self.connection.getresponse()
        assert self.response.status == 200

    def read_events(self, count: int) -> None:
        for _ in range(count):
            line = self.response.readline()
            while line in (b"\n", b"\r\n"):
                line = self.response.readline()
            assert line.startswith(b"data: {"), line

    def read_rest(self) -> bytes:
        try:
            return self.response.read()
        except http.client.IncompleteRead as exc:
            return exc.partial

    def disconnect(self) -> None:
        assert self.connection.sock is not None
        self.connection.sock.close()
        self.connection.close()


def _idle(server: ServerProcess) -> bool:
    metrics = server.metrics()
    return (
        metrics["ragserve_num_requests_active"] == 0
        and metrics['ragserve_kv_blocks{state="used"}'] == 0
    )


def test_disconnect_mid_stream_frees_blocks(server: ServerProcess) -> None:
    assert wait_for(lambda: _idle(server), 30)
    generated_before = server.metrics()["ragserve_generation_tokens_total"]
    stream = OpenStream(server)
    stream.read_events(3)
    assert server.metrics()['ragserve_kv_blocks{state="used"}'] > 0
    stream.disconnect()
    assert wait_for(lambda: _idle(server), 10), server.metrics()
    generated = server.metrics()["ragserve_generation_tokens_total"] - generated_before
    assert generated < MAX_MODEL_LEN / 2  # aborted long before its max_tokens


def test_overload_answers_503_quickly(server: ServerProcess) -> None:
    assert wait_for(lambda: _idle(server), 30)
    streams = [OpenStream(server) for _ in range(MAX_WAITING)]
    try:
        for stream in streams:
            stream.read_events(1)
        started = time.monotonic()
        response = post(server, C, {"prompt": "x", "max_tokens": 1})
        assert time.monotonic() - started < 2.0
        assert_error(response, 503, "overloaded")
        assert response.headers["Retry-After"] == "1"
        assert_error(post(server, D, {"text": "a new document"}), 503, "overloaded")
        assert requests.get(f"{server.url}/health", timeout=10).status_code == 200
    finally:
        for stream in streams:
            stream.disconnect()
    assert wait_for(lambda: _idle(server), 10)
    assert post(server, C, {"prompt": "x", "max_tokens": 1}).status_code == 200
    # More prompts than the server ever takes at once: a 400, not a 503 to retry for good.
    batch = post(server, C, {"prompt": ["x"] * (MAX_WAITING + 1), "max_tokens": 1})
    assert_error(batch, 400, "too_many_prompts")


def test_sigterm_shuts_down_gracefully(server: ServerProcess) -> None:
    """Runs last: stops the module's server."""
    stream = OpenStream(server)
    stream.read_events(1)
    server.send_signal(signal.SIGTERM)
    assert wait_for(lambda: _refuses_connections(server), 5)
    rest = stream.read_rest()  # cut after --shutdown-timeout (2 s)
    assert server.wait(30) == 0
    assert b"[DONE]" not in rest or b'"error"' in rest
    log = server.log()
    assert "shutting down: 1 engine requests in flight" in log and "engine stopped" in log
    assert "Traceback" not in log


def _refuses_connections(server: ServerProcess) -> bool:
    try:
        requests.get(f"{server.url}/health", timeout=2)
    except requests.ConnectionError:
        return True
    except requests.Timeout:
        return False  # accepted while shutting down on busy cores: ask again
    return False
