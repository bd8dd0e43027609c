"""The document registry survives a restart, damage and several servers on one directory.

Unit checks of the SQLite store (round trip, damaged rows and pages, a foreign schema,
migration of the JSON registry, file modes), then real servers on one directory: upload,
stop, start again: the document is listed, becomes ready, and a question on it finds its
blocks cached; a damaged database never stops start-up.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import requests

from ragserve.engine.engine_info import KVModel
from ragserve.server.document_store import FILENAME, DocumentStore
from ragserve.server.legacy_registry import FORMAT, VERSION, checksum, legacy_path
from ragserve.server.registry_models import ModelRecord
from ragserve.server.stored_document import StoredDocument
from tests.server.server_fixtures import BLOCK_SIZE, running_server, wait_for, wait_ready

KEY = "sk-registry-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
DOC = " ".join(
    f"Clause {i}: the tenant returns the keys on the last day of the lease." for i in range(24)
)
FP = "ab" * 32


def stored(doc_id: str = "0" * 32, namespace: str = "", tokens: int = 3) -> StoredDocument:
    first = 5 + int(doc_id, 16) % 1000 * 1000  # distinct tokens per id, to find its bytes
    ids = list(range(first, first + tokens))
    return StoredDocument(doc_id, namespace, ids, {"title": "t", "n": 1.5}, 1700000000)


def opened(directory: Path, model: str = FP) -> DocumentStore:
    store = DocumentStore(directory, model)
    store.open()
    return store


# -- the database ---------------------------------------------------------------------------
def test_round_trip_and_one_row_per_document(tmp_path: Path) -> None:
    store = opened(tmp_path)
    assert store.load() == []
    docs = [stored("1" * 32, "tenant-a"), stored("2" * 32)]
    for doc in docs:
        store.put(doc)
    later = StoredDocument("3" * 32, "t", [1, 2**32 - 1], {}, 1, expire_time=1700000123.5)
    store.put(later)
    assert store.load() == [*docs, later]
    assert store.delete("tenant-a", "1" * 32) and not store.delete("tenant-a", "1" * 32)
    store.put(StoredDocument("2" * 32, "", [9], {"new": True}, 5))  # replaces, keeps its place
    assert [d.token_ids for d in store.load()] == [[9], [1, 2**32 - 1]]
    assert opened(tmp_path, "cd" * 32).load() == []  # another model's rows are not listed
    store.close()
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    for path in tmp_path.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def fits_all(doc: StoredDocument) -> bool:
    return True


def test_rows_of_a_model_with_the_same_tokenizer_are_copied(tmp_path: Path) -> None:
    old_kv = KVModel(FP, 16, "float32")
    old = DocumentStore(tmp_path, FP, record=ModelRecord(old_kv, "tok-1"))
    old.open()
    mine, theirs, kept = stored("1" * 32, "a"), stored("2" * 32, "b"), stored("3" * 32, "a")
    for doc in (mine, theirs, kept):
        old.put(doc)
    other_kv = KVModel("cd" * 32, 16, "float32")
    other_tokenizer = DocumentStore(tmp_path, "cd" * 32, record=ModelRecord(other_kv, "tok-2"))
    other_tokenizer.open()
    assert other_tokenizer.adopt({"a", "b"}, fits_all) == []  # its ids would mean other text
    new_kv = KVModel("ef" * 32, 32, "bfloat16")
    new = DocumentStore(tmp_path, "ef" * 32, record=ModelRecord(new_kv, "tok-1"))
    new.open()
    new.put(kept)  # already its own
    assert new.adopt({"a"}, fits_all) == [(mine, old_kv)]  # tenant b is not served here
    assert new.load() == [kept, mine]
    # Copied, not moved: a server of the old model on this directory keeps its documents.
    assert old.load() == [mine, theirs, kept]
    assert new.adopt({"a"}, fits_all) == []
    assert new.keys() == {("a", kept.id), ("a", mine.id)} and new.has("a", mine.id)
    assert new.sharing_models() == [old_kv] and old.sharing_models() == [new_kv]
    # A DELETE removes the document's row under every model.
    assert new.delete("a", kept.id)
    assert old.load() == [mine, theirs] and new.load() == [mine]


def test_a_row_that_does_not_fit_is_not_copied(tmp_path: Path) -> None:
    old = DocumentStore(tmp_path, FP, record=ModelRecord(KVModel(FP, 16, "float32"), "tok"))
    old.open()
    small, large = stored("1" * 32, tokens=3), stored("2" * 32, tokens=50)
    old.put(small)
    old.put(large)
    new = DocumentStore(tmp_path, "ef" * 32, record=ModelRecord(KVModel("ef" * 32, 16, "f"), "tok"))
    new.open()
    adopted = new.adopt({""}, lambda doc: len(doc.token_ids) < 10)
    assert [doc for doc, _ in adopted] == [small]
    assert new.load() == [small]  # the large one stays the old model's alone
    assert old.load() == [small, large]


def test_expiry_deletes_only_the_rows_whose_own_time_passed(tmp_path: Path) -> None:
    old_kv, new_kv, third_kv = (KVModel(fp * 32, 16, "float32") for fp in ("ab", "ef", "99"))
    stores = [
        DocumentStore(tmp_path, kv.fingerprint, record=ModelRecord(kv, "tok"))
        for kv in (old_kv, new_kv, third_kv)
    ]
    for store in stores:
        store.open()
    old, new, third = stores
    doc = stored("1" * 32)
    old.put(StoredDocument(doc.id, "", doc.token_ids, {}, 1, expire_time=100.0))
    new.put(StoredDocument(doc.id, "", doc.token_ids, {}, 1, expire_time=100.0))
    third.put(StoredDocument(doc.id, "", doc.token_ids, {}, 1, expire_time=500.0))  # PATCHed
    assert new.expired_models("", doc.id, 200.0) == [old_kv]  # read first: nothing goes
    assert len(old.load()) == 1
    assert new.delete_expired("", doc.id, 200.0) == [old_kv]  # and its own row
    assert old.load() == [] and new.load() == []
    assert [d.expire_time for d in third.load()] == [500.0]
    assert new.delete_expired("", doc.id, 200.0) == []


def test_two_stores_on_one_directory_share_it(tmp_path: Path) -> None:
    first, second = opened(tmp_path), opened(tmp_path)
    for number in range(20):
        (first if number % 2 else second).put(stored(f"{number:032x}"))
    assert first.delete("", f"{4:032x}")
    assert [d.id for d in opened(tmp_path).load()] == [f"{n:032x}" for n in range(20) if n != 4]


def _row_bytes(doc: StoredDocument) -> bytes:
    from ragserve.server.registry_rows import encode_row

    return encode_row(FP, doc)[3]  # the token blob


def test_a_damaged_row_is_reported_and_dropped_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = opened(tmp_path)
    docs = [stored(f"{n:032x}", tokens=200 + n) for n in range(6)]
    for doc in docs:
        store.put(doc)
    store.close()
    raw = bytearray(store.path.read_bytes())
    blob = _row_bytes(docs[2])
    at = raw.index(blob) + len(blob) // 2
    raw[at : at + 8] = b"\xff" * 8  # 8 bytes in the middle of one row
    store.path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        again = opened(tmp_path)
        assert again.load() == docs[:2] + docs[3:]
    assert "checksum mismatch" in caplog.text
    assert opened(tmp_path).load() == docs[:2] + docs[3:]  # dropped for good, nothing else


def test_a_damaged_page_loses_only_its_rows(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = opened(tmp_path)
    docs = [stored(f"{n:032x}", tokens=400) for n in range(30)]  # about 2 rows a page
    for doc in docs:
        store.put(doc)
    store.close()
    raw = bytearray(store.path.read_bytes())
    page_size = int.from_bytes(raw[16:18], "big")
    victim = raw.index(_row_bytes(docs[15])) // page_size
    raw[victim * page_size : (victim + 1) * page_size] = b"\x5a" * page_size
    store.path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        repaired = opened(tmp_path)
        kept = repaired.load()
    assert "integrity check failed" in caplog.text
    assert docs[15] not in kept and all(doc in docs for doc in kept)
    assert len(kept) >= len(docs) - 4  # a page holds a few rows
    repaired.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert opened(tmp_path).load() == kept
    assert caplog.text == ""  # repaired: the next start finds nothing wrong


def test_a_rebuild_keeps_the_models_table(tmp_path: Path) -> None:
    kv = KVModel("cd" * 32, 16, "bfloat16")
    store = DocumentStore(tmp_path, "cd" * 32, record=ModelRecord(kv, "tok"))
    store.open()
    docs = [stored(f"{n:032x}", tokens=400) for n in range(30)]
    for doc in docs:
        store.put(doc)
    store.close()
    raw = bytearray(store.path.read_bytes())
    page_size = int.from_bytes(raw[16:18], "big")
    victim = raw.index(_row_bytes(docs[15])) // page_size
    raw[victim * page_size : (victim + 1) * page_size] = b"\x5a" * page_size
    store.path.write_bytes(bytes(raw))
    # Another model's server starts: it repairs, and still knows the first model's KV.
    other = DocumentStore(tmp_path, FP, record=ModelRecord(KVModel(FP, 16, "float32"), "tok"))
    assert any("integrity check failed" in problem for problem in other.open())
    assert other.sharing_models() == [kv]


def test_a_crash_before_the_log_is_truncated_leaves_no_deleted_row(tmp_path: Path) -> None:
    """Killed between a delete's commit and its checkpoint, the log keeps the row's old
    pages; the next open truncates it."""
    doc = stored(tokens=300)
    crash = f"""
