"""Two real servers with separate registries (no shared directory) and one real valkey-
server: the document registry is shared through the store alone.

A document uploaded on one is listed and answered on the other (its blocks from the remote
tier), a delete on one is forgotten by the other, a PATCH on one (metadata, an expiry
moved later) reaches the other within a watch round, concurrent PATCHes end the same on
both, a tombstone wins over a PATCH that comes late, values that do not verify are ignored
and counted, tenants never see each other's rows, the store never holds token ids in the
clear (the servers have a key), the other server shows the status of an ingestion on the
first (``ingesting`` until it ends, then ``ready`` or ``failed`` with its error), an
upload while the store is down reaches the other server once the store is back, and the
other server takes over an ingestion whose server died (``kill -9``) once its lease
lapsed, and rows the store lost are offered again (a lost listing rebuilt). The tests run
in order on one pair of servers; the last one kills the first server.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from array import array
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import pytest
import requests

from ragserve.commands.serve import CPU_THREAD_ENV
from ragserve.document_ids import document_id
from ragserve.engine.guarded_sampling import FAIL_SAMPLING_ENV
from ragserve.server.auth import tenant_name
from ragserve.server.document_watch import INTERVAL_S
from ragserve.server.registry_cipher import RegistryCipher
from ragserve.server.registry_rows import decode_row
from ragserve.server.store_registry import PREFIX, ids_key, row_key
from ragserve.server.store_values import stamp_of, unpack_row
from tests.server.server_fixtures import BASE_ARGS, ServerProcess, wait_for, wait_ready
from tests.valkey_server import ValkeyServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KEY, OTHER_KEY = "sk-store-registry", "sk-store-registry-other"
AUTH = {"Authorization": f"Bearer {KEY}"}
OTHER = {"Authorization": f"Bearer {OTHER_KEY}"}
TEXT = " ".join(f"In the harbour ledger, entry {i} reads {i * 7 % 97}." for i in range(40))
# NOTE: its ingestion takes seconds on two cores (a prefill of many chunks), long enough
# to read its status on the other server while the first is still ingesting it.
LONG_TEXT = " ".join(
    f"In the warehouse log, crate {i} holds {i * 13 % 89} lamps." for i in range(80)
)
# Its ingestion fails on the first server: the test-only sampling fault hook fails the
# requests whose id holds this marker, and an ingestion's id holds its document's id.
FAILING_TEXT = TEXT + " Addendum whose ingestion fails."
FAILING_MARKER = document_id(tenant_name(KEY), FAILING_TEXT)[:16]
# Ingested as slowly as LONG_TEXT, and sharing none of its blocks.
ORPHAN_TEXT = LONG_TEXT.replace("warehouse log", "granary ledger")
# NOTE: short, so a takeover comes soon; still over two watch rounds (2 s), so a live
# ingestion renews its lease in time on a busy machine.
LEASE_S = 5


class Pair:
    def __init__(self, store: ValkeyServer, one: ServerProcess, two: ServerProcess, key: Path):
        self.store, self.one, self.two, self.key_file = store, one, two, key
        self.doc: dict[str, Any] = {}
        self.model = ""


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    root = tmp_path_factory.mktemp("store-registry")
    (root / "store").mkdir()
    store = ValkeyServer(root / "store")
    store.start()
    key_file = root / "key"
    key_file.write_bytes(os.urandom(32).hex().encode())
    key_file.chmod(0o600)

    def flags(name: str) -> tuple[str, ...]:
        return (
            "--registry-dir", str(root / name),
            "--kv-remote-url", store.url,
            "--kv-remote-retry-s", "1",
            "--kv-encryption-key-file", str(key_file),
            "--ingest-lease-seconds", str(LEASE_S),
            "--api-key", KEY,
            "--api-key", OTHER_KEY,
        )  # fmt: skip

    # NOTE: started side by side, each with the thread settings it would otherwise
    # restart itself to get (a second interpreter start, a third of the time on two cores).
    envs = {"one": {**CPU_THREAD_ENV, FAIL_SAMPLING_ENV: FAILING_MARKER}, "two": CPU_THREAD_ENV}
    with ThreadPoolExecutor(2) as pool:
        starting = [
            pool.submit(_start, flags(name), root / f"{name}.log", envs[name])
            for name in ("one", "two")
        ]
        wait(starting)
    try:
        one, two = (future.result() for future in starting)
        yield Pair(store, one, two, key_file)
    finally:
        for future in starting:
            if future.exception() is None:
                future.result().stop()
        store.stop()


def _start(flags: tuple[str, ...], log: Path, env: dict[str, str]) -> ServerProcess:
    server = ServerProcess([*BASE_ARGS, *flags], log, env=env, start_timeout=180)
    server.scrape_headers = AUTH
    return server.start()


def listed(url: str, headers: dict[str, str] = AUTH) -> set[str]:
    response = requests.get(f"{url}/v1/documents", headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    return {doc["id"] for doc in response.json()["data"]}


def ask(url: str, doc_id: str) -> requests.Response:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Which entry reads 40?"}],
        "documents": [doc_id],
        "max_tokens": 1,
        "temperature": 0,
    }
    return requests.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)


def counter(server: ServerProcess, name: str) -> float:
    return server.metrics().get(f"ragserve_registry_store_{name}_total", 0.0)


def model_of_rows(pair: Pair) -> str:
    """The model fingerprint in the store's row keys (both servers run one model)."""
    if not pair.model:
        keys = list(pair.store.client().scan_iter(match=f"{PREFIX}:*:ids"))
        assert keys, "no row was published"
        pair.model = keys[0].decode().split(":")[3]
    return pair.model


