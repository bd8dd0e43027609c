"""A DELETE while questions on the document are still in the engine: one generating, one
waiting for a slot (the server runs one sequence at a time). Both are still running when
the DELETE returns (the generating one asks for far more tokens than the test waits for,
and is then closed by the client, which aborts it); the waiting one then runs to its end.
None of their blocks may be cached, demoted or written afterwards.

Checked from outside: no file under the KV directory holds the document's token ids, the
device cache and the tiers hold no more blocks than before the upload, and uploading the
same text again computes its whole prefix (nothing of it is found in any tier).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.server.server_fixtures import (
    BLOCK_SIZE,
    ServerProcess,
    running_server,
    wait_for,
    wait_ready,
)
from tests.server.test_document_purge import files_holding, grams, needles, stored_tokens, text

pytestmark = pytest.mark.e2e

KEY = "sk-purge-in-flight"
AUTH = {"Authorization": f"Bearer {KEY}"}
CACHED = 'ragserve_kv_blocks{state="cached"}'
TIERS = ('ragserve_kv_tier_blocks{tier="cpu"}', 'ragserve_kv_tier_blocks{tier="disk"}')
COMPUTED = "ragserve_prompt_tokens_computed_total"


class Question(threading.Thread):
    """A streamed chat completion on one document; ``started`` is set at its first chunk.
    ``close``: the client hangs up at its next chunk (the server aborts the request)."""

    def __init__(self, url: str, doc_id: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.doc_id, self.max_tokens = url, doc_id, max_tokens
        self.started = threading.Event()
        self.close = threading.Event()
        self.finish_reason: str | None = None
        self.error: str | None = None

    def run(self) -> None:
        body: dict[str, Any] = {
            "messages": [{"role": "user", "content": "Recite every shelf code."}],
            "documents": [self.doc_id],
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        try:
            with requests.post(
                f"{self.url}/v1/chat/completions", json=body, headers=AUTH, stream=True, timeout=600
            ) as response:
                if response.status_code != 200:
                    self.error = f"{response.status_code}: {response.text[:300]}"
                    return
                for line in response.iter_lines():
                    if self.close.is_set():
                        return
                    if not line.startswith(b"data: {"):
                        continue
                    self.started.set()
                    chunk = json.loads(line[len(b"data: ") :])
                    if "error" in chunk:
                        self.error = str(chunk["error"])
                    for choice in chunk.get("choices", ()):
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        except requests.RequestException as exc:
            self.error = repr(exc)
        finally:
            self.started.set()


def blocks_held(server: ServerProcess) -> tuple[float, ...]:
    metrics = server.metrics()
    return (metrics[CACHED], *(metrics[name] for name in TIERS))


def test_questions_in_flight_cannot_cache_a_deleted_document(tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    args = ("--kv-cpu-gib", "0.05", "--kv-disk-dir", str(kv), "--api-key", KEY)
    args += ("--max-num-seqs", "1")
    with running_server(*args, log_path=tmp_path / "server.log") as server:
        baseline = blocks_held(server)
        upload = {"text": text("obsidian")}
        doc = requests.post(f"{server.url}/v1/documents", json=upload, headers=AUTH, timeout=60)
        assert doc.status_code == 202, doc.text
        doc_id = doc.json()["id"]
        assert wait_ready(server.url, doc_id, AUTH)["status"] == "ready"
        own = needles(grams(stored_tokens(kv)[doc_id]))

        # NOTE: far more tokens than the DELETE can take on a loaded machine; closed below.
        generating = Question(server.url, doc_id, max_tokens=3000)
        generating.start()
        assert generating.started.wait(300) and generating.error is None, generating.error
        queued = Question(server.url, doc_id, max_tokens=8)
        queued.start()
        assert wait_for(lambda: server.metrics()["ragserve_num_requests_waiting"] >= 1, 120)

        deleted = requests.delete(f"{server.url}/v1/documents/{doc_id}", headers=AUTH, timeout=60)
        assert deleted.status_code == 200, deleted.text
        # The scenario held: the DELETE returned while both were still in the engine.
        assert generating.is_alive() and queued.is_alive()
        assert generating.finish_reason is None  # still generating
        generating.close.set()
        generating.join(120)
        queued.join(600)
        assert not generating.is_alive() and not queued.is_alive()
        assert generating.error is None and queued.error is None, (generating.error, queued.error)
        assert queued.finish_reason == "length"
        idle = ("ragserve_num_requests_running", "ragserve_num_requests_waiting")
        assert wait_for(lambda: all(server.metrics()[name] == 0 for name in idle), 60)

        assert files_holding(kv, own) == []
        assert blocks_held(server) == baseline
        # Nothing of it is cached anywhere: uploading it again computes its whole prefix.
        before = server.metrics()[COMPUTED]
        again = requests.post(f"{server.url}/v1/documents", json=upload, headers=AUTH, timeout=60)
        assert again.status_code == 202, again.text
        assert wait_ready(server.url, doc_id, AUTH)["status"] == "ready"
        computed = server.metrics()[COMPUTED] - before
        assert computed >= again.json()["prefix_tokens"] // BLOCK_SIZE * BLOCK_SIZE
