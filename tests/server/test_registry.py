"""The document registry survives a restart when the server has a disk tier.

Unit checks of the file (round trip, damaged, foreign, malformed entries), then real
servers on one directory: upload, stop, start again: the document is listed, becomes
ready, and a question on it finds its blocks cached; a damaged file never stops start-up.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import requests

from ragserve.server.document_store import DocumentStore, StoredDocument
from tests.server.server_fixtures import BLOCK_SIZE, running_server, wait_ready

KEY = "sk-registry-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
DOC = " ".join(f"Clause {i}: the tenant returns the keys on the last day of the lease." for i in range(24))
FP = "ab" * 32


def stored(doc_id: str = "0" * 32, namespace: str = "") -> StoredDocument:
    return StoredDocument(doc_id, namespace, [5, 6, 7], {"title": "t", "n": 1.5}, 1700000000)


# -- the file ------------------------------------------------------------------------------
def test_round_trip_and_atomic_replace(tmp_path: Path) -> None:
    store = DocumentStore(tmp_path, FP)
    assert store.load() == []  # no file yet
    docs = [stored("1" * 32, "tenant-a"), stored("2" * 32)]
    store.save(docs)
    assert store.load() == docs
    store.save(docs[:1])
    assert store.load() == docs[:1]
    assert [p.name for p in tmp_path.iterdir()] == [store.path.name]  # no temp files left
    assert DocumentStore(tmp_path, "cd" * 32).load() == []  # another model: its own file


def test_damaged_or_foreign_files_are_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = DocumentStore(tmp_path, FP)
    store.save([stored()])
    good = store.path.read_bytes()
    payload = json.loads(good)
    cases = {
        "truncated": good[: len(good) // 2],
        "binary": b"\x00\xff" * 40,
        "foreign": json.dumps({"format": "something else"}).encode(),
        "other model": json.dumps({**payload, "model": "cd" * 32}).encode(),
        "new version": json.dumps({**payload, "version": 99}).encode(),
        "edited": good.replace(b"[5,6,7]", b"[5,6,8]"),  # valid JSON, checksum fails
    }
    for name, raw in cases.items():
        store.path.write_bytes(raw)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert store.load() == [], name
        assert "ignored" in caplog.text, name


def test_malformed_entries_are_skipped_one_by_one(tmp_path: Path) -> None:
    store = DocumentStore(tmp_path, FP)
    good = stored().to_json()
    entries = [
        good,
        {**good, "id": "not-hex"},
        {**good, "token_ids": [1, -2]},
        {**good, "token_ids": []},
        {**good, "metadata": []},
        "a string",
    ]
    # NOTE: written through save()'s own checksum, so only the entries are at fault.
    from ragserve.server.document_store import FORMAT, VERSION, _checksum

    body = {"format": FORMAT, "version": VERSION, "model": FP, "checksum": _checksum(entries)}
    store.path.write_text(json.dumps({**body, "documents": entries}))
    assert store.load() == [stored()]


# -- real servers --------------------------------------------------------------------------
def question(url: str, doc_id: str) -> dict[str, object]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Who returns the keys?"}],
        "documents": [doc_id],
        "max_tokens": 2,
    }
    response = requests.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    usage: dict[str, object] = response.json()["usage"]
    return usage


@pytest.mark.e2e
def test_documents_survive_a_restart(tmp_path: Path) -> None:
    tier = ("--kv-disk-gib", "0.1", "--kv-disk-dir", str(tmp_path / "kv"), "--api-key", KEY)
    with running_server(*tier, log_path=tmp_path / "first.log") as first:
        upload = requests.post(
            f"{first.url}/v1/documents",
            json={"text": DOC, "metadata": {"title": "lease"}},
            headers=AUTH,
            timeout=60,
        )
        assert upload.status_code == 202, upload.text
        doc = wait_ready(first.url, upload.json()["id"], AUTH)
        assert doc["status"] == "ready"
    registry = list((tmp_path / "kv").glob("documents-*.json"))
    assert len(registry) == 1

    with running_server(*tier, log_path=tmp_path / "second.log") as second:
        listed = requests.get(f"{second.url}/v1/documents", headers=AUTH, timeout=30).json()
        assert [d["id"] for d in listed["data"]] == [doc["id"]]
        again = wait_ready(second.url, doc["id"], AUTH)
        assert again["status"] == "ready"
        for field in ("tokens", "prefix_tokens", "created", "metadata"):
            assert again[field] == doc[field], field
        full_blocks = int(doc["tokens"]) // BLOCK_SIZE * BLOCK_SIZE
        details = question(second.url, doc["id"])["prompt_tokens_details"]
        assert isinstance(details, dict) and details["cached_tokens"] >= full_blocks
        metrics = second.metrics()
        # Re-ingestion read the blocks back from disk instead of computing them.
        assert metrics['ragserve_kv_tier_hits_total{tier="disk"}'] >= full_blocks // BLOCK_SIZE - 2
        assert "1 documents restored" in second.log()
        # A delete is saved too: a third start has nothing to restore.
        gone = requests.delete(f"{second.url}/v1/documents/{doc['id']}", headers=AUTH, timeout=30)
        assert gone.status_code == 200
    saved = json.loads(registry[0].read_text())
    assert saved["documents"] == []

    # Damaged: start-up logs it, serves, and the next upload writes a good file again.
    registry[0].write_bytes(b'{"format": "ragserve-documents", "docu')
    with running_server(*tier, log_path=tmp_path / "third.log") as third:
        assert requests.get(f"{third.url}/health", timeout=30).status_code == 200
        listed = requests.get(f"{third.url}/v1/documents", headers=AUTH, timeout=30).json()
        assert listed["data"] == []
        assert "ignored: not valid JSON" in third.log()
        upload = requests.post(f"{third.url}/v1/documents", json={"text": DOC}, headers=AUTH, timeout=60)
        assert upload.status_code == 202
    assert [d["id"] for d in json.loads(registry[0].read_text())["documents"]] == [doc["id"]]
