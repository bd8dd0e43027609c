"""Two real servers sharing a document registry (``--registry-dir``) and a remote KV tier
(a real valkey-server), as the replicas of a cluster do: a document uploaded to one is
answered by the other at once, from the store's blocks, and listed there within seconds;
a delete on one is seen by the other."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.server.server_fixtures import BLOCK_SIZE, running_server, wait_for, wait_ready
from tests.valkey_server import ValkeyServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KEY = "sk-shared-registry"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ValkeyServer]:
    server = ValkeyServer(tmp_path / "store")
    (tmp_path / "store").mkdir()
    server.start()
    yield server
    server.stop()


def ask(url: str, doc_id: str) -> dict[str, Any]:
    body = {
        "messages": [{"role": "user", "content": "Which entry reads 40?"}],
        "documents": [doc_id],
        "max_tokens": 1,
        "temperature": 0,
    }
    response = requests.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    return dict(response.json()["usage"])


def listed(url: str) -> set[str]:
    response = requests.get(f"{url}/v1/documents", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    return {doc["id"] for doc in response.json()["data"]}


def test_a_document_uploaded_to_one_server_is_answered_by_the_other_from_the_store(
    tmp_path: Path, store: ValkeyServer
) -> None:
    shared = ("--registry-dir", str(tmp_path / "registry"), "--kv-remote-url", store.url)
    flags = (*shared, "--api-key", KEY)
    with (
        running_server(*flags, log_path=tmp_path / "one.log") as one,
        running_server(*flags, log_path=tmp_path / "two.log") as two,
    ):
        body = " ".join(f"In the harbour ledger, entry {i} reads {i * 7 % 97}." for i in range(40))
        uploaded = requests.post(
            f"{one.url}/v1/documents", json={"text": body}, headers=AUTH, timeout=120
        )
        assert uploaded.status_code == 202, uploaded.text
        doc = uploaded.json()
        wait_ready(one.url, doc["id"], AUTH)
        # The other server never saw the upload: it learns the document from the registry
        # at this question and reads its blocks from the store.
        usage = ask(two.url, doc["id"])
        full = doc["prefix_tokens"] // BLOCK_SIZE * BLOCK_SIZE
        assert usage["ragserve_cache"]["cached_tokens_by_tier"].get("remote", 0) >= full // 2
        assert doc["id"] in listed(two.url)
        other = requests.post(
            f"{two.url}/v1/documents", json={"text": body + " Addendum."}, headers=AUTH, timeout=120
        )
        assert other.status_code == 202, other.text
        assert wait_for(lambda: other.json()["id"] in listed(one.url), 30, interval=0.2)
        deleted = requests.delete(f"{two.url}/v1/documents/{doc['id']}", headers=AUTH, timeout=60)
        assert deleted.status_code == 200, deleted.text
        assert wait_for(lambda: doc["id"] not in listed(one.url), 30, interval=0.2)
