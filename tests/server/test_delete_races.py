"""A DELETE and an upload of the same text sent at once, several times over. Whichever
wins, the server and its registry agree afterwards: a document that is listed has its
row and answers from its full cached prefix (a DELETE still running must not purge the
blocks of a re-upload, nor delete its row); one that is not listed has no row.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.server.server_fixtures import BLOCK_SIZE, cached_tokens, running_server, wait_ready
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