def test_a_document_uploaded_on_one_is_listed_and_answered_on_the_other(pair: Pair) -> None:
    uploaded = requests.post(
        f"{pair.one.url}/v1/documents", json={"text": TEXT}, headers=AUTH, timeout=120
    )
    assert uploaded.status_code == 202, uploaded.text
    pair.doc = uploaded.json()
    wait_ready(pair.one.url, pair.doc["id"], AUTH)
    assert pair.doc["id"] in listed(pair.two.url)  # the other server never saw the upload
    answered = ask(pair.two.url, pair.doc["id"])
    assert answered.status_code == 200, answered.text
    usage = answered.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert usage["ragserve_cache"]["cached_tokens_by_tier"].get("remote", 0) > 0
    assert counter(pair.one, "published") >= 1
    assert counter(pair.two, "adopted") == 1


def test_tenants_never_see_each_others_rows(pair: Pair) -> None:
    assert pair.doc["id"] not in listed(pair.two.url, OTHER)
    response = requests.get(
        f"{pair.two.url}/v1/documents/{pair.doc['id']}", headers=OTHER, timeout=30
    )
    assert response.status_code == 404, response.text
    model = model_of_rows(pair)
    client = pair.store.client()
    assert client.get(row_key(model, tenant_name(OTHER_KEY), pair.doc["id"])) is None
    assert client.smembers(ids_key(model, tenant_name(OTHER_KEY))) == set()


def test_the_store_holds_no_token_ids_in_the_clear(pair: Pair) -> None:
    model = model_of_rows(pair)
    value = pair.store.client().get(row_key(model, tenant_name(KEY), pair.doc["id"]))
    assert isinstance(value, bytes)
    cipher = RegistryCipher.from_file(pair.key_file)
    tokens = decode_row(unpack_row(value), cipher).token_ids
    assert len(tokens) == pair.doc["tokens"]
    for start in range(0, len(tokens) - 4, 4):
        packed = array("I", tokens[start : start + 4])
        if sys.byteorder == "big":
            packed.byteswap()
        assert packed.tobytes() not in value
    assert TEXT[:20].encode() not in value


