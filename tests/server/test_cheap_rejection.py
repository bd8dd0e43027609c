"""Cheap rejection against a real ``ragserve serve``: text that cannot fit the context is
refused on its byte count, before tokenizing, without slowing other requests or keeping
the memory it arrived in; large text that must be tokenized runs on its own thread.

The bounds are the issue's: a 20 MB chat message is refused within 1 s, a concurrent
normal chat's latency stays within 2x of its unloaded latency (medians of a few runs, so
one scheduling hiccup on a shared machine does not decide), and the server's RSS returns
within 200 MB of its baseline.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import requests

from tests.server.server_fixtures import ServerProcess, assert_error, module_server, wait_for

pytestmark = pytest.mark.e2e

server = module_server()  # the model's own context: 8192 tokens
CHAT = "/v1/chat/completions"
JSON = {"Content-Type": "application/json"}
NORMAL = {
    "messages": [{"role": "user", "content": "Name three colours."}],
    "max_tokens": 24,
    "ignore_eos": True,
    "temperature": 0,
}
TWENTY_MB = 20_000_000
MiB = 2**20


def rss_bytes(server: ServerProcess) -> int:
    with open(f"/proc/{server.pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def timed(send: Callable[[], requests.Response]) -> tuple[requests.Response, float]:
    started = time.perf_counter()
    response = send()
    return response, time.perf_counter() - started


def normal_chat(server: ServerProcess) -> float:
    response, elapsed = timed(lambda: requests.post(f"{server.url}{CHAT}", json=NORMAL, timeout=60))
    assert response.status_code == 200, response.text[:300]
    return elapsed


def alongside(
    server: ServerProcess, send_big: Callable[[], requests.Response]
) -> tuple[requests.Response, float, float]:
    """``send_big`` and a normal chat at the same time: the big response, its time and the
    chat's time."""
    result: dict[str, Any] = {}

    def big() -> None:
        result["big"] = timed(send_big)

    thread = threading.Thread(target=big)
    thread.start()
    time.sleep(0.05)  # the big body is on its way
    chat = normal_chat(server)
    thread.join()
    response, elapsed = result["big"]
    return response, elapsed, chat


def unloaded_latency(server: ServerProcess) -> float:
    normal_chat(server)  # warm-up
    return statistics.median(normal_chat(server) for _ in range(5))


def big_chat_body(size: int) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "a" * size}]}).encode()


def test_20_mb_chat_message_is_refused_fast_without_hurting_others(server: ServerProcess) -> None:
    unloaded = unloaded_latency(server)
    baseline = rss_bytes(server)
    body = big_chat_body(TWENTY_MB)  # encoded before the clock starts

    def send() -> requests.Response:
        return requests.post(f"{server.url}{CHAT}", data=body, headers=JSON, timeout=60)

    refusals, chats = [], []
    for _ in range(3):
        response, elapsed, chat = alongside(server, send)
        error = assert_error(response, 400, "context_length_exceeded")
        assert error["param"] == "messages" and "8192" in error["message"], error
        refusals.append(elapsed)
        chats.append(chat)
    assert max(refusals) < 1.0, refusals
    assert statistics.median(chats) <= 2 * unloaded, (chats, unloaded)
    assert wait_for(lambda: rss_bytes(server) - baseline < 200 * MiB, 10), (
        rss_bytes(server) - baseline
    ) / MiB


def test_20_mb_document_is_refused_fast(server: ServerProcess) -> None:
    baseline = rss_bytes(server)
    text = "a" * TWENTY_MB
    json_body = json.dumps({"text": text}).encode()
    response, elapsed = timed(
        lambda: requests.post(
            f"{server.url}/v1/documents", data=json_body, headers=JSON, timeout=60
        )
    )
    assert assert_error(response, 400, "context_length_exceeded")["param"] == "text"
    assert elapsed < 1.0, elapsed
    files = {"file": ("big.txt", text.encode())}
    response, elapsed = timed(
        lambda: requests.post(f"{server.url}/v1/documents", files=files, timeout=60)
    )
    assert_error(response, 400, "context_length_exceeded")
    assert elapsed < 1.0, elapsed
    assert wait_for(lambda: rss_bytes(server) - baseline < 200 * MiB, 10)


def test_large_text_is_tokenized_without_holding_up_other_requests(
    server: ServerProcess,
) -> None:
    """600 KB fit the byte bound (8192 tokens x 81 bytes), so they are tokenized (a second
    or more here), on the large-input thread, then refused on their token count. A small
    request that needs the tokenizer meanwhile (45 KB, refused on its token count too, so
    only tokenizing counts) is answered before the large one."""
    normal_chat(server)
    baseline = rss_bytes(server)
    big_body, small_body = (
        big_chat_body(600_000),
        json.dumps({"messages": [{"role": "user", "content": "word " * 9000}]}).encode(),
    )
    finished: dict[str, float] = {}

    def send(name: str, body: bytes) -> None:
        response = requests.post(f"{server.url}{CHAT}", data=body, headers=JSON, timeout=60)
        finished[name] = time.perf_counter()
        error = assert_error(response, 400, "context_length_exceeded")
        assert "tokens" in error["message"] and "bytes" not in error["message"], error

    big = threading.Thread(target=send, args=("big", big_body))
    big.start()
    time.sleep(0.2)  # the large text is being tokenized
    send("small", small_body)
    big.join()
    assert finished["small"] < finished["big"], finished
    assert wait_for(lambda: rss_bytes(server) - baseline < 200 * MiB, 10)


def test_text_under_the_bound_is_served_as_before(server: ServerProcess) -> None:
    text = "word " * 200
    response = requests.post(
        f"{server.url}{CHAT}",
        json={"messages": [{"role": "user", "content": text}], "max_tokens": 2},
        timeout=60,
    )
    assert response.status_code == 200, response.text[:300]
    assert response.json()["usage"]["prompt_tokens"] > 200


def test_text_the_tokenizer_drops_takes_no_room(server: ServerProcess) -> None:
    """SmolLM2 drops 0x16: twice the bytes that fit of it, and a question, fit the context."""
    content = "\x16" * (2 * 8192 * 81) + "Name three colours."
    response = requests.post(
        f"{server.url}{CHAT}",
        json={"messages": [{"role": "user", "content": content}], "max_tokens": 2},
        timeout=60,
    )
    assert response.status_code == 200, response.text[:300]
    assert response.json()["usage"]["prompt_tokens"] < 100
