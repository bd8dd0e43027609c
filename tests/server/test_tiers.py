"""A server with a disk tier: documents persist across a restart, and /metrics shows the tiers."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from tests.server.server_fixtures import running_server, wait_ready

pytestmark = pytest.mark.e2e

DOC = " ".join(
    f"Article {i}: the lessee keeps the premises insured against fire and flood." for i in range(30)
)
COMPUTED = "ragserve_prompt_tokens_computed_total"


def upload(url: str) -> dict[str, object]:
    response = requests.post(f"{url}/v1/documents", json={"text": DOC}, timeout=60)
    assert response.status_code in (200, 202), response.text
    return wait_ready(url, str(response.json()["id"]))


def test_restarted_server_reads_a_document_back_from_disk(tmp_path: Path) -> None:
    tier_args = ("--kv-disk-gib", "0.1", "--kv-disk-dir", str(tmp_path / "kv"))
    with running_server(*tier_args, log_path=tmp_path / "first.log") as first:
        doc = upload(first.url)
        assert doc["status"] == "ready"
        metrics = first.metrics()
        written_when_pinned = metrics['ragserve_kv_tier_written_bytes_total{tier="disk"}']
        assert metrics['ragserve_kv_tier_capacity_bytes{tier="disk"}'] == int(0.1 * 2**30)
    assert written_when_pinned > 0 or any((tmp_path / "kv").rglob("*"))

    with running_server(*tier_args, log_path=tmp_path / "second.log") as second:
        before = second.metrics()[COMPUTED]
        again = upload(second.url)
        metrics = second.metrics()
        assert again["id"] == doc["id"]
        assert (
            metrics['ragserve_kv_tier_hits_total{tier="disk"}'] >= int(str(doc["tokens"])) // 16 - 2
        )
        # Only the document's last partial block (and one token) is computed again.
        assert metrics[COMPUTED] - before < 32
        assert metrics['ragserve_kv_tier_corrupt_records_total{tier="disk"}'] == 0
