"""Documents in any order through a real ``ragserve serve --kv-reuse blend``: blended KV
is reported apart from exact prefix hits, per request and in the metrics, and a request
may choose prefix reuse or a recompute ratio of its own."""

from __future__ import annotations

from typing import Any

import pytest
import requests

from tests.server.server_fixtures import ServerProcess, assert_error, module_server, wait_ready

pytestmark = pytest.mark.e2e

server = module_server("--kv-reuse", "blend", "--blend-recompute-ratio", "0.15")
MODEL = "SmolLM2-135M-Instruct"
BLENDED = 'ragserve_request_blended_tokens_total{endpoint="/v1/chat/completions"}'


def document(topic: str) -> str:
    return " ".join(f"In the {topic} list, entry {i} is worth {(i * 13) % 97}." for i in range(16))


@pytest.fixture(scope="module")
def docs(server: ServerProcess) -> dict[str, str]:
    ids = {}
    for name in ("orchard", "quarry", "lighthouse"):
        response = requests.post(
            f"{server.url}/v1/documents", json={"text": document(name)}, timeout=60
        )
        assert response.status_code == 202, response.text
        ids[name] = response.json()["id"]
        assert wait_ready(server.url, ids[name])["status"] == "ready"
    return ids


def chat(server: ServerProcess, doc_ids: list[str], **extra: Any) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is entry 3 worth?"}],
        "max_tokens": 8,
        "temperature": 0,
        "documents": doc_ids,
        **extra,
    }
    response = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_documents_in_any_order_are_blended_and_counted_apart(
    server: ServerProcess, docs: dict[str, str]
) -> None:
    ordered = [docs["orchard"], docs["quarry"], docs["lighthouse"]]
    first = chat(server, ordered)  # computes the segments of the later documents next to it
    assert first["usage"]["ragserve_cache"]["blended_tokens"] == 0
    before = server.metrics().get(BLENDED, 0.0)
    shuffled = [docs["lighthouse"], docs["orchard"], docs["quarry"]]
    blended = chat(server, shuffled)
    usage = blended["usage"]
    cache = usage["ragserve_cache"]
    assert cache["blended_tokens"] > 0 and cache["recomputed_tokens"] > 0
    # Exact hits only: the head and the leading document (pinned at ingestion), no more.
    assert usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"] // 2
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached + cache["blended_tokens"] < usage["prompt_tokens"]
    assert server.metrics()[BLENDED] - before == cache["blended_tokens"]
    prefix = chat(server, shuffled, kv_reuse="prefix")
    assert prefix["usage"]["ragserve_cache"]["blended_tokens"] == 0
    exact = chat(server, shuffled, blend_recompute_ratio=1.0)
    assert exact["usage"]["ragserve_cache"]["blended_tokens"] == 0
    assert exact["choices"][0]["message"] == prefix["choices"][0]["message"]


def test_completions_blend_too(server: ServerProcess, docs: dict[str, str]) -> None:
    body = {
        "model": MODEL,
        "prompt": "Entry 5 is worth",
        "max_tokens": 4,
        "temperature": 0,
        "documents": [docs["quarry"], docs["lighthouse"], docs["orchard"]],
    }
    for _ in range(2):  # the first may compute a segment it lacks
        response = requests.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
    assert response.json()["usage"]["ragserve_cache"]["blended_tokens"] > 0


@pytest.mark.parametrize(
    ("field", "value"), [("kv_reuse", "sideways"), ("blend_recompute_ratio", 1.5)]
)
def test_bad_reuse_fields_are_refused(
    server: ServerProcess, docs: dict[str, str], field: str, value: Any
) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "documents": [docs["quarry"]],
        field: value,
    }
    response = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert_error(response, 400)
