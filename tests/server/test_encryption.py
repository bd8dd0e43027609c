"""Encryption at rest on a real server: the KV directory's bytes reveal none of a
document's token ids, and a restart under the wrong key recomputes: same answers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import requests

from tests.server.server_fixtures import running_server, wait_ready
from tests.server.test_document_purge import files_holding, grams, needles, stored_tokens

pytestmark = pytest.mark.e2e

KEY = "sk-encryption-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXT = " ".join(
    f"Vault {i} opens with dial {(i * 53) % 97} then {(i * 17) % 89}." for i in range(30)
)


def serve(kv: Path, log: Path, key_file: Path | None) -> Any:
    args = ["--kv-disk-gib", "0.2", "--kv-disk-dir", str(kv), "--api-key", KEY]
    if key_file is not None:
        args += ["--kv-encryption-key-file", str(key_file)]
    return running_server(*args, log_path=log)


def answer(url: str, doc_id: str) -> tuple[str, int]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "How does vault 4 open?"}],
        "documents": [doc_id],
        "max_tokens": 8,
        "temperature": 0,
    }
    response = requests.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    data = response.json()
    return data["choices"][0]["message"]["content"], data["usage"]["prompt_tokens_details"][
        "cached_tokens"
    ]


def upload(url: str) -> str:
    response = requests.post(f"{url}/v1/documents", json={"text": TEXT}, headers=AUTH, timeout=60)
    assert response.status_code in (200, 202), response.text
    doc_id = str(response.json()["id"])
    assert wait_ready(url, doc_id, AUTH)["status"] == "ready"
    return doc_id


def test_encrypted_records_and_a_wrong_key(tmp_path: Path) -> None:
    key, wrong = tmp_path / "key", tmp_path / "wrong"
    key.write_bytes(b"a" * 40)
    wrong.write_bytes(b"b" * 40)
    with serve(tmp_path / "plain", tmp_path / "plain.log", None) as plain:
        doc_id = upload(plain.url)
        expected, _ = answer(plain.url, doc_id)
    tokens = stored_tokens(tmp_path / "plain")[doc_id]
    patterns = needles(grams(tokens[8:-8]))
    assert files_holding(tmp_path / "plain", patterns)  # the scan finds plain records

    kv = tmp_path / "sealed"
    with serve(kv, tmp_path / "sealed.log", key) as sealed:
        assert upload(sealed.url) == doc_id
        assert answer(sealed.url, doc_id)[0] == expected
    assert files_holding(kv, patterns) == []

    with serve(kv, tmp_path / "wrong.log", wrong) as other:
        listed = requests.get(f"{other.url}/v1/documents", headers=AUTH, timeout=30).json()["data"]
        assert listed == []  # its row is sealed under the other key: kept, not served
        assert upload(other.url) == doc_id  # recomputed: every record misses
        text, _ = answer(other.url, doc_id)
        assert text == expected
        assert 'ragserve_kv_tier_hits_total{tier="disk"}' in other.metrics()
        assert other.metrics()['ragserve_kv_tier_hits_total{tier="disk"}'] == 0
