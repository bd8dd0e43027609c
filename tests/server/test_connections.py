"""Connection limits against a real ``ragserve serve``: slow heads and idle connections are
closed and their file handles released while normal requests go on, slow bodies get 408,
a stalled stream reader is cut and its engine request aborted, connections beyond the cap
get 503, and errors aiohttp's parser answers are OpenAI-shaped.

The server's timeouts are short (2 s) so that each limit is cheap to reach; the margins
allow for a loaded two-core machine.
"""

from __future__ import annotations

import json
import os
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import pytest
import requests

from tests.server.server_fixtures import ServerProcess, assert_error, module_server, wait_for

pytestmark = pytest.mark.e2e

TIMEOUT_S = 2.0
MAX_CONNECTIONS = 300
SLOW_HEADS, IDLE = 200, 20
# Time a timeout may take to act beyond its setting on a busy machine.
MARGIN_S = 8.0
server = module_server(
    "--keepalive-timeout", str(TIMEOUT_S),
    "--body-timeout", str(TIMEOUT_S),
    "--write-timeout", str(TIMEOUT_S),
    "--write-buffer-bytes", "4096",
    "--max-connections", str(MAX_CONNECTIONS),
    "--max-model-len", "2048",
)  # fmt: skip
CHAT = "/v1/chat/completions"
HI = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}


def address(server: ServerProcess) -> tuple[str, int]:
    parts = urlsplit(server.url)
    return parts.hostname or "", parts.port or 80


def open_files(server: ServerProcess) -> int:
    return len(os.listdir(f"/proc/{server.pid}/fd"))


def metric(server: ServerProcess, name: str) -> float:
    return server.metrics().get(name, 0.0)


def idle(server: ServerProcess) -> bool:
    return (
        metric(server, "ragserve_num_requests_active") == 0
        and metric(server, 'ragserve_kv_blocks{state="used"}') == 0
    )


def read_response(sock: socket.socket, timeout: float = 30.0) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def parse_response(raw: bytes) -> tuple[int, dict[str, str], Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def assert_raw_error(raw: bytes, status: int, code: str) -> dict[str, Any]:
    got, headers, body = parse_response(raw)
    assert got == status, raw[:300]
    assert headers["Content-Type"].startswith("application/json"), headers
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    return dict(error)


class Clients:
    """Raw connections that never finish a request head (``head``) or send nothing at all."""

    def __init__(self, server: ServerProcess, count: int, head: bool) -> None:
        self.head = head
        # Each connection's own start: past the listen backlog a connect waits for a SYN
        # retry (a second or more), so the first ones open well before the last.
        self.socks: list[socket.socket] = []
        self.opened: list[float] = []
        for _ in range(count):
            self.socks.append(socket.create_connection(address(server), timeout=30))
            self.opened.append(time.monotonic())
        self.closed_after: dict[int, float] = {}
        for sock in self.socks:
            sock.setblocking(False)
            if head:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")

    def poll(self) -> None:
        """Note the ones the server closed; send one more header byte on the others."""
        now = time.monotonic()
        open_ = [i for i in range(len(self.socks)) if i not in self.closed_after]
        readable, _, _ = select.select([self.socks[i] for i in open_], [], [], 0)
        for i in open_:
            sock = self.socks[i]
            try:
                if sock in readable and not sock.recv(4096):
                    self.closed_after[i] = now - self.opened[i]
                elif self.head:
                    sock.send(b"a")
            except BlockingIOError:
                pass  # its send buffer is full: still open
            except ConnectionError:
                self.closed_after[i] = now - self.opened[i]

    @property
    def all_closed(self) -> bool:
        return len(self.closed_after) == len(self.socks)

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


@contextmanager
def normal_traffic(server: ServerProcess) -> Iterator[list[int]]:
    """Chat requests one after another until the block ends; yields their statuses."""
    statuses: list[int] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            with requests.Session() as session:
                statuses.append(
                    session.post(f"{server.url}{CHAT}", json=HI, timeout=60).status_code
                )

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        yield statuses
    finally:
        stop.set()
        thread.join()


def settle(server: ServerProcess) -> int:
    """The server's open-file count once no client connection is left."""
    requests.post(f"{server.url}{CHAT}", json=HI, timeout=60).raise_for_status()
    assert wait_for(lambda: idle(server), 30)
    time.sleep(TIMEOUT_S + 1)  # the keep-alive connections above are closed by now
    return open_files(server)


def test_slow_heads_and_idle_connections_are_closed(server: ServerProcess) -> None:
    baseline = settle(server)
    slow = Clients(server, SLOW_HEADS, head=True)
    quiet = Clients(server, IDLE, head=False)
    try:
        assert wait_for(lambda: open_files(server) >= baseline + SLOW_HEADS + IDLE, 10), (
            open_files(server),
            baseline,
        )
        with normal_traffic(server) as statuses:
            deadline = time.monotonic() + TIMEOUT_S + MARGIN_S
            while not (slow.all_closed and quiet.all_closed) and time.monotonic() < deadline:
                slow.poll()
                quiet.poll()
                time.sleep(0.25)
        assert slow.all_closed, f"{len(slow.closed_after)} of {SLOW_HEADS} slow heads closed"
        assert quiet.all_closed, f"{len(quiet.closed_after)} of {IDLE} idle connections closed"
        # Closed by the timeout, not before it; the slow heads kept sending all along.
        assert min([*slow.closed_after.values(), *quiet.closed_after.values()]) >= TIMEOUT_S - 0.5
    finally:
        slow.close()
        quiet.close()
    assert statuses and set(statuses) == {200}, statuses
    assert wait_for(lambda: open_files(server) <= baseline, 15), (open_files(server), baseline)


def test_slow_body_gets_408(server: ServerProcess) -> None:
    with socket.create_connection(address(server), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
            b'{"messages": '
        )
        started = time.monotonic()
        raw = read_response(sock)
    assert_raw_error(raw, 408, "request_timeout")
    # 408 after the body timeout; the connection closes after aiohttp's lingering (10 s).
    assert time.monotonic() - started < TIMEOUT_S + 10 + MARGIN_S


def test_stalled_stream_reader_is_cut_and_its_request_aborted(server: ServerProcess) -> None:
    assert wait_for(lambda: idle(server), 30)
    generated_before = metric(server, "ragserve_generation_tokens_total")
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "Count to a thousand."}],
            "max_tokens": 1500,
            "ignore_eos": True,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 20,  # about 5 KB per event: the buffers fill in a few dozen tokens
        }
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(address(server))
    try:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        assert wait_for(lambda: metric(server, "ragserve_num_requests_active") == 1, 30)
        assert wait_for(lambda: idle(server), 60), server.metrics()  # never read a byte
    finally:
        sock.close()
    generated = metric(server, "ragserve_generation_tokens_total") - generated_before
    assert generated < 1500 / 2, generated  # aborted long before its max_tokens
    assert "read nothing for 2 s" in server.log()


