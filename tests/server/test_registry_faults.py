"""Real servers against a damaged registry, a ``kill -9`` and a second server.

- one damaged row: the server starts, reports it, and every other document is listed and
  answers from its cached blocks;
- ``kill -9`` during a burst of uploads and deletes: after a restart the registry holds
  every document whose upload returned and none whose delete returned;
- two servers on one directory: the uploads of both are all there after a restart;
- a registry whose drive is full: uploads and deletes still answer, their rows are
  written once there is room, and a restart keeps the one and not the other.
"""

from __future__ import annotations

import errno
import signal
import sqlite3
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from ragserve.server.document_store import FILENAME
from ragserve.server.document_watch import INTERVAL_S
from tests.kvstore.test_tier_faults import mount_tmpfs
from tests.server.server_fixtures import (
    BLOCK_SIZE,
    running_server,
    start_server,
    wait_for,
    wait_ready,
)
from tests.server.test_document_purge import files_holding, grams, needles, stored_tokens

pytestmark = pytest.mark.e2e

KEY = "sk-registry-faults"
AUTH = {"Authorization": f"Bearer {KEY}"}


def tier(directory: Path) -> tuple[str, ...]:
    return ("--kv-disk-gib", "0.2", "--kv-disk-dir", str(directory), "--api-key", KEY)


def text(topic: str, count: int = 20) -> str:
    return " ".join(
        f"In the {topic} ledger, entry {i} reads {(i * 13 + len(topic)) % 97}."
        for i in range(count)
    )


def upload(url: str, body: str) -> requests.Response:
    return requests.post(f"{url}/v1/documents", json={"text": body}, headers=AUTH, timeout=120)