def test_values_that_do_not_verify_are_ignored_and_counted(pair: Pair) -> None:
    model = model_of_rows(pair)
    namespace = tenant_name(KEY)
    client = pair.store.client()
    genuine = client.get(row_key(model, namespace, pair.doc["id"]))
    assert isinstance(genuine, bytes)
    garbage, moved = "ab" * 16, "cd" * 16
    client.set(row_key(model, namespace, garbage), b"ragserve-row-v1\n[garbage" + os.urandom(64))
    client.set(row_key(model, namespace, moved), genuine)  # a real row under another id
    client.sadd(ids_key(model, namespace), garbage, moved)
    before = counter(pair.two, "rejected")
    assert listed(pair.two.url) == {pair.doc["id"]}
    for doc_id in (garbage, moved):
        response = ask(pair.two.url, doc_id)
        assert response.status_code == 404, response.text
    assert counter(pair.two, "rejected") >= before + 4  # the listing's two, the questions'
    client.delete(row_key(model, namespace, garbage), row_key(model, namespace, moved))
    client.srem(ids_key(model, namespace), garbage, moved)


def test_a_delete_on_one_is_forgotten_by_the_other(pair: Pair) -> None:
    deleted = requests.delete(
        f"{pair.one.url}/v1/documents/{pair.doc['id']}", headers=AUTH, timeout=60
    )
    assert deleted.status_code == 200, deleted.text
    # Within a watch round (2 s): the listing reads no tombstone, the watch does.
    two = pair.two
    assert wait_for(lambda: pair.doc["id"] not in listed(two.url), 10, interval=0.2)
    assert ask(two.url, pair.doc["id"]).status_code == 404
    model = model_of_rows(pair)
    ttl = pair.store.client().ttl(row_key(model, tenant_name(KEY), pair.doc["id"]))
    assert 0 < ttl <= 24 * 3600  # a tombstone, kept a day


def test_an_upload_right_after_a_delete_elsewhere_keeps_the_document(pair: Pair) -> None:
    """The other server still knows the deleted document (its watch has not run): the
    upload of its text registers it anew, and no watch round forgets it."""
    one, two = pair.one, pair.two
    text = "A note deleted on one and uploaded again on two at once. " * 4
    uploaded = requests.post(
        f"{one.url}/v1/documents", json={"text": text}, headers=AUTH, timeout=120
    )
    assert uploaded.status_code == 202, uploaded.text
    doc_id = uploaded.json()["id"]
    assert doc_id in listed(two.url)  # learned there
    deleted = requests.delete(f"{one.url}/v1/documents/{doc_id}", headers=AUTH, timeout=60)
    assert deleted.status_code == 200, deleted.text
    again = requests.post(f"{two.url}/v1/documents", json={"text": text}, headers=AUTH, timeout=120)
    assert again.status_code == 202, again.text  # a new document, not the one known there
    time.sleep(3 * INTERVAL_S)  # watch rounds on both servers
    for server in (two, one):
        assert wait_for(lambda s=server: document(s.url, doc_id).status_code == 200, 10, 0.2)
    wait_ready(two.url, doc_id, AUTH)
    assert ask(one.url, doc_id).status_code == 200


def document(url: str, doc_id: str) -> requests.Response:
    return requests.get(f"{url}/v1/documents/{doc_id}", headers=AUTH, timeout=30)


def patch(url: str, doc_id: str, body: dict[str, Any]) -> requests.Response:
    return requests.patch(f"{url}/v1/documents/{doc_id}", json=body, headers=AUTH, timeout=60)


def upload_known_to_both(pair: Pair, text: str, **fields: Any) -> dict[str, Any]:
    """A document uploaded on the first server and read once on the second (which then
    holds its row and does not read it again at a GET)."""
    uploaded = requests.post(
        f"{pair.one.url}/v1/documents", json={"text": text, **fields}, headers=AUTH, timeout=120
    )
    assert uploaded.status_code == 202, uploaded.text
    known = document(pair.two.url, uploaded.json()["id"])
    assert known.status_code == 200, known.text
    assert known.json()["metadata"] == fields.get("metadata", {})
    return dict(uploaded.json())


