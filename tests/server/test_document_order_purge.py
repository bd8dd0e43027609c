"""DELETE purges a document from prompts that named it after other documents.

A prompt naming ``[A, B]`` holds B's tokens in blocks that follow A's chain, not B's own.
After B's DELETE no KV place holds them: no file under the KV directory holds B's token
ids, and a prompt of exactly ``head + A + B`` (sent as token ids, so the lookup goes
through the device cache and every tier) finds only blocks of the live documents'
prefixes cached, for the orders ``[A, B]``, ``[B, A]`` and ``[A, C, B]``. A still answers
from cache. A small device cache and CPU tier push question blocks down to disk. The
two-document orders are purged after a restart too, which forgets the recorded orders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import requests

from ragserve.server.prompts import PromptBuilder
from tests.server.server_fixtures import BLOCK_SIZE, ServerProcess, running_server, wait_ready
from tests.server.test_document_purge import files_holding, grams, needles, stored_tokens, text

pytestmark = pytest.mark.e2e

KEY = "sk-order-purge-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


def upload(url: str, topic: str) -> dict[str, Any]:
    response = requests.post(
        f"{url}/v1/documents", json={"text": text(topic)}, headers=AUTH, timeout=60
    )
    assert response.status_code in (200, 202), response.text
    return wait_ready(url, response.json()["id"], AUTH)


def cached(url: str, body: dict[str, Any]) -> int:
    body = {**body, "max_tokens": 1, "temperature": 0}
    response = requests.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def common_blocks(prompt: list[int], kept: list[list[int]]) -> int:
    """Tokens of ``prompt``'s leading full blocks that some kept sequence also starts with."""
    longest = 0
    for other in kept:
        same = next(
            (i for i, (x, y) in enumerate(zip(prompt, other, strict=False)) if x != y), None
        )
        longest = max(longest, min(len(prompt), len(other)) if same is None else same)
    return longest // BLOCK_SIZE * BLOCK_SIZE


def tier_args(kv: Path) -> tuple[str, ...]:
    return (
        "--kv-cache-gib", "0.07",
        "--kv-cpu-gib", "0.01",
        "--kv-disk-gib", "0.2",
        "--kv-disk-dir", str(kv),
        "--api-key", KEY,
    )  # fmt: skip


def ask(server: ServerProcess, docs: list[dict[str, Any]]) -> None:
    body = {"prompt": "Which code has shelf 7?", "documents": [doc["id"] for doc in docs]}
    cached(server.url, body)


def prompts_on_disk(kv: Path, patterns: list[bytes], doc: dict[str, Any]) -> bool:
    """Whether more files hold the document's windows than its own blocks and its registry
    row: blocks of prompts naming it reached the disk tier."""
    return len(files_holding(kv, patterns)) > doc["prefix_tokens"] // BLOCK_SIZE + 1


def test_delete_purges_the_document_after_other_documents(
    tmp_path: Path, smollm_tokenizer: Any
) -> None:
    head = PromptBuilder(smollm_tokenizer).head_ids
    kv = tmp_path / "kv"
    with running_server(*tier_args(kv), log_path=tmp_path / "server.log") as server:
        a, b, c = (upload(server.url, topic) for topic in ("granite", "marble", "basalt"))
        assert {a["status"], b["status"], c["status"]} == {"ready"}
        for docs in ([a, b], [b, a], [a, c, b]):
            ask(server, docs)
        tokens = stored_tokens(kv)
        ta, tb, tc = (tokens[d["id"]] for d in (a, b, c))
        patterns = needles(grams(tb) - grams(ta) - grams(tc))
        assert prompts_on_disk(kv, patterns, b)

        deleted = requests.delete(f"{server.url}/v1/documents/{b['id']}", headers=AUTH, timeout=60)
        assert deleted.status_code == 200
        assert files_holding(kv, patterns) == []

        kept = [head + ta, head + tc, head + ta + tc]
        for docs in ([ta, tb], [tb, ta], [ta, tc, tb]):
            prompt = head + [t for doc in docs for t in doc] + ta[:20]
            assert cached(server.url, {"prompt": prompt}) <= common_blocks(prompt, kept)

        # A still answers from its cached (pinned) blocks.
        full = a["prefix_tokens"] // BLOCK_SIZE * BLOCK_SIZE
        assert cached(server.url, {"prompt": "Shelf 7?", "documents": [a["id"]]}) >= full


def test_delete_after_a_restart_purges_the_document_after_another(tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    with running_server(*tier_args(kv), log_path=tmp_path / "first.log") as server:
        a, b = upload(server.url, "granite"), upload(server.url, "marble")
        c = upload(server.url, "basalt")
        for docs in ([a, b], [b, a], [c, a], [a, c]):  # the last two push the first down
            ask(server, docs)
        tokens = stored_tokens(kv)
        ta, tb = tokens[a["id"]], tokens[b["id"]]
        patterns = needles(grams(tb) - grams(ta) - grams(tokens[c["id"]]))
        assert prompts_on_disk(kv, patterns, b)

    with running_server(*tier_args(kv), log_path=tmp_path / "second.log") as server:
        assert wait_ready(server.url, a["id"], AUTH)["status"] == "ready"
        deleted = requests.delete(f"{server.url}/v1/documents/{b['id']}", headers=AUTH, timeout=60)
        assert deleted.status_code == 200
        assert files_holding(kv, patterns) == []
        full = a["prefix_tokens"] // BLOCK_SIZE * BLOCK_SIZE
        assert cached(server.url, {"prompt": "Shelf 7?", "documents": [a["id"]]}) >= full