def test_connections_beyond_the_cap_get_503(server: ServerProcess) -> None:
    assert wait_for(lambda: idle(server), 30)
    held = Clients(server, MAX_CONNECTIONS, head=False)
    try:
        with socket.create_connection(address(server), timeout=30) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            raw = read_response(extra)
        _, headers, _ = parse_response(raw)
        assert_raw_error(raw, 503, "overloaded")
        assert headers["Retry-After"] == "1"
    finally:
        held.close()
    assert wait_for(lambda: requests.get(f"{server.url}/health", timeout=10).ok, 15)
    assert requests.post(f"{server.url}{CHAT}", json=HI, timeout=60).status_code == 200


PARSER_ERRORS = {
    "URL over the line limit": b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "header over the line limit": b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: "
    + b"a" * 9000
    + b"\r\n\r\n",
    "too many headers": b"GET / HTTP/1.1\r\n"
    + b"".join(b"X-%d: a\r\n" % i for i in range(200))
    + b"\r\n",
    "bad request line": b"BLAH\r\n\r\n",
    "NUL in a header": b"GET / HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
    "bad chunk size": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
}


@pytest.mark.parametrize("raw", PARSER_ERRORS.values(), ids=PARSER_ERRORS.keys())
def test_parser_errors_are_openai_shaped(server: ServerProcess, raw: bytes) -> None:
    with socket.create_connection(address(server), timeout=30) as sock:
        sock.sendall(raw)
        assert_raw_error(read_response(sock), 400, "invalid_http_request")


def _multipart(disposition: bytes, content_type: bytes = b"text/plain") -> bytes:
    return (
        b"--b\r\nContent-Disposition: " + disposition + b"\r\nContent-Type: " + content_type
        + b"\r\n\r\nhello\r\n--b--\r\n"
    )  # fmt: skip


MULTIPART_NULS = {
    "in the filename": _multipart(b'form-data; name="file"; filename="a\x00b.txt"'),
    "in the field name": _multipart(b'form-data; name="fi\x00le"; filename="a.txt"'),
    "in a part header": _multipart(b'form-data; name="file"; filename="a.txt"', b"text/pl\x00ain"),
    "in an encoded filename": _multipart(b"form-data; name=\"file\"; filename*=UTF-8''a%00b.txt"),
}


@pytest.mark.parametrize("body", MULTIPART_NULS.values(), ids=MULTIPART_NULS.keys())
def test_nul_in_multipart_headers_is_a_400(server: ServerProcess, body: bytes) -> None:
    response = requests.post(
        f"{server.url}/v1/documents",
        data=body,
        headers={"Content-Type": "multipart/form-data; boundary=b"},
        timeout=30,
    )
    assert_error(response, 400)


def test_unknown_routes_and_methods_are_openai_shaped(server: ServerProcess) -> None:
    assert_error(requests.get(f"{server.url}/v2/nothing", timeout=10), 404)
    assert_error(requests.delete(f"{server.url}{CHAT}", timeout=10), 405)
    assert "Traceback" not in server.log()
