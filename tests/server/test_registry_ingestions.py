"""The ingestions kept beside the rows of a shared registry directory (no store).

Unit checks of the table: an upload records ``ingesting``, a settle only moves forward,
a lapsed lease is claimed by one server alone and a renewed one by none, a row of an older
server reads as ``ready``, a delete drops the entry. Then two real servers on one
``--registry-dir``: the second shows a document the first is still ingesting as
``ingesting``, then ``ready``; after ``kill -9`` of the first mid-ingestion, the second
takes the ingestion over once its lease lapsed. The server tests run in order on one pair;
the last one kills the first server.
"""

from __future__ import annotations

import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import pytest
import requests

from ragserve.commands.serve import CPU_THREAD_ENV
from ragserve.server.document_store import FILENAME, DocumentStore
from ragserve.server.document_watch import INTERVAL_S
from ragserve.server.stored_document import StoredDocument
from tests.server.server_fixtures import (
    BASE_ARGS,
    ServerProcess,
    assert_error,
    wait_for,
    wait_ready,
)

FP = "ab" * 32
KEY = "sk-registry-ingestions"
AUTH = {"Authorization": f"Bearer {KEY}"}
# NOTE: ingested in seconds on two cores (a prefill of many chunks), long enough to read
# its status on the other server while the first is still ingesting it.
LONG_TEXT = " ".join(f"In the orchard book, row {i} bears {i * 11 % 83} pears." for i in range(80))
# Ingested as slowly, sharing none of its blocks.
ORPHAN_TEXT = LONG_TEXT.replace("orchard book", "vineyard roll")
# NOTE: short, so a takeover comes soon; still over two watch rounds, so a live ingestion
# renews its lease in time on a busy machine.
LEASE_S = 5


def doc(doc_id: str = "1" * 32, namespace: str = "tenant") -> StoredDocument:
    return StoredDocument(doc_id, namespace, [5, 6, 7], {}, 1700000000)


def opened(directory: Path, lease_s: float = 10.0) -> DocumentStore:
    store = DocumentStore(directory, FP, lease_s=lease_s)
    store.open()
    return store


# -- the table ------------------------------------------------------------------------------
def test_an_upload_is_ingesting_until_settled_and_a_status_only_moves_forward(
    tmp_path: Path,
) -> None:
    owner, learner = opened(tmp_path), opened(tmp_path)
    owner.put(doc(), ingesting_since=1000.0)
    found = learner.find("tenant", "1" * 32)
    assert found is not None and (found.status, found.error) == ("ingesting", None)
    assert owner.settle("tenant", "1" * 32, "failed", "engine said no")
    found = learner.find("tenant", "1" * 32)
    assert found is not None and (found.status, found.error) == ("failed", "engine said no")
    assert not owner.settle("tenant", "1" * 32, "failed", "later")  # says no more
    assert owner.settle("tenant", "1" * 32, "ready", None)  # a server holding the blocks wins
    assert not owner.settle("tenant", "1" * 32, "failed", "late")
    owner.put(doc())  # a PATCH's row leaves the status be
    assert learner.ingestions_round([], [("tenant", "1" * 32)], 1e12).statuses == {
        ("tenant", "1" * 32): ("ready", None)
    }
    owner.put(doc(), ingesting_since=2000.0)  # an upload again: a new ingestion
    found = learner.find("tenant", "1" * 32)
    assert found is not None and found.status == "ingesting"


def test_a_row_without_an_entry_reads_ready_and_a_delete_drops_the_entry(tmp_path: Path) -> None:
    store = opened(tmp_path)
    store.put(doc("2" * 32))  # as an older server writes it: no entry
    found = store.find("tenant", "2" * 32)
    assert found is not None and found.status == "ready"
    assert not store.settle("tenant", "2" * 32, "failed", "no")  # nothing to move forward
    store.put(doc(), ingesting_since=1000.0)
    assert store.delete("tenant", "1" * 32)
    with sqlite3.connect(tmp_path / FILENAME) as db:
        assert db.execute("SELECT count(*) FROM ingestions").fetchone() == (0,)


def test_a_lapsed_lease_is_claimed_by_one_server_and_a_renewed_one_by_none(
    tmp_path: Path,
) -> None:
    owner, one, two = (opened(tmp_path, lease_s=5.0) for _ in range(3))
    key = ("tenant", "1" * 32)
    owner.put(doc(), ingesting_since=1000.0)  # leased until 1005
    # Renewed every 2 s over three lease lengths: never claimed.
    for now in range(1002, 1016, 2):
        assert owner.ingestions_round([key], [], float(now)).claimed == set()
        round_ = one.ingestions_round([], [key], now + 1.0)
        assert round_.claimed == set() and round_.statuses == {key: ("ingesting", None)}
    # The owner died at 1014 (leased until 1019): two servers claim at once, one wins.
    start = threading.Barrier(2)

    def claim(store: DocumentStore) -> set[tuple[str, str]]:
        start.wait()
        return store.ingestions_round([], [key], 1020.0).claimed

    with ThreadPoolExecutor(2) as pool:
        claims = list(pool.map(claim, (one, two)))
    assert sorted(claims, key=len) == [set(), {key}]
    winner = one if claims[0] else two
    assert winner.ingestions_round([], [key], 1021.0).claimed == set()  # held, by itself too
    assert owner.ingestions_round([], [key], 1021.0).statuses == {key: ("ingesting", None)}
    assert winner.settle(*key, "ready", None)
    assert one.ingestions_round([], [key], 1e12).claimed == set()  # settled: nothing to claim


