"""The document API of a real ``ragserve serve`` with two API keys (two tenants)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from tests.server.server_fixtures import (
    BLOCK_SIZE,
    ServerProcess,
    assert_error,
    module_server,
    running_server,
    wait_for,
    wait_ready,
)

pytestmark = pytest.mark.e2e

KEY_A, KEY_B = "key-tenant-a", "key-tenant-b"
A = {"Authorization": f"Bearer {KEY_A}"}
B = {"Authorization": f"Bearer {KEY_B}"}
server = module_server("--api-key", KEY_A, api_key_file=f"# tenants\n\n{KEY_B}\n")

QUESTIONS = ["What is the code of item 4?", "Which item has code 50?"]
COMPUTED = "ragserve_prompt_tokens_computed_total"
PINNED = 'ragserve_kv_blocks{state="pinned"}'


def make_document(topic: str, count: int = 24) -> str:
    """About 300 tokens of distinct facts."""
    return " ".join(
        f"In the {topic} registry, item {i} has code {(i * 37 + len(topic)) % 101}."
        for i in range(count)
    )


def upload(
    server: ServerProcess, text: str, headers: dict[str, str], **metadata: Any
) -> requests.Response:
    return requests.post(
        f"{server.url}/v1/documents",
        json={"text": text, "metadata": metadata},
        headers=headers,
        timeout=60,
    )


def ask(client: openai.OpenAI, question: str, doc_ids: list[str], max_tokens: int = 10) -> Any:
    return client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"documents": doc_ids},
    )


@pytest.fixture(scope="module")
def client_a(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY_A, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ready_doc(server: ServerProcess) -> dict[str, Any]:
    """One document of tenant A, uploaded and fully ingested; checks the ingestion contract."""
    before = server.metrics()[COMPUTED]
    response = upload(server, make_document("harbor"), A, source="test")
    assert response.status_code == 202
    doc = response.json()
    assert re.fullmatch("[0-9a-f]{32}", doc["id"]) and doc["status"] == "ingesting"
    assert 200 <= doc["tokens"] < doc["prefix_tokens"] <= 500
    again = upload(server, make_document("harbor"), A)
    assert again.status_code == 200 and again.json()["id"] == doc["id"]
    state = wait_ready(server.url, doc["id"], A)
    assert state["status"] == "ready", state
    assert state["blocks_pinned"] == doc["prefix_tokens"] // BLOCK_SIZE
    assert state["pinned_tokens"] == state["blocks_pinned"] * BLOCK_SIZE
    assert state["metadata"] == {"source": "test"}
    computed = server.metrics()[COMPUTED] - before
    assert doc["prefix_tokens"] - BLOCK_SIZE <= computed <= doc["prefix_tokens"] + BLOCK_SIZE
    return dict(state)


def test_reupload_computes_nothing(server: ServerProcess, ready_doc: dict[str, Any]) -> None:
    before = server.metrics()
    assert before[PINNED] >= ready_doc["blocks_pinned"]
    response = upload(server, make_document("harbor"), A)
    assert response.status_code == 200
    assert response.json()["status"] == "ready" and response.json()["id"] == ready_doc["id"]
    assert server.metrics()[COMPUTED] == before[COMPUTED]


def test_questions_hit_the_document_blocks(
    client_a: openai.OpenAI, ready_doc: dict[str, Any]
) -> None:
    full_block_tokens = ready_doc["tokens"] // BLOCK_SIZE * BLOCK_SIZE
    for question in QUESTIONS:
        out = ask(client_a, question, [ready_doc["id"]])
        assert out.usage.prompt_tokens > ready_doc["prefix_tokens"]
        assert out.usage.prompt_tokens_details.cached_tokens >= full_block_tokens - BLOCK_SIZE
        assert out.choices[0].message.content
    # The caller's own system message continues the system turn after the document.
    with_system = client_a.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[
            {"role": "system", "content": "Answer tersely."},
            {"role": "user", "content": QUESTIONS[0]},
        ],
        max_tokens=4,
        temperature=0,
        extra_body={"documents": [ready_doc["id"]]},
    )
    assert with_system.usage is not None and with_system.usage.prompt_tokens_details is not None
    assert with_system.usage.prompt_tokens_details.cached_tokens >= full_block_tokens - BLOCK_SIZE
    # Completions put the same document prefix first, so one ingestion serves both APIs.
    completion = client_a.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="Question: what is the code of item 3? Answer:",
        max_tokens=4,
        temperature=0,
        extra_body={"documents": [ready_doc["id"]]},
    )
    assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens >= full_block_tokens - BLOCK_SIZE


def test_delete_while_ingesting(server: ServerProcess) -> None:
    pinned = server.metrics()[PINNED]
    doc = upload(server, make_document("meadow", 12), A).json()
    assert doc["status"] == "ingesting"
    assert (
        requests.delete(f"{server.url}/v1/documents/{doc['id']}", headers=A, timeout=30).status_code
        == 200
    )
    assert wait_for(lambda: server.metrics()["ragserve_num_requests_active"] == 0, 30)
    assert server.metrics()[PINNED] == pinned
    assert_error(requests.get(f"{server.url}/v1/documents/{doc['id']}", headers=A, timeout=30), 404)


def test_answers_match_a_server_without_prefix_caching(
    server: ServerProcess, client_a: openai.OpenAI, ready_doc: dict[str, Any], tmp_path: Path
) -> None:
    cached = [ask(client_a, q, [ready_doc["id"]], max_tokens=12) for q in QUESTIONS]
    assert all(out.usage.prompt_tokens_details.cached_tokens > 0 for out in cached)
    with running_server("--no-prefix-caching", log_path=tmp_path / "uncached.log") as plain:
        response = upload(plain, make_document("harbor"), {})
        assert response.status_code == 202
        doc_id = response.json()["id"]
        client = openai.OpenAI(
            base_url=f"{plain.url}/v1", api_key="unused", max_retries=0, timeout=120
        )
        uncached = [ask(client, q, [doc_id], max_tokens=12) for q in QUESTIONS]
    for hit, miss in zip(cached, uncached, strict=True):
        assert miss.usage.prompt_tokens_details.cached_tokens == 0
        assert hit.usage.prompt_tokens == miss.usage.prompt_tokens
        assert hit.choices[0].message.content == miss.choices[0].message.content


def test_concurrent_questions_prefill_the_document_once(server: ServerProcess) -> None:
    before = server.metrics()[COMPUTED]
    response = upload(server, make_document("orchard"), A)
    assert response.status_code == 202
    doc = response.json()

    async def run() -> list[Any]:
        client = openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=KEY_A, max_retries=0, timeout=180
        )
        try:
            questions = [f"What is the code of item {i}?" for i in range(16)]
            return await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model="SmolLM2-135M-Instruct",
                        messages=[{"role": "user", "content": q}],
                        max_tokens=4,
                        temperature=0,
                        extra_body={"documents": [doc["id"]]},
                    )
                    for q in questions
                )
            )
        finally:
            await client.close()

    outputs = asyncio.run(run())
    assert len(outputs) == 16 and all(o.choices[0].message.content is not None for o in outputs)
    wait_ready(server.url, doc["id"], A)
    computed = server.metrics()[COMPUTED] - before
    tail = max(o.usage.prompt_tokens for o in outputs) - doc["prefix_tokens"]
    # One prefill of the document, plus per question its own tail and at most one partial block.
    assert (
        doc["prefix_tokens"] - BLOCK_SIZE
        <= computed
        <= doc["prefix_tokens"] + 16 * (tail + BLOCK_SIZE)
    )
    assert computed < 3 * doc["prefix_tokens"]


def test_multipart_upload(server: ServerProcess, tmp_path: Path) -> None:
    url = f"{server.url}/v1/documents"
    text = make_document("lighthouse", 8)
    files: dict[str, Any] = {
        "file": ("notes.md", text.encode(), "text/markdown"),
        "metadata": (None, '{"lang": "en"}'),
    }
    response = requests.post(url, files=files, headers=A, timeout=60)
    assert response.status_code == 202, response.text
    doc = response.json()
    assert doc["metadata"] == {"filename": "notes.md", "lang": "en"}
    same = requests.post(url, json={"text": text}, headers=A, timeout=60)
    assert same.status_code == 200 and same.json()["id"] == doc["id"]

    pdf = requests.post(
        url, files={"file": ("paper.pdf", b"%PDF-1.4", "application/pdf")}, headers=A, timeout=60
    )
    assert_error(pdf, 415, "unsupported_media_type")
    latin1 = requests.post(
        url, files={"file": ("x.txt", "caf\xe9".encode("latin-1"))}, headers=A, timeout=60
    )
    assert "UTF-8" in assert_error(latin1, 400)["message"]
    no_file = requests.post(url, files={"other": ("x.txt", b"hello")}, headers=A, timeout=60)
    assert_error(no_file, 400)
    bad_files: dict[str, Any] = {"file": ("y.txt", b"hello"), "metadata": (None, "[1]")}
    bad_meta = requests.post(url, files=bad_files, headers=A, timeout=60)
    assert_error(bad_meta, 400)


def test_list_and_delete_unpins(server: ServerProcess) -> None:
    doc = upload(server, make_document("quarry", 10), A).json()
    state = wait_ready(server.url, doc["id"], A)
    listed = requests.get(f"{server.url}/v1/documents", headers=A, timeout=30).json()
    assert doc["id"] in {d["id"] for d in listed["data"]}
    pinned = server.metrics()[PINNED]
    deleted = requests.delete(f"{server.url}/v1/documents/{doc['id']}", headers=A, timeout=30)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    # NOTE: the first block (template head, "<document>", "In") is shared with A's other documents.
    unpinned = pinned - server.metrics()[PINNED]
    assert state["blocks_pinned"] - 1 <= unpinned <= state["blocks_pinned"]
    assert_error(
        requests.get(f"{server.url}/v1/documents/{doc['id']}", headers=A, timeout=30),
        404,
        "document_not_found",
    )
    assert_error(
        requests.delete(f"{server.url}/v1/documents/{doc['id']}", headers=A, timeout=30), 404
    )
    question: dict[str, Any] = {
        "messages": [{"role": "user", "content": "hi"}],
        "documents": [doc["id"]],
        "max_tokens": 2,
    }
    error = assert_error(
        requests.post(f"{server.url}/v1/chat/completions", json=question, headers=A, timeout=30),
        404,
    )
    assert error["param"] == "documents"
    question["documents"] = ["not-hex"]
    assert_error(
        requests.post(f"{server.url}/v1/chat/completions", json=question, headers=A, timeout=30),
        400,
        "invalid_document_id",
    )
    assert_error(
        requests.get(f"{server.url}/v1/documents/ABC", headers=A, timeout=30),
        400,
        "invalid_document_id",
    )


def test_tenants_are_isolated(server: ServerProcess, ready_doc: dict[str, Any]) -> None:
    url, doc_id = server.url, ready_doc["id"]
    assert_error(requests.get(f"{url}/v1/documents/{doc_id}", headers=B, timeout=30), 404)
    assert_error(requests.delete(f"{url}/v1/documents/{doc_id}", headers=B, timeout=30), 404)
    assert doc_id not in {
        d["id"] for d in requests.get(f"{url}/v1/documents", headers=B, timeout=30).json()["data"]
    }
    question: dict[str, Any] = {
        "messages": [{"role": "user", "content": "hi"}],
        "documents": [doc_id],
        "max_tokens": 2,
    }
    assert_error(
        requests.post(f"{url}/v1/chat/completions", json=question, headers=B, timeout=30), 404
    )
    other = upload(server, make_document("harbor"), B)
    assert other.status_code == 202 and other.json()["id"] != doc_id
    assert (
        requests.get(f"{url}/v1/documents/{doc_id}", headers=A, timeout=30).json()["status"]
        == "ready"
    )

    # Cached blocks are per tenant too: B's first look at A's prompt finds nothing.
    prompt: dict[str, Any] = {"prompt": make_document("tenant secret", 8), "max_tokens": 1}
    first_a = requests.post(f"{url}/v1/completions", json=prompt, headers=A, timeout=60).json()
    second_a = requests.post(f"{url}/v1/completions", json=prompt, headers=A, timeout=60).json()
    first_b = requests.post(f"{url}/v1/completions", json=prompt, headers=B, timeout=60).json()
    assert first_a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second_a["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    assert first_b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_api_keys_are_required_on_v1_metrics_and_the_spec(server: ServerProcess) -> None:
    url = server.url
    missing = requests.get(f"{url}/v1/models", timeout=10)
    assert assert_error(missing, 401, "invalid_api_key")["type"] == "authentication_error"
    assert missing.headers["WWW-Authenticate"] == "Bearer"
    assert_error(
        requests.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"}, timeout=10), 401
    )
    assert_error(
        requests.get(f"{url}/v1/models", headers={"Authorization": KEY_A}, timeout=10), 401
    )
    assert requests.get(f"{url}/v1/models", headers=B, timeout=10).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    assert requests.get(f"{url}/health", timeout=30).status_code == 200
    for closed in ("/metrics", "/openapi.json"):
        assert_error(requests.get(f"{url}{closed}", timeout=30), 401, "invalid_api_key")
        assert requests.get(f"{url}{closed}", headers=B, timeout=30).status_code == 200
    text = requests.get(f"{url}/metrics", headers=A, timeout=30).text
    assert KEY_A not in text and KEY_B not in text and "tenant-" not in text
    assert wait_for(lambda: server.metrics()["ragserve_num_requests_active"] == 0, 30)


def test_special_token_strings_in_a_document_stay_text(server: ServerProcess) -> None:
    plain = upload(server, "Note: end here.", A).json()
    tricky = upload(server, "Note: <|im_end|> here.", A).json()
    # As text, "<|im_end|>" is several tokens; parsed as the special token it would be one.
    assert tricky["tokens"] - plain["tokens"] >= 4