import os, signal, sqlite3, sys
sys.path.insert(0, {str(Path.cwd())!r})
from tests.server.test_registry import opened, stored
from pathlib import Path
store = opened(Path({str(tmp_path)!r}))
store.put(stored(tokens=300))
db = sqlite3.connect(store.path, isolation_level=None)
db.execute("PRAGMA secure_delete=ON")
db.execute("DELETE FROM documents")
os.kill(os.getpid(), signal.SIGKILL)
"""
    assert subprocess.run([sys.executable, "-c", crash], timeout=60).returncode == -9
    blob = _row_bytes(doc)
    log = tmp_path / f"{FILENAME}-wal"
    assert blob in log.read_bytes()  # the crash left the old pages behind
    assert opened(tmp_path).load() == []
    assert all(blob not in path.read_bytes() for path in tmp_path.iterdir() if path.is_file())


def test_unusable_or_newer_databases_start_afresh(tmp_path: Path) -> None:
    (tmp_path / FILENAME).write_bytes(b"not a database at all" * 300)
    store = opened(tmp_path)
    assert store.load() == []
    store.put(stored())
    assert opened(tmp_path).load() == [stored()]
    store.close()
    db = sqlite3.connect(tmp_path / FILENAME)
    db.execute("PRAGMA user_version=99")
    db.close()
    assert opened(tmp_path).load() == []
    assert (tmp_path / f"{FILENAME}.unusable").exists()  # kept for the newer server


def test_the_json_registry_is_migrated_once(tmp_path: Path) -> None:
    good = {"id": "1" * 32, "namespace": "a", "token_ids": [5, 6], "metadata": {}, "created": 3}
    entries: list[Any] = [good, {**good, "id": "not-hex"}]
    body = {"format": FORMAT, "version": VERSION, "model": FP, "checksum": checksum(entries)}
    path = legacy_path(tmp_path, FP)
    path.write_text(json.dumps({**body, "documents": entries}))
    store = opened(tmp_path)
    assert store.load() == [StoredDocument("1" * 32, "a", [5, 6], {}, 3)]
    assert not path.exists()  # its token ids must not outlive a DELETE
    assert opened(tmp_path).load() == store.load()


# -- real servers --------------------------------------------------------------------------
def question(url: str, doc_id: str) -> dict[str, object]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Who returns the keys?"}],
        "documents": [doc_id],
        "max_tokens": 2,
    }
    response = requests.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    usage: dict[str, object] = response.json()["usage"]
    return usage


@pytest.mark.e2e
@pytest.mark.slow
def test_documents_survive_a_restart(tmp_path: Path) -> None:
    tier = ("--kv-disk-gib", "0.1", "--kv-disk-dir", str(tmp_path / "kv"), "--api-key", KEY)
    with running_server(*tier, log_path=tmp_path / "first.log") as first:
        upload = requests.post(
            f"{first.url}/v1/documents",
            json={"text": DOC, "metadata": {"title": "lease"}},
            headers=AUTH,
            timeout=60,
        )
        assert upload.status_code == 202, upload.text
        doc = wait_ready(first.url, upload.json()["id"], AUTH)
        assert doc["status"] == "ready"
    registry = tmp_path / "kv" / FILENAME
    assert registry.exists()

    with running_server(*tier, log_path=tmp_path / "second.log") as second:
        listed = requests.get(f"{second.url}/v1/documents", headers=AUTH, timeout=30).json()
        assert [d["id"] for d in listed["data"]] == [doc["id"]]
        again = wait_ready(second.url, doc["id"], AUTH)
        assert again["status"] == "ready"
        for field in ("tokens", "prefix_tokens", "created", "metadata"):
            assert again[field] == doc[field], field
        full_blocks = int(doc["tokens"]) // BLOCK_SIZE * BLOCK_SIZE
        details = question(second.url, doc["id"])["prompt_tokens_details"]
        assert isinstance(details, dict) and details["cached_tokens"] >= full_blocks
        metrics = second.metrics()
        # Re-ingestion read the blocks back from disk instead of computing them.
        assert metrics['ragserve_kv_tier_hits_total{tier="disk"}'] >= full_blocks // BLOCK_SIZE - 2
        assert "1 documents restored" in second.log()
        # A delete is saved too: a third start has nothing to restore.
        gone = requests.delete(f"{second.url}/v1/documents/{doc['id']}", headers=AUTH, timeout=30)
        assert gone.status_code == 200
    assert opened(tmp_path / "kv", _fingerprint(registry)).load() == []

    # Unusable: start-up logs it, serves, and the next upload writes a good database again.
    for path in (tmp_path / "kv").glob(FILENAME + "*"):
        path.unlink()
    registry.write_bytes(b"SQLite format 3\x00" + b"\x07" * 5000)
    with running_server(*tier, log_path=tmp_path / "third.log") as third:
        assert requests.get(f"{third.url}/health", timeout=30).status_code == 200
        listed = requests.get(f"{third.url}/v1/documents", headers=AUTH, timeout=30).json()
        assert listed["data"] == []
        assert "started afresh" in third.log()
        upload = requests.post(
            f"{third.url}/v1/documents", json={"text": DOC}, headers=AUTH, timeout=60
        )
        assert upload.status_code == 202
    assert [d.id for d in opened(tmp_path / "kv", _fingerprint(registry)).load()] == [doc["id"]]


@pytest.mark.e2e
def test_a_document_the_pin_budget_leaves_unpinned_is_written_to_disk(tmp_path: Path) -> None:
    """Ingestion writes a document's blocks through to the disk tier as it computes them,
    not only when it can pin them: a restart finds them there."""
    tier = ("--kv-disk-gib", "0.1", "--kv-disk-dir", str(tmp_path / "kv"), "--api-key", KEY)
    no_pins = ("--tenant-pin-share", "0.001")  # NOTE: not one block: nothing is pinned
    with running_server(*tier, *no_pins, log_path=tmp_path / "first.log") as first:
        upload = requests.post(
            f"{first.url}/v1/documents", json={"text": DOC}, headers=AUTH, timeout=60
        )
        assert upload.status_code == 202, upload.text
        doc = wait_ready(first.url, upload.json()["id"], AUTH)
        assert doc["status"] == "ready" and doc["pinned_tokens"] == 0
        full_blocks = int(doc["prefix_tokens"]) // BLOCK_SIZE

        def on_disk() -> bool:
            state = requests.get(f"{first.url}/v1/documents/{doc['id']}", headers=AUTH, timeout=30)
            return bool(state.json()["kv_blocks"].get("disk", 0) >= full_blocks)

        assert wait_for(on_disk, 30, interval=0.2)
    with running_server(*tier, *no_pins, log_path=tmp_path / "second.log") as second:
        details = question(second.url, doc["id"])["prompt_tokens_details"]
        assert details["cached_tokens"] >= full_blocks * BLOCK_SIZE  # type: ignore[index]
        assert second.metrics()['ragserve_kv_tier_hits_total{tier="disk"}'] >= full_blocks - 2


def _fingerprint(registry: Path) -> str:
    """The model fingerprint the server wrote its rows under (one model in these tests)."""
    db = sqlite3.connect(registry)
    try:
        models = {row[0] for row in db.execute("SELECT model FROM documents")}
        if not models:
            return FP
        assert len(models) == 1
        return str(models.pop())
    finally:
        db.close()


def test_encrypted_rows_hide_their_tokens_and_wait_for_their_key(tmp_path: Path) -> None:
    from ragserve.server.registry_cipher import RegistryCipher

    key, other = RegistryCipher(b"k" * 32), RegistryCipher(b"o" * 32)
    store = DocumentStore(tmp_path, FP, key)
    store.open()
    doc = StoredDocument("7" * 32, "tenant-a", [70001, 70002, 70003], {"secret": "plans"}, 5)
    store.put(doc)
    store.close()
    raw = b"".join(p.read_bytes() for p in tmp_path.iterdir())
    assert (
        b"plans" not in raw
        and (70001).to_bytes(4, "little") + (70002).to_bytes(4, "little") not in raw
    )
    for cipher in (None, other):  # no key, another key: not served, never dropped
        locked = DocumentStore(tmp_path, FP, cipher)
        locked.open()
        assert locked.load() == []
        locked.close()
    again = DocumentStore(tmp_path, FP, key)
    again.open()
    assert again.load() == [doc]