def test_a_patch_or_delete_on_the_server_that_never_saw_the_document_reaches_it(
    pair: Pair,
) -> None:
    def upload_on_one(text: str) -> str:
        uploaded = requests.post(
            f"{pair.one.url}/v1/documents", json={"text": text}, headers=AUTH, timeout=120
        )
        assert uploaded.status_code == 202, uploaded.text
        return str(uploaded.json()["id"])

    one, two = pair.one, pair.two
    patched = upload_on_one("A note the second server patches first. " * 4)
    changed = patch(two.url, patched, {"metadata": {"via": "two"}})  # NOTE: never read there
    assert changed.status_code == 200, changed.text
    assert wait_for(
        lambda: document(one.url, patched).json()["metadata"] == {"via": "two"}, 10, 0.2
    )
    deleted_id = upload_on_one("A note the second server deletes first. " * 4)
    deleted = requests.delete(f"{two.url}/v1/documents/{deleted_id}", headers=AUTH, timeout=60)
    assert deleted.status_code == 200, deleted.text
    assert wait_for(lambda: deleted_id not in listed(one.url), 10, interval=0.2)


def test_a_summary_on_the_server_that_never_saw_the_document_reads_it(pair: Pair) -> None:
    text = "A note the second server summarizes first: the ferry leaves at nine. " * 3
    uploaded = requests.post(
        f"{pair.one.url}/v1/documents", json={"text": text}, headers=AUTH, timeout=120
    )
    assert uploaded.status_code == 202, uploaded.text
    body = {"documents": [uploaded.json()["id"]], "max_summary_tokens": 8}
    url = f"{pair.two.url}/v1/pipelines/summarize"
    job = requests.post(url, json=body, headers=AUTH, timeout=120)
    assert job.status_code == 202, job.text

    def finished() -> dict[str, Any] | None:
        state = requests.get(f"{url}/{job.json()['id']}", headers=AUTH, timeout=30).json()
        return state if state["status"] not in ("queued", "running") else None

    assert wait_for(lambda: finished() is not None, 120, interval=0.5)
    assert finished()["status"] == "succeeded"  # type: ignore[index]


def test_a_patch_on_one_reaches_the_other_and_its_expiry_is_honoured(pair: Pair) -> None:
    text = TEXT + " Addendum whose metadata and expiry change."
    doc = upload_known_to_both(pair, text, metadata={"rev": 1}, ttl=15)
    first_expiry = time.time() + 15
    adopted = counter(pair.two, "adopted")
    patched = patch(pair.one.url, doc["id"], {"metadata": {"rev": 2}, "ttl": 3600})
    assert patched.status_code == 200, patched.text

    def seen_on_two() -> bool:
        return document(pair.two.url, doc["id"]).json().get("metadata") == {"rev": 2}

    assert wait_for(seen_on_two, 10, interval=0.2)  # a watch round is 2 s
    assert time.time() < first_expiry, "too slow to tell a refresh from a re-learn"
    on_two = document(pair.two.url, doc["id"]).json()
    assert on_two["expire_time"] == patched.json()["expire_time"]
    assert counter(pair.two, "refreshed") >= 1
    # Through its first expiry (and a sweep after it) the second server serves it, and
    # keeps it: a document it had dropped would be learned again, counted in ``adopted``.
    while time.time() < first_expiry + 2:
        assert document(pair.two.url, doc["id"]).status_code == 200
        time.sleep(0.5)
    assert doc["id"] in listed(pair.two.url)
    assert counter(pair.two, "adopted") == adopted