def listed(url: str) -> set[str]:
    response = requests.get(f"{url}/v1/documents", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    return {doc["id"] for doc in response.json()["data"]}


def cached_tokens(url: str, doc_id: str) -> int:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "What does entry 3 read?"}],
        "documents": [doc_id],
        "max_tokens": 2,
    }
    response = requests.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_a_damaged_row_loses_that_document_alone(tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    topics = ["amber", "birch", "cedar", "dune"]
    with running_server(*tier(kv), log_path=tmp_path / "first.log") as first:
        docs = [upload(first.url, text(topic)).json() for topic in topics]
        for doc in docs:
            assert wait_ready(first.url, doc["id"], AUTH)["status"] == "ready"
    victim = docs[1]["id"]
    db = sqlite3.connect(kv / FILENAME)
    (blob,) = db.execute("SELECT token_ids FROM documents WHERE id = ?", (victim,)).fetchone()
    db.close()
    raw = bytearray((kv / FILENAME).read_bytes())
    at = raw.index(blob) + len(blob) // 2  # 8 bytes in the middle of the row's tokens
    raw[at : at + 8] = b"\xff" * 8
    (kv / FILENAME).write_bytes(bytes(raw))

    with running_server(*tier(kv), log_path=tmp_path / "second.log") as second:
        assert listed(second.url) == {doc["id"] for doc in docs} - {victim}
        assert "dropped" in second.log() or "integrity check failed" in second.log()
        for doc in docs:
            if doc["id"] != victim:
                assert wait_ready(second.url, doc["id"], AUTH)["status"] == "ready"
                full = doc["tokens"] // BLOCK_SIZE * BLOCK_SIZE
                assert cached_tokens(second.url, doc["id"]) >= full - BLOCK_SIZE


def test_kill_9_during_uploads_and_deletes(tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    uploaded: set[str] = set()
    deleted: set[str] = set()
    deleting: set[str] = set()
    lock = threading.Lock()
    stop = threading.Event()
    server = start_server(*tier(kv), log_path=tmp_path / "first.log")
    try:

        def worker(number: int) -> None:
            round_ = 0
            while not stop.is_set():
                round_ += 1
                try:
                    response = upload(server.url, text(f"w{number}r{round_}", 6))
                except requests.RequestException:
                    return
                if response.status_code not in (200, 202):
                    continue
                doc_id = response.json()["id"]
                with lock:
                    uploaded.add(doc_id)
                if round_ % 2:
                    continue
                with lock:
                    deleting.add(doc_id)  # from now on either outcome is right
                try:
                    gone = requests.delete(
                        f"{server.url}/v1/documents/{doc_id}", headers=AUTH, timeout=60
                    )
                except requests.RequestException:
                    return
                if gone.status_code == 200:
                    with lock:
                        deleted.add(doc_id)

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(worker, n) for n in range(4)]
            threading.Event().wait(6.0)
            server.send_signal(signal.SIGKILL)
            stop.set()
            server.wait(30)
            for future in futures:
                future.result()
    finally:
        server.stop()
    assert len(uploaded) >= 4 and deleted

    with running_server(*tier(kv), log_path=tmp_path / "second.log") as second:
        present = listed(second.url)
    assert uploaded - deleting <= present
    assert not present & deleted
    assert "integrity check failed" not in (tmp_path / "second.log").read_text()


def test_two_servers_on_one_directory(tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    ids: set[str] = set()
    with (
        running_server(*tier(kv), log_path=tmp_path / "a.log") as one,
        running_server(*tier(kv), log_path=tmp_path / "b.log") as two,
    ):
        for number in range(6):
            response = upload((one if number % 2 else two).url, text(f"shared{number}", 6))
            assert response.status_code == 202, response.text
            ids.add(response.json()["id"])
    with running_server(*tier(kv), log_path=tmp_path / "c.log") as again:
        assert listed(again.url) == ids


def test_a_kill_9_during_a_delete_never_leaves_a_deleted_documents_kv(tmp_path: Path) -> None:
    """The DELETE's purge is an engine call: it waits for the step running (here, a long
    prompt's). Killed the moment its row is gone, the server comes back with the
    document listed or with none of its KV on disk, never a deleted document whose KV
    stays with nothing to say it should go."""
    kv = tmp_path / "kv"
    server = start_server(*tier(kv), log_path=tmp_path / "first.log")
    try:
        doc = upload(server.url, text("quill", 40)).json()
        assert wait_ready(server.url, doc["id"], AUTH)["status"] == "ready"
        tokens = stored_tokens(kv)[doc["id"]]
        patterns = needles(grams(tokens))
        assert files_holding(kv, patterns)  # its blocks reached the disk tier

        def busy() -> None:  # NOTE: keeps the engine in long steps while the DELETE runs
            body: dict[str, Any] = {"prompt": text("lathe", 300), "max_tokens": 1}
            try:
                requests.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=120)
            except requests.RequestException:
                return  # killed

        def delete() -> None:
            try:
                requests.delete(f"{server.url}/v1/documents/{doc['id']}", headers=AUTH, timeout=120)
            except requests.RequestException:
                return  # killed

        with ThreadPoolExecutor(2) as pool:
            pool.submit(busy)
            threading.Event().wait(0.5)
            pool.submit(delete)
            for _ in range(3000):
                if doc["id"] not in stored_tokens(kv):
                    break
                threading.Event().wait(0.01)
            server.send_signal(signal.SIGKILL)
            server.wait(30)
    finally:
        server.stop()

    with running_server(*tier(kv), log_path=tmp_path / "second.log") as second:
        if doc["id"] in listed(second.url):
            return  # NOTE: the DELETE was not answered: the document lives on, KV and all
        assert files_holding(kv, patterns) == []


def fill(directory: Path) -> Path:
    """A file that takes every free byte of ``directory``'s drive."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as out:
        try:
            while True:
                out.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler


def rows(registry: Path) -> set[str]:
    db = sqlite3.connect(registry / FILENAME)
    try:
        return {doc_id for (doc_id,) in db.execute("SELECT id FROM documents")}
    finally:
        db.close()


def test_rows_that_a_full_drive_refused_are_written_once_there_is_room(tmp_path: Path) -> None:
    registry = tmp_path / "registry"
    mount_tmpfs(registry, "size=2m")
    args = (*tier(tmp_path / "kv"), "--registry-dir", str(registry))
    try:
        with running_server(*args, log_path=tmp_path / "first.log") as server:
            gone, patched = (upload(server.url, text(t)).json()["id"] for t in ("slate", "umber"))
            for doc_id in (gone, patched):
                assert wait_ready(server.url, doc_id, AUTH)["status"] == "ready"
            filler = fill(registry)
            kept = upload(server.url, text("tallow")).json()["id"]
            assert wait_ready(server.url, kept, AUTH)["status"] == "ready"
            deleted = requests.delete(f"{server.url}/v1/documents/{gone}", headers=AUTH, timeout=60)
            assert deleted.status_code == 200, deleted.text
            changed = requests.patch(
                f"{server.url}/v1/documents/{patched}",
                json={"metadata": {"shelf": "B"}},
                headers=AUTH,
                timeout=60,
            )
            assert changed.status_code == 200, changed.text
            assert listed(server.url) == {kept, patched}
            assert rows(registry) == {gone, patched}  # none of the three reached it
            assert "document not saved" in server.log()
            # Watch rounds while the drive stays full: the deleted document's row is still
            # there, and it is not learned back from it (nor by asking for it).
            threading.Event().wait(3 * INTERVAL_S)
            asked = requests.get(f"{server.url}/v1/documents/{gone}", headers=AUTH, timeout=30)
            assert asked.status_code == 404, asked.text
            assert listed(server.url) == {kept, patched}
            filler.unlink()
            assert wait_for(lambda: rows(registry) == {kept, patched}, 20), rows(registry)
        with running_server(*args, log_path=tmp_path / "second.log") as again:
            assert listed(again.url) == {kept, patched}
            assert wait_ready(again.url, kept, AUTH)["status"] == "ready"
            shown = requests.get(f"{again.url}/v1/documents/{patched}", headers=AUTH, timeout=30)
            assert shown.json()["metadata"] == {"shelf": "B"}, shown.text
    finally:
        subprocess.run(["umount", "-l", str(registry)], check=False)