# -- real servers on one directory ------------------------------------------------------------
class Pair:
    def __init__(self, one: ServerProcess, two: ServerProcess) -> None:
        self.one, self.two = one, two


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    root = tmp_path_factory.mktemp("registry-ingestions")
    flags = (
        "--registry-dir", str(root / "registry"),
        "--ingest-lease-seconds", str(LEASE_S),
        "--api-key", KEY,
    )  # fmt: skip
    # NOTE: started side by side, each with the thread settings it would otherwise
    # restart itself to get (a second interpreter start).
    with ThreadPoolExecutor(2) as pool:
        starting = [pool.submit(_start, flags, root / f"{name}.log") for name in ("one", "two")]
        wait(starting)
    try:
        one, two = (future.result() for future in starting)
        yield Pair(one, two)
    finally:
        for future in starting:
            if future.exception() is None:
                future.result().stop()


def _start(flags: tuple[str, ...], log: Path) -> ServerProcess:
    server = ServerProcess([*BASE_ARGS, *flags], log, env=CPU_THREAD_ENV, start_timeout=180)
    server.scrape_headers = AUTH
    return server.start()


def status(url: str, doc_id: str) -> Any:
    response = requests.get(f"{url}/v1/documents/{doc_id}", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["status"]


def upload(url: str, text: str) -> str:
    response = requests.post(f"{url}/v1/documents", json={"text": text}, headers=AUTH, timeout=120)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


@pytest.mark.e2e
@pytest.mark.slow
def test_the_other_shows_ingesting_until_the_first_is_done(pair: Pair) -> None:
    doc_id = upload(pair.one.url, LONG_TEXT)
    learned = status(pair.two.url, doc_id)  # the other server never saw the upload
    assert status(pair.one.url, doc_id) == "ingesting", "ingested too fast"
    assert learned == "ingesting"
    assert wait_ready(pair.one.url, doc_id, AUTH, timeout=300)["status"] == "ready"
    two = pair.two
    # Within a watch round of the first server's settle (2 s; more on a busy machine).
    assert wait_for(lambda: status(two.url, doc_id) == "ready", 3 * INTERVAL_S, 0.1)


@pytest.mark.e2e
@pytest.mark.slow
def test_a_patch_racing_a_delete_on_the_other_server_never_brings_the_document_back(
    pair: Pair,
) -> None:
    doc_id = upload(pair.one.url, "A short note that is deleted on one server. " * 4)
    assert status(pair.two.url, doc_id)  # the other server learned it
    url = f"/v1/documents/{doc_id}"
    deleted = requests.delete(f"{pair.one.url}{url}", headers=AUTH, timeout=60)
    assert deleted.status_code == 200, deleted.text
    patched = requests.patch(
        f"{pair.two.url}{url}", json={"metadata": {"late": True}}, headers=AUTH, timeout=60
    )  # NOTE: before the second server's next watch round, most often
    assert_error(patched, 404, "document_not_found")
    time.sleep(3 * INTERVAL_S)  # NOTE: watch rounds of both servers
    for server in (pair.one, pair.two):
        gone = requests.get(f"{server.url}{url}", headers=AUTH, timeout=30)
        assert_error(gone, 404, "document_not_found")


@pytest.mark.e2e
@pytest.mark.slow
def test_an_ingestion_whose_server_died_is_taken_over_by_the_other(pair: Pair) -> None:
    """Last: it kills the first server. No document stays ``ingesting`` for good."""
    doc_id = upload(pair.one.url, ORPHAN_TEXT)
    assert status(pair.two.url, doc_id) == "ingesting"
    assert status(pair.one.url, doc_id) == "ingesting", "ingested too fast"
    pair.one.send_signal(signal.SIGKILL)
    pair.one.wait(30)
    # Its lease lapses, the second server claims it at a watch round and ingests the
    # document itself (seconds on two cores).
    two = pair.two
    assert wait_for(
        lambda: status(two.url, doc_id) != "ingesting", LEASE_S + 2 * INTERVAL_S + 60, 0.2
    )
    assert status(two.url, doc_id) == "ready"
    # This one alone: the first document's live ingestion was left alone.
    assert two.metrics().get("ragserve_registry_directory_taken_over_total") == 1
