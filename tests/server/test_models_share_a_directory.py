"""Two servers of different models (the embedded weights and random weights of the same
shape: other fingerprints, one tokenizer) running at once on one KV directory.

The second one's start copies the first one's documents: both list them and answer, the
first keeps its rows and its KV records. A DELETE on the second removes the document's
rows for both models and both models' KV records (no file holds its token ids), and the
first server forgets it too; the other document stays with both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import requests

from tests.server.server_fixtures import (
    BLOCK_SIZE,
    cached_tokens,
    running_server,
    wait_for,
    wait_ready,
)
from tests.server.test_document_purge import files_holding, grams, needles, stored_tokens, text
from tests.server.test_model_change import rows_by_model

pytestmark = pytest.mark.e2e

KEY = "sk-shared-directory"
AUTH = {"Authorization": f"Bearer {KEY}"}


def upload(url: str, body: str) -> dict[str, Any]:
    response = requests.post(f"{url}/v1/documents", json={"text": body}, headers=AUTH, timeout=60)
    assert response.status_code == 202, response.text
    return wait_ready(url, response.json()["id"], AUTH)


def listed(url: str) -> set[str]:
    response = requests.get(f"{url}/v1/documents", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    return {doc["id"] for doc in response.json()["data"]}


def test_two_models_share_one_directory(tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    tier = ("--kv-disk-dir", str(kv), "--api-key", KEY)
    with running_server(*tier, log_path=tmp_path / "first.log") as first:
        kept, gone = (upload(first.url, text(topic, 16)) for topic in ("garnet", "quartz"))
        ids = {kept["id"], gone["id"]}
        tokens = stored_tokens(kv)
        own = needles(grams(tokens[gone["id"]]) - grams(tokens[kept["id"]]))
        assert wait_for(lambda: files_holding(kv, own), 60)  # the first model's KV records
        with running_server(
            *tier, "--load-format", "dummy", log_path=tmp_path / "second.log"
        ) as second:
            models = rows_by_model(kv)
            assert len(models) == 2 and all(set(found) == ids for found in models.values())
            assert listed(first.url) == listed(second.url) == ids
            # The start took nothing from the first server: its KV records are all there.
            assert files_holding(kv, own)
            full = kept["prefix_tokens"] // BLOCK_SIZE * BLOCK_SIZE
            assert cached_tokens(first.url, kept["id"], AUTH) >= full
            cached_tokens(second.url, gone["id"], AUTH)  # computes it for the second model

            def pinned() -> bool:
                url = f"{second.url}/v1/documents/{gone['id']}"
                state = requests.get(url, headers=AUTH, timeout=30).json()
                return bool(
                    state["pinned_tokens"] >= gone["prefix_tokens"] // BLOCK_SIZE * BLOCK_SIZE
                )

            assert wait_for(pinned, 120, interval=0.2)
            deleted = requests.delete(
                f"{second.url}/v1/documents/{gone['id']}", headers=AUTH, timeout=60
            )
            assert deleted.status_code == 200, deleted.text
            assert {model: set(found) for model, found in rows_by_model(kv).items()} == {
                model: {kept["id"]} for model in models
            }
            assert files_holding(kv, own) == []  # neither model's KV records hold it
            assert listed(second.url) == {kept["id"]}
            assert wait_for(lambda: listed(first.url) == {kept["id"]}, 30)
            assert files_holding(kv, own) == []
            # Other documents keep their blocks.
            assert cached_tokens(first.url, kept["id"], AUTH) >= full
            cached_tokens(second.url, kept["id"], AUTH)  # and still answers on the second