def test_concurrent_patches_end_the_same_on_both(pair: Pair) -> None:
    doc = upload_known_to_both(pair, TEXT + " Addendum patched on both at once.")
    with ThreadPoolExecutor(2) as pool:
        answers = list(
            pool.map(
                lambda server: patch(server.url, doc["id"], {"metadata": {"by": server.url}}),
                (pair.one, pair.two),
            )
        )
    assert [answer.status_code for answer in answers] == [200, 200]
    # The row whose write reached the store last (the higher version) wins on both.
    model = model_of_rows(pair)
    value = pair.store.client().get(row_key(model, tenant_name(KEY), doc["id"]))
    assert isinstance(value, bytes)
    winner = decode_row(unpack_row(value), RegistryCipher.from_file(pair.key_file)).metadata

    def agreed() -> bool:
        return all(
            document(server.url, doc["id"]).json().get("metadata") == winner
            for server in (pair.one, pair.two)
        )

    assert wait_for(agreed, 10, interval=0.2)


def test_a_tombstone_wins_over_a_patch_that_comes_late(pair: Pair) -> None:
    doc = upload_known_to_both(pair, TEXT + " Addendum deleted while patched.")
    deleted = requests.delete(f"{pair.one.url}/v1/documents/{doc['id']}", headers=AUTH, timeout=60)
    assert deleted.status_code == 200, deleted.text
    # The second server has not read the tombstone yet (or just has: then a 404).
    late = patch(pair.two.url, doc["id"], {"metadata": {"late": True}})
    assert late.status_code in (200, 404), late.text
    two = pair.two
    assert wait_for(lambda: document(two.url, doc["id"]).status_code == 404, 10, interval=0.2)
    assert doc["id"] not in listed(two.url) and doc["id"] not in listed(pair.one.url)
    model = model_of_rows(pair)
    value = pair.store.client().get(row_key(model, tenant_name(KEY), doc["id"]))
    assert isinstance(value, bytes) and value.startswith(b"ragserve-gone-")


def test_the_other_shows_ingesting_until_the_first_is_done(pair: Pair) -> None:
    """Polled through a load balancer, a document must not read ``ready`` before its
    ingestion ended; questions on it are answered all the same."""
    uploaded = requests.post(
        f"{pair.one.url}/v1/documents", json={"text": LONG_TEXT}, headers=AUTH, timeout=120
    )
    assert uploaded.status_code == 202, uploaded.text
    doc_id = uploaded.json()["id"]
    learned = document(pair.two.url, doc_id)  # the other server never saw the upload
    assert learned.status_code == 200, learned.text
    assert document(pair.one.url, doc_id).json()["status"] == "ingesting", "ingested too fast"
    assert learned.json()["status"] == "ingesting"
    assert ask(pair.two.url, doc_id).status_code == 200
    assert wait_ready(pair.one.url, doc_id, AUTH, timeout=300)["status"] == "ready"
    two = pair.two
    # Within a watch round of the first server's settle (2 s; more on a busy machine).
    assert wait_for(
        lambda: document(two.url, doc_id).json()["status"] == "ready", 3 * INTERVAL_S, 0.1
    )


def test_the_other_shows_a_failed_ingestion_with_its_error(pair: Pair) -> None:
    uploaded = requests.post(
        f"{pair.one.url}/v1/documents", json={"text": FAILING_TEXT}, headers=AUTH, timeout=120
    )
    assert uploaded.status_code == 202, uploaded.text
    doc_id = uploaded.json()["id"]
    assert document(pair.two.url, doc_id).status_code == 200  # learned, maybe still ingesting
    failed = wait_ready(pair.one.url, doc_id, AUTH)
    assert failed["status"] == "failed" and "injected sampling fault" in failed["error"]
    two = pair.two

    def failed_on_two() -> bool:
        state = document(two.url, doc_id).json()
        return bool(state["status"] == "failed" and state["error"] == failed["error"])

    assert wait_for(failed_on_two, 3 * INTERVAL_S, interval=0.1)


