"""A restart on the same KV directory with another model (random weights of the same shape:
another fingerprint, the same tokenizer). The documents of the first model are still
listed and answer; the first question computes the KV again and says why in
``usage.ragserve_cache``; later ones hit the cache. Rows are copied to the new model (the
old model's row and KV records stay: a server of it may share the directory), and a
DELETE removes the document's row for every model and the KV records of both models (no
file holds the document's token ids).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import requests

from ragserve.server.document_store import FILENAME
from tests.server.server_fixtures import BLOCK_SIZE, running_server, wait_for, wait_ready
from tests.server.test_document_purge import files_holding, grams, needles, stored_tokens

pytestmark = pytest.mark.e2e

KEY = "sk-model-change"
AUTH = {"Authorization": f"Bearer {KEY}"}
DOC = " ".join(f"Locker {i} opens with combination {(i * 53) % 97}." for i in range(30))


def ask(url: str, doc_id: str, stream: bool = False) -> dict[str, Any]:
    """The answer's usage; streamed, the usage of its last chunk."""
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Which locker has combination 12?"}],
        "documents": [doc_id],
        "max_tokens": 2,
        "temperature": 0,
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    response = requests.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    if not stream:
        return dict(response.json()["usage"])
    events = [line[len("data: ") :] for line in response.text.splitlines() if line]
    assert events[-1] == "[DONE]"
    return dict(json.loads(events[-2])["usage"])


def rows_by_model(kv: Path) -> dict[str, list[str]]:
    db = sqlite3.connect(kv / FILENAME)
    try:
        rows = db.execute("SELECT model, id FROM documents ORDER BY row").fetchall()
    finally:
        db.close()
    models: dict[str, list[str]] = {}
    for model, doc_id in rows:
        models.setdefault(model, []).append(doc_id)
    return models


def test_documents_follow_a_model_change(tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    tier = ("--kv-disk-dir", str(kv), "--api-key", KEY)
    with running_server(*tier, log_path=tmp_path / "first.log") as first:
        upload = requests.post(
            f"{first.url}/v1/documents",
            json={"text": DOC, "metadata": {"room": "gym"}},
            headers=AUTH,
            timeout=60,
        )
        assert upload.status_code == 202, upload.text
        doc = wait_ready(first.url, upload.json()["id"], AUTH)
        assert doc["status"] == "ready"
    (first_model,) = rows_by_model(kv)
    own = needles(grams(stored_tokens(kv)[doc["id"]]))
    old_records = [path for path in kv.iterdir() if path.is_dir()]
    assert any(files_holding(path, own) for path in old_records)  # the scan finds them

    # Random weights of the same shape: another fingerprint, the same (embedded) tokenizer.
    with running_server(
        *tier, "--load-format", "dummy", log_path=tmp_path / "second.log"
    ) as second:
        listed = requests.get(f"{second.url}/v1/documents", headers=AUTH, timeout=30).json()
        assert [d["id"] for d in listed["data"]] == [doc["id"]]
        state = requests.get(f"{second.url}/v1/documents/{doc['id']}", headers=AUTH, timeout=30)
        assert state.status_code == 200, state.text
        for field in ("tokens", "prefix_tokens", "created", "metadata"):
            assert state.json()[field] == doc[field], field
        assert state.json()["kv_blocks"]["device"] == 0  # nothing computed before first use
        models = rows_by_model(kv)
        assert set(models) - {first_model} and all(ids == [doc["id"]] for ids in models.values())
        assert len(models) == 2  # copied: the first model keeps its row

        full = doc["prefix_tokens"] // BLOCK_SIZE * BLOCK_SIZE
        first_use = ask(second.url, doc["id"], stream=True)  # streamed: the same notes
        (note,) = first_use["ragserve_cache"]["documents"]
        assert note["reason"] == "different_model" and note["cached_tokens"] < full, note
        assert note["id"] == doc["id"] and note["prefix_tokens"] == full

        def pinned() -> bool:
            state = requests.get(f"{second.url}/v1/documents/{doc['id']}", headers=AUTH, timeout=30)
            return bool(state.json()["pinned_tokens"] >= full)

        assert wait_for(pinned, 120, interval=0.2)  # recomputed and pinned for this model
        again = ask(second.url, doc["id"])
        assert again["prompt_tokens_details"]["cached_tokens"] >= full
        assert again["ragserve_cache"]["documents"] == []
        assert "taken over" in second.log()
        assert any(files_holding(path, own) for path in old_records)  # the old KV stays

        deleted = requests.delete(
            f"{second.url}/v1/documents/{doc['id']}", headers=AUTH, timeout=30
        )
        assert deleted.status_code == 200, deleted.text
        assert rows_by_model(kv) == {}
        assert files_holding(kv, own) == []  # both models' KV records, and the rows
