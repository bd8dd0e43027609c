"""DELETE and expiry purge a document's KV from every tier of a real server with a disk tier.

After the DELETE returns no file under the KV directory holds the document's token ids
(every file's bytes are scanned for them as the records and the registry encode them),
while a document of the same tenant that shared blocks with it still answers from cache.
Everything the server created under the KV directory is private (0600/0700).
"""

from __future__ import annotations

import sqlite3
import stat
import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest
import requests

from ragserve.server.document_store import FILENAME
from tests.server.server_fixtures import BLOCK_SIZE, running_server, wait_for, wait_ready

pytestmark = pytest.mark.e2e

KEY = "sk-purge-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
GRAM = 4  # token windows this long are searched for


def text(topic: str, count: int = 30) -> str:
    return " ".join(
        f"The {topic} archive lists shelf {i} under code {(i * 31 + len(topic)) % 89}."
        for i in range(count)
    )


def stored_tokens(kv: Path) -> dict[str, list[int]]:
    db = sqlite3.connect(kv / FILENAME)
    try:
        rows = db.execute("SELECT id, token_ids FROM documents").fetchall()
    finally:
        db.close()
    return {doc_id: list(struct.unpack(f"<{len(blob) // 4}I", blob)) for doc_id, blob in rows}


def grams(tokens: list[int]) -> set[tuple[int, ...]]:
    return {tuple(tokens[i : i + GRAM]) for i in range(len(tokens) - GRAM + 1)}


def needles(windows: set[tuple[int, ...]]) -> list[bytes]:
    """How a file could hold these windows: msgpack ints (record headers), uint32 (registry)."""
    found = []
    for window in windows:
        found.append(b"".join(msgpack.packb(t) for t in window))
        found.append(struct.pack(f"<{GRAM}I", *window))
    return found


def files_holding(root: Path, patterns: list[bytes]) -> list[str]:
    hits = []
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            hits += [f"{path.name}" for needle in patterns if needle in data][:1]
    return hits


def ask(url: str, doc_id: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Which code has shelf 7?"}],
        "documents": [doc_id],
        "max_tokens": 3,
        "temperature": 0,
    }
    response = requests.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_delete_purges_the_document_from_every_file(tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    args = (
        "--kv-cpu-gib",
        "0.05",
        "--kv-disk-gib",
        "0.2",
        "--kv-disk-dir",
        str(kv),
        "--api-key",
        KEY,
    )
    with running_server(*args, log_path=tmp_path / "server.log") as server:
        gone, kept = (
            requests.post(
                f"{server.url}/v1/documents", json={"text": text(t)}, headers=AUTH, timeout=60
            ).json()
            for t in ("granite", "marble")
        )
        for doc in (gone, kept):
            assert wait_ready(server.url, doc["id"], AUTH)["status"] == "ready"
        ask(server.url, gone["id"])  # a question's blocks hang off the document's chain
        tokens = stored_tokens(kv)
        own = grams(tokens[gone["id"]]) - grams(tokens[kept["id"]])
        patterns = needles(own)
        assert files_holding(kv, patterns), "the scan finds the document before the DELETE"
        before = server.metrics()['ragserve_kv_tier_blocks{tier="disk"}']

        deleted = requests.delete(
            f"{server.url}/v1/documents/{gone['id']}", headers=AUTH, timeout=60
        )
        assert deleted.status_code == 200
        assert files_holding(kv, patterns) == []
        after = server.metrics()['ragserve_kv_tier_blocks{tier="disk"}']
        assert after <= before - (gone["prefix_tokens"] // BLOCK_SIZE - 2)

        # The other document still answers from its cached blocks, shared first block included.
        usage = ask(server.url, kept["id"])["usage"]
        full = kept["prefix_tokens"] // BLOCK_SIZE * BLOCK_SIZE
        assert usage["prompt_tokens_details"]["cached_tokens"] >= full
        assert "KV purged" in server.log()

        # Expiry purges the same way.
        brief = requests.post(
            f"{server.url}/v1/documents",
            json={"text": text("basalt"), "ttl": 4},
            headers=AUTH,
            timeout=60,
        ).json()
        brief_tokens = stored_tokens(kv)[
            brief["id"]
        ]  # its row is written before the upload returns
        wait_ready(server.url, brief["id"], AUTH, timeout=60)
        brief_patterns = needles(grams(brief_tokens) - grams(tokens[kept["id"]]))
        assert wait_for(lambda: "expired and was deleted" in server.log(), 30)
        assert files_holding(kv, brief_patterns) == []

    for path in [kv, *kv.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
