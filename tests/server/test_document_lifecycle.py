"""Documents expire: ``ttl`` / ``expire_time`` at upload, PATCH to change them (and the
metadata), expiry deletes like a DELETE; GET shows times, tokens, where the KV lives."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

import pytest
import requests

from ragserve.server.config import ServerConfig
from ragserve.server.document_lifecycle import expire_time_from, rfc3339
from ragserve.server.errors import APIError
from tests.server.server_fixtures import (
    BLOCK_SIZE,
    ServerProcess,
    assert_error,
    module_server,
    wait_for,
    wait_ready,
)

KEY = "sk-lifecycle"
AUTH = {"Authorization": f"Bearer {KEY}"}
server = module_server("--api-key", KEY)


def text(topic: str) -> str:
    return " ".join(f"The {topic} roster puts runner {i} in lane {(i * 7) % 9}." for i in range(16))


# -- the rules ------------------------------------------------------------------------------
def test_expire_time_rules() -> None:
    now = 1_800_000_000.0
    assert expire_time_from(None, None, now) is None
    assert expire_time_from(None, None, now, default_ttl=60) == now + 60
    assert expire_time_from(5, None, now, default_ttl=60) == now + 5
    assert expire_time_from(None, now + 9, now) == now + 9
    assert expire_time_from(None, rfc3339(now + 30), now) == pytest.approx(now + 30)
    assert rfc3339(0) == "1970-01-01T00:00:00.000Z"
    for ttl, expire in [
        (0, None),
        (-1, None),
        (5, now + 9),
        (None, now - 1),
        (None, "soon"),
        (None, "2030-01-01T00:00:00"),
        (10**400, None),  # NOTE: JSON integers have no bound; no float holds this one
        (None, 10**400),
    ]:
        with pytest.raises(APIError):
            expire_time_from(ttl, expire, now)
    with pytest.raises(ValueError):
        ServerConfig(document_ttl=0)


# -- a real server --------------------------------------------------------------------------
def upload(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    response = requests.post(f"{server.url}/v1/documents", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 202, response.text
    return dict(response.json())


def get(server: ServerProcess, doc_id: str) -> requests.Response:
    return requests.get(f"{server.url}/v1/documents/{doc_id}", headers=AUTH, timeout=30)


def patch(server: ServerProcess, doc_id: str, body: dict[str, Any]) -> requests.Response:
    return requests.patch(
        f"{server.url}/v1/documents/{doc_id}", json=body, headers=AUTH, timeout=30
    )


@pytest.mark.e2e
def test_get_shows_times_tokens_and_kv_places(server: ServerProcess) -> None:
    doc = upload(server, {"text": text("north")})
    state = wait_ready(server.url, doc["id"], AUTH)
    assert state["expire_time"] is None and state["create_time"].endswith("Z")
    full = get(server, doc["id"]).json()
    assert full["tokens"] == doc["tokens"] and full["status"] == "ready"
    assert full["kv_blocks"]["device"] == doc["prefix_tokens"] // BLOCK_SIZE
    body = {
        "messages": [{"role": "user", "content": "Which lane is runner 3 in?"}],
        "documents": [doc["id"]],
        "max_tokens": 2,
    }
    answer = requests.post(
        f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=120
    )
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= doc["prefix_tokens"] // BLOCK_SIZE * BLOCK_SIZE
    assert usage["ragserve_cache"] == {
        "cached_tokens_by_tier": {"device": cached},
        "blended_tokens": 0,
        "recomputed_tokens": 0,
        "documents": [],
    }


@pytest.mark.e2e
def test_ttl_expires_and_patch_extends(server: ServerProcess) -> None:
    # NOTE: the one to extend gets a longer first TTL, so a slow upload on a loaded
    # machine cannot let it expire before the PATCH reaches it.
    started = time.time()
    extended = upload(server, {"text": text("west"), "ttl": 8, "metadata": {"v": 1}})
    short = upload(server, {"text": text("east"), "ttl": 2})
    assert short["expire_time"] is not None
    changed = patch(server, extended["id"], {"ttl": 600, "metadata": {"v": 2}})
    assert changed.status_code == 200, changed.text
    assert changed.json()["metadata"] == {"v": 2}
    assert wait_for(lambda: get(server, short["id"]).status_code == 404, 15)
    listed = requests.get(f"{server.url}/v1/documents", headers=AUTH, timeout=30).json()["data"]
    assert short["id"] not in {d["id"] for d in listed}
    assert_error(get(server, short["id"]), 404, "document_not_found")
    time.sleep(max(0.0, started + 9.0 - time.time()))  # past its first expiry
    assert get(server, extended["id"]).status_code == 200
    # NOTE: GET answers 404 from the moment of expiry; the sweep that purges may lag.
    assert wait_for(lambda: "expired and was deleted" in server.log(), 15)
    # PATCH expire_time null: never expires; bad values are 400s.
    assert patch(server, extended["id"], {"expire_time": None}).json()["expire_time"] is None
    assert_error(patch(server, extended["id"], {"ttl": -5}), 400, "invalid_expiry")
    huge = '{"ttl": 1' + "0" * 400 + "}"
    response = requests.patch(
        f"{server.url}/v1/documents/{extended['id']}",
        data=huge,
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=30,
    )
    assert_error(response, 400, "invalid_expiry")
    # Metadata is held to the upload's limits: size, and depth (listings nest it further).
    too_big = {"metadata": {"notes": "x" * 20_000}}
    assert_error(patch(server, extended["id"], too_big), 400, "metadata_too_large")
    deep: dict[str, Any] = {}
    for _ in range(40):
        deep = {"a": deep}
    assert_error(patch(server, extended["id"], {"metadata": deep}), 400, "metadata_too_deep")
    assert get(server, extended["id"]).json()["metadata"] == {"v": 2}
    assert_error(patch(server, extended["id"], {"ttl": 5, "expire_time": 9}), 400, "invalid_expiry")
    bad = requests.post(
        f"{server.url}/v1/documents",
        json={"text": text("south"), "ttl": "x"},
        headers=AUTH,
        timeout=30,
    )
    assert_error(bad, 400)


def upload_form(server: ServerProcess, topic: str, fields: dict[str, str]) -> requests.Response:
    """A real multipart upload: the document as a .txt file plus ``fields`` as form fields."""
    files: dict[str, Any] = {"file": (f"{topic}.txt", text(topic).encode(), "text/plain")}
    files.update({name: (None, value) for name, value in fields.items()})
    return requests.post(f"{server.url}/v1/documents", files=files, headers=AUTH, timeout=60)


@pytest.mark.e2e
def test_multipart_upload_takes_ttl_expire_time_and_metadata(server: ServerProcess) -> None:
    before = time.time()
    timed = upload_form(server, "harbour", {"ttl": "600", "metadata": '{"v": 1}'})
    assert timed.status_code == 202, timed.text
    body = timed.json()
    assert body["metadata"] == {"filename": "harbour.txt", "v": 1}
    assert before + 600 <= expires_at(body) <= time.time() + 600
    when = rfc3339(before + 900)
    dated = upload_form(server, "estuary", {"expire_time": str(when)})
    assert dated.status_code == 202, dated.text
    assert dated.json()["expire_time"] == when
    unix = upload_form(server, "lagoon", {"expire_time": f"{before + 700:.3f}"})
    assert unix.status_code == 202, unix.text
    assert expires_at(unix.json()) == pytest.approx(before + 700, abs=0.01)
    assert get(server, body["id"]).json()["expire_time"] == body["expire_time"]

    # The same rules as a JSON upload, each error naming its field.
    for fields, param in [
        ({"ttl": "soon"}, "ttl"),
        ({"ttl": "-5"}, "ttl"),
        ({"ttl": "nan"}, "ttl"),
        ({"ttl": ""}, "ttl"),
        ({"ttl": "5", "expire_time": f"{before + 60}"}, "ttl"),
        ({"expire_time": "tomorrow"}, "expire_time"),
        ({"expire_time": "2030-01-01T00:00:00"}, "expire_time"),
        ({"expire_time": f"{before - 60}"}, "expire_time"),
        ({"metadata": "[1]"}, "metadata"),
    ]:
        error = assert_error(upload_form(server, "delta", fields), 400)
        assert error["param"] == param, (fields, error)
    listed = requests.get(f"{server.url}/v1/documents", headers=AUTH, timeout=30).json()["data"]
    assert "delta.txt" not in {d["metadata"].get("filename") for d in listed}


@pytest.mark.e2e
def test_multipart_ttl_expires(server: ServerProcess) -> None:
    brief = upload_form(server, "spring", {"ttl": "2"})
    assert brief.status_code == 202, brief.text
    assert wait_for(lambda: get(server, brief.json()["id"]).status_code == 404, 15)


def expires_at(doc: dict[str, Any]) -> float:
    return datetime.fromisoformat(doc["expire_time"].replace("Z", "+00:00")).timestamp()