def test_an_upload_while_the_store_is_down_reaches_the_other_once_it_is_back(
    pair: Pair,
) -> None:
    pair.store.kill()
    text = TEXT + " Addendum written while the store was down."
    uploaded = requests.post(
        f"{pair.one.url}/v1/documents", json={"text": text}, headers=AUTH, timeout=120
    )
    assert uploaded.status_code == 202, uploaded.text  # committed to its own registry
    doc_id = uploaded.json()["id"]
    assert wait_for(lambda: counter(pair.one, "publish_failures") >= 1, 10)
    assert doc_id not in listed(pair.two.url)
    pair.store.start()  # back, and empty (nothing is persisted)
    # The first server retries at its watch rounds once its breaker lets it (1 s).
    assert wait_for(lambda: doc_id in listed(pair.two.url), 20, interval=0.5)
    assert pair.one.metrics()["ragserve_registry_store_pending"] == 0
    # Its row went out as the upload's (ingesting) after its ingestion ended: the first
    # server's watch settles it.
    two = pair.two
    assert wait_for(lambda: document(two.url, doc_id).json()["status"] == "ready", 10, 0.2)


def test_rows_the_store_lost_are_offered_again(pair: Pair) -> None:
    """The store is a cache: its LRU may evict a document's row, or the listing of its
    tenant, with no failed call to tell. The server holding the document offers them
    again at its next watch round, so a server that never saw it still finds it."""
    client = pair.store.client()
    namespace = tenant_name(KEY)

    def upload(text: str) -> str:
        response = requests.post(
            f"{pair.one.url}/v1/documents", json={"text": text}, headers=AUTH, timeout=120
        )
        assert response.status_code == 202, response.text
        doc_id: str = response.json()["id"]
        row = row_key(model_of_rows(pair), namespace, doc_id)
        assert wait_for(lambda: client.exists(row) == 1, 10, interval=0.2)
        return doc_id

    evicted = upload(TEXT + " Addendum whose row the store evicts.")
    for key in client.scan_iter(match=f"{PREFIX}:*"):  # every row, listing and tombstone
        client.delete(key)
    assert wait_for(lambda: evicted in listed(pair.two.url), 4 * INTERVAL_S + 10, 0.5)
    assert document(pair.two.url, evicted).status_code == 200

    unlisted = upload(TEXT + " Addendum whose tenant's listing the store evicts.")
    client.delete(ids_key(model_of_rows(pair), namespace))
    assert wait_for(lambda: unlisted in listed(pair.two.url), 4 * INTERVAL_S + 10, 0.5)
    assert evicted in listed(pair.two.url)


def test_an_ingestion_whose_server_died_is_taken_over_by_the_other(pair: Pair) -> None:
    """Last: it kills the first server. No document stays ``ingesting`` for good."""
    uploaded = requests.post(
        f"{pair.one.url}/v1/documents", json={"text": ORPHAN_TEXT}, headers=AUTH, timeout=120
    )
    assert uploaded.status_code == 202, uploaded.text
    doc_id = uploaded.json()["id"]
    assert document(pair.two.url, doc_id).json()["status"] == "ingesting"
    assert document(pair.one.url, doc_id).json()["status"] == "ingesting", "ingested too fast"
    pair.one.send_signal(signal.SIGKILL)
    pair.one.wait(30)
    # Its lease lapses, the second server claims it at a watch round and ingests the
    # document itself (seconds on two cores).
    two = pair.two
    assert wait_for(
        lambda: document(two.url, doc_id).json()["status"] != "ingesting",
        LEASE_S + 2 * INTERVAL_S + 60,
        interval=0.2,
    )
    assert document(two.url, doc_id).json()["status"] == "ready"
    assert counter(two, "taken_over") == 1  # this one alone: live ingestions were left alone
    value = pair.store.client().get(row_key(model_of_rows(pair), tenant_name(KEY), doc_id))
    assert isinstance(value, bytes)
    stamp = stamp_of(value)
    assert stamp is not None and stamp.status == "ready"  # settled for every other server
    answered = ask(two.url, doc_id)
    assert answered.status_code == 200, answered.text
    assert answered.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
