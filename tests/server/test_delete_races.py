"""A DELETE and an upload of the same text sent at once, several times over. Whichever
wins, the server and its registry agree afterwards: a document that is listed has its
row and answers from its full cached prefix (a DELETE still running must not purge the
blocks of a re-upload, nor delete its row); one that is not listed has no row. A DELETE
whose client leaves before the answer still deletes the row, so a restart does not bring
the document back.
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

from tests.server.server_fixtures import (
    BLOCK_SIZE,
    cached_tokens,
    running_server,
    wait_for,
    wait_ready,
)
from tests.server.test_document_purge import stored_tokens, text

pytestmark = pytest.mark.e2e

KEY = "sk-delete-races"
AUTH = {"Authorization": f"Bearer {KEY}"}
ROUNDS = 6


def upload(url: str, body: str) -> requests.Response:
    return requests.post(f"{url}/v1/documents", json={"text": body}, headers=AUTH, timeout=60)


def delete(url: str, doc_id: str) -> int:
    return requests.delete(f"{url}/v1/documents/{doc_id}", headers=AUTH, timeout=60).status_code


def test_delete_and_reupload_at_once_leave_one_consistent_document(tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    body = text("cobalt", 16)
    with running_server(
        "--kv-disk-dir", str(kv), "--api-key", KEY, log_path=tmp_path / "s.log"
    ) as server:
        first = upload(server.url, body)
        assert first.status_code == 202, first.text
        doc_id = first.json()["id"]
        full = first.json()["prefix_tokens"] // BLOCK_SIZE * BLOCK_SIZE
        for _ in range(ROUNDS):
            assert wait_ready(server.url, doc_id, AUTH)["status"] == "ready"
            with ThreadPoolExecutor(2) as pool:
                gone = pool.submit(delete, server.url, doc_id)
                time.sleep(0.002)  # NOTE: most often the DELETE arrives first
                again = pool.submit(upload, server.url, body)
                assert gone.result() == 200 and again.result().status_code in (200, 202)
            state = requests.get(f"{server.url}/v1/documents/{doc_id}", headers=AUTH, timeout=30)
            if state.status_code == 404:  # the upload came first
                assert doc_id not in stored_tokens(kv)
                assert upload(server.url, body).status_code == 202
                continue
            assert doc_id in stored_tokens(kv)
            assert wait_ready(server.url, doc_id, AUTH)["status"] == "ready"
            assert cached_tokens(server.url, doc_id, AUTH) >= full


def delete_and_leave(url: str, doc_id: str) -> None:
    """Send a DELETE and close the connection without reading the answer."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as conn:
        conn.sendall(
            f"DELETE /v1/documents/{doc_id} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: 0\r\n\r\n".encode()
        )


def test_a_delete_whose_client_leaves_still_deletes_for_good(tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    args = ("--kv-disk-dir", str(kv), "--api-key", KEY)
    doc_ids = []
    with running_server(*args, log_path=tmp_path / "first.log") as server:
        for round_ in range(ROUNDS):
            response = upload(server.url, text(f"quartz {round_}", 8))
            assert response.status_code == 202, response.text
            doc_id = response.json()["id"]
            assert wait_ready(server.url, doc_id, AUTH)["status"] == "ready"
            delete_and_leave(server.url, doc_id)

            def gone(doc_id: str = doc_id) -> bool:
                return doc_id not in stored_tokens(kv)

            assert wait_for(gone, 30, interval=0.1), f"round {round_}: the row stayed"
            state = requests.get(f"{server.url}/v1/documents/{doc_id}", headers=AUTH, timeout=30)
            assert state.status_code == 404
            doc_ids.append(doc_id)
    with running_server(*args, log_path=tmp_path / "second.log") as server:
        for doc_id in doc_ids:
            state = requests.get(f"{server.url}/v1/documents/{doc_id}", headers=AUTH, timeout=30)
            assert state.status_code == 404, state.text
