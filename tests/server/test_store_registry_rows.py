"""The registry's rows in a real valkey-server, without a model: what one server
publishes another reads back verified; versions (a PATCH's row is newer, a tombstone
wins over a PATCH), ingestion statuses (a settle only moves a row's status forward, and
only over the row its server holds), ingestion leases (taken by an upload, renewed by
its server, claimed by one server alone once they lapse), tombstones, tampered and foreign
values, values of older formats, tenants, an outage and a store that comes back empty."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from kvstore.remote_store import StoreUnavailable
from ragserve.server.ingest_leases import lease_key
from ragserve.server.registry_cipher import RegistryCipher
from ragserve.server.registry_rows import encode_row
from ragserve.server.store_registry import StoreRegistry, row_key
from ragserve.server.store_values import MAX_ERROR_CHARS, Stamp
from ragserve.server.stored_document import StoredDocument
from tests.valkey_server import ValkeyServer

MODEL = "model-fingerprint"
TENANT, OTHER = "tenant-a", "tenant-b"


def doc(doc_id: str = "ab" * 16, namespace: str = TENANT, **fields: object) -> StoredDocument:
    values: dict[str, object] = {"token_ids": [7, 70000, 3], "metadata": {"k": "v"}}
    values |= fields
    return StoredDocument(doc_id, namespace, created=1_700_000_000, **values)  # type: ignore[arg-type]


def registry(
    url: str, cipher: RegistryCipher | None = None, retry_s: float = 0.1, lease_s: float = 10.0
) -> StoreRegistry:
    return StoreRegistry.connect(
        url, MODEL, cipher, timeout_s=0.5, retry_s=retry_s, lease_s=lease_s
    )


def older_body(entry: StoredDocument) -> bytes:
    """A row's body as servers wrote it before rows carried a status: its JSON head right
    after the stamp line, then its token column."""
    model, namespace, doc_id, blob, metadata, created, expire, digest = encode_row(MODEL, entry)
    head = json.dumps([model, namespace, doc_id, metadata, created, expire, digest])
    return head.encode() + b"\n" + blob


@pytest.fixture
def cipher() -> RegistryCipher:
    return RegistryCipher(os.urandom(32))


def test_a_published_row_is_read_back_by_another_server(
    valkey: ValkeyServer, cipher: RegistryCipher
) -> None:
    one, two = registry(valkey.url, cipher), registry(valkey.url, cipher)
    version = one.publish(doc(expire_time=2e9))
    assert version
    assert two.listed(TENANT) == {"ab" * 16}
    found = two.fetch(TENANT, ["ab" * 16, "cd" * 16])
    assert found == {"ab" * 16: (doc(expire_time=2e9), version)}
    assert two.listed(OTHER) == set() and two.fetch(OTHER, ["ab" * 16]) == {}
    assert one.counts["published"] == 1 and two.counts["rejected"] == 0
    value = valkey.client().get(row_key(MODEL, TENANT, "ab" * 16))
    assert isinstance(value, bytes) and (70000).to_bytes(4, "little") not in value


def test_values_that_do_not_verify_are_counted_and_never_returned(
    valkey: ValkeyServer, cipher: RegistryCipher
) -> None:
    one = registry(valkey.url, cipher)
    one.publish(doc())
    client = valkey.client()
    genuine = client.get(row_key(MODEL, TENANT, "ab" * 16))
    assert isinstance(genuine, bytes)
    client.set(row_key(MODEL, TENANT, "01" * 16), b"garbage")
    client.set(row_key(MODEL, TENANT, "02" * 16), genuine)  # moved to another id
    client.set(row_key(MODEL, OTHER, "ab" * 16), genuine)  # moved to another tenant
    client.set(row_key(MODEL, TENANT, "03" * 16), genuine[:-1] + bytes([genuine[-1] ^ 1]))
    stamp, _, rest = genuine.partition(b"\n")  # a status line that is none
    client.set(
        row_key(MODEL, TENANT, "05" * 16), stamp + b"\nfinished\n" + rest.partition(b"\n")[2]
    )
    plain = registry(valkey.url)  # a server without the key: sealed rows are not served
    assert plain.fetch(TENANT, ["ab" * 16]) == {}
    assert one.fetch(TENANT, ["01" * 16, "02" * 16, "03" * 16, "05" * 16]) == {}
    assert one.fetch(OTHER, ["ab" * 16]) == {}
    other_key = registry(valkey.url, RegistryCipher(os.urandom(32)))
    assert other_key.fetch(TENANT, ["ab" * 16]) == {}
    registry(valkey.url).publish(doc("04" * 16))  # in the clear, where rows are sealed
    assert one.fetch(TENANT, ["04" * 16]) == {}
    assert one.counts["rejected"] == 6
    assert plain.counts["rejected"] == 1 and other_key.counts["rejected"] == 1


def test_a_tombstone_is_seen_and_expires_after_a_day(valkey: ValkeyServer) -> None:
    one, two = registry(valkey.url), registry(valkey.url)
    one.publish(doc())
    assert two.gone([(TENANT, "ab" * 16)]) == set()
    assert one.publish_gone(TENANT, "ab" * 16)
    assert two.gone([(TENANT, "ab" * 16), (TENANT, "cd" * 16)]) == {(TENANT, "ab" * 16)}
    assert two.fetch(TENANT, ["ab" * 16]) == {} and two.listed(TENANT) == set()
    assert 0 < valkey.client().ttl(row_key(MODEL, TENANT, "ab" * 16)) <= 24 * 3600
    one.publish(doc())  # uploaded again: the row replaces the tombstone
    assert two.fetch(TENANT, ["ab" * 16])["ab" * 16][0] == doc()


def test_a_patch_is_newer_and_a_tombstone_wins_over_a_later_patch(valkey: ValkeyServer) -> None:
    one, two = registry(valkey.url), registry(valkey.url)
    key = (TENANT, "ab" * 16)
    uploaded = one.publish(doc())
    patched = two.publish(doc(metadata={"k": "patched"}), patch=True)
    assert uploaded and patched and patched > uploaded  # the store orders them
    assert one.stamps([key, (TENANT, "cd" * 16)]) == {key: Stamp(patched, gone=False)}
    assert one.fetch(TENANT, ["ab" * 16]) == {"ab" * 16: (doc(metadata={"k": "patched"}), patched)}
    assert one.publish_gone(*key)
    stale = two.publish(doc(metadata={"k": "stale"}), patch=True)  # never saw the DELETE
    assert stale is None and two.counts["pending"] == 0  # refused, not failed
    tombstone = one.stamps([key])[key]
    assert tombstone.gone and tombstone.version > patched and one.fetch(TENANT, ["ab" * 16]) == {}
    again = one.publish(doc())  # an upload of the text again replaces the tombstone
    assert again and again > tombstone.version


def test_an_offered_row_replaces_only_an_older_one(valkey: ValkeyServer) -> None:
    """After an outage each server offers the rows it holds at the versions it holds."""
    one, two, three = registry(valkey.url), registry(valkey.url), registry(valkey.url)
    old, new = doc(metadata={"k": "old"}), doc(metadata={"k": "new"})
    version = one.publish(new)
    assert version
    two.retry([(old, version - 1)])  # a server that had not taken the newer row yet
    assert one.fetch(TENANT, ["ab" * 16]) == {"ab" * 16: (new, version)}
    valkey.client().delete(row_key(MODEL, TENANT, "ab" * 16))  # evicted
    three.retry([(old, version - 1)])  # its older copy reaches the store first
    one.retry([(new, version)])
    assert two.fetch(TENANT, ["ab" * 16]) == {"ab" * 16: (new, version)}


def test_a_value_of_the_first_format_reads_as_version_0(valkey: ValkeyServer) -> None:
    one = registry(valkey.url)
    body = older_body(doc())
    valkey.client().set(row_key(MODEL, TENANT, "ab" * 16), b"ragserve-row-v1\n" + body)
    assert one.fetch(TENANT, ["ab" * 16]) == {"ab" * 16: (doc(status="ready"), 0)}
    valkey.client().set(row_key(MODEL, TENANT, "cd" * 16), b"ragserve-gone-v1\n")
    assert one.gone([(TENANT, "ab" * 16), (TENANT, "cd" * 16)]) == {(TENANT, "cd" * 16)}
    assert (one.publish(doc(), patch=True) or 0) > 0


def test_a_row_without_a_status_reads_as_ready(valkey: ValkeyServer) -> None:
    """A row an older server wrote (no status line): it never settles its rows, so
    ``ingesting`` would never end."""
    one, key = registry(valkey.url), (TENANT, "ab" * 16)
    valkey.client().set(row_key(MODEL, *key), b"ragserve-row-v2 1234\n" + older_body(doc()))
    assert one.stamps([key]) == {key: Stamp(1234, gone=False, status="ready")}
    assert one.fetch(TENANT, ["ab" * 16]) == {"ab" * 16: (doc(status="ready"), 1234)}
    assert one.settle(doc(status="failed", error="late"), 1234) is None  # says less
    patched = one.publish(doc(status="ingesting"), patch=True)  # now in the current format
    assert patched and one.stamps([key]) == {key: Stamp(patched, gone=False, status="ingesting")}


def test_a_row_carries_its_status_and_a_settle_only_moves_it_forward(
    valkey: ValkeyServer, cipher: RegistryCipher
) -> None:
    owner, learner = registry(valkey.url, cipher), registry(valkey.url, cipher)
    key = (TENANT, "ab" * 16)
    uploaded = owner.publish(doc(status="ingesting"))
    assert uploaded
    assert learner.stamps([key]) == {key: Stamp(uploaded, gone=False, status="ingesting")}
    assert learner.fetch(TENANT, ["ab" * 16]) == {"ab" * 16: (doc(status="ingesting"), uploaded)}
    assert owner.settle(doc(status="ready"), uploaded - 1) is None  # not the row it holds
    failed = owner.settle(doc(status="failed", error="engine said no"), uploaded)
    assert failed and failed > uploaded
    found = learner.fetch(TENANT, ["ab" * 16])["ab" * 16]
    assert found == (doc(status="failed", error="engine said no"), failed)
    for less in (doc(status="ingesting"), doc(status="failed", error="again")):
        assert owner.settle(less, failed) is None
    ready = owner.settle(doc(status="ready"), failed)  # a server holding the blocks wins
    assert ready and ready > failed and owner.settle(doc(status="failed"), ready) is None
    # A PATCH on the learner that had not taken the settled row yet writes it back as
    # ingesting; the owner settles again over the newer row, keeping the PATCH's metadata.
    stale = learner.publish(doc(status="ingesting", metadata={"k": "patched"}), patch=True)
    assert stale and learner.stamps([key])[key].status == "ingesting"
    assert owner.settle(doc(status="ready"), ready) is None  # the PATCH's row is newer
    taken = owner.fetch(TENANT, ["ab" * 16])["ab" * 16][0]
    again = owner.settle(replace(taken, status="ready"), stale)
    assert again and learner.fetch(TENANT, ["ab" * 16]) == {
        "ab" * 16: (doc(metadata={"k": "patched"}, status="ready"), again)
    }
    assert owner.publish_gone(*key)
    gone = owner.stamps([key])[key]
    assert owner.settle(doc(status="ready"), gone.version) is None  # never over a tombstone
    assert owner.stamps([key]) == {key: gone}
    assert owner.settle(doc("cd" * 16, status="ready"), 0) is None  # nor where no row is
    assert owner.stamps([(TENANT, "cd" * 16)]) == {} and owner.counts["pending"] == 0


def test_a_lapsed_lease_is_claimed_by_one_server_and_a_renewed_one_by_none(
    valkey: ValkeyServer,
) -> None:
    owner, one, two = (registry(valkey.url, lease_s=1.0) for _ in range(3))
    key = (TENANT, "ab" * 16)
    assert owner.publish(doc(status="ingesting"))  # an upload takes the lease
    assert 0 < valkey.client().pttl(lease_key(row_key(MODEL, *key))) <= 1000
    # Renewed every 0.2 s, over three lease lengths: never claimed.
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        assert owner.watch_round([key], renewing=[key]).claimed == set()
        assert one.watch_round([key], claiming=[key]).claimed == set()
        time.sleep(0.2)
    time.sleep(1.2)  # the owner died: its lease lapses
    with ThreadPoolExecutor(2) as pool:
        claims = list(pool.map(lambda r: r.watch_round([], claiming=[key]).claimed, (one, two)))
    assert sorted(claims, key=len) == [set(), {key}]
    winner = one if claims[0] else two
    assert winner.watch_round([], claiming=[key]).claimed == set()  # held, by itself too
    assert owner.watch_round([key]).stamps[key].status == "ingesting"  # claiming writes no row


def test_only_a_row_that_says_ingesting_has_a_lease_to_claim(valkey: ValkeyServer) -> None:
    one, two = registry(valkey.url, lease_s=1.0), registry(valkey.url, lease_s=1.0)
    ready, failed, patched = ("01" * 16, "ready"), ("02" * 16, "failed"), ("03" * 16, "ingesting")
    for doc_id, status in (ready, failed):
        assert one.publish(doc(doc_id, status=status))
    # A PATCH takes no lease: its ingestion runs on another server, which renews its own.
    assert one.publish(doc(patched[0], status=patched[1]), patch=True)
    assert one.publish_gone(TENANT, "04" * 16)
    keys = [(TENANT, doc_id) for doc_id in ("01" * 16, "02" * 16, "03" * 16, "04" * 16, "05" * 16)]
    assert two.watch_round([], claiming=keys).claimed == {(TENANT, patched[0])}


def test_a_long_error_is_cut(valkey: ValkeyServer) -> None:
    one, error = registry(valkey.url), "x" * (MAX_ERROR_CHARS * 3) + "\nsecond line"
    version = one.publish(doc(status="failed", error=error))
    assert version
    found = one.fetch(TENANT, ["ab" * 16])["ab" * 16][0]
    assert (found.status, found.error) == ("failed", error[:MAX_ERROR_CHARS])


def test_an_expiry_leaves_no_tombstone_when_the_store_row_lives_on(valkey: ValkeyServer) -> None:
    one, two = registry(valkey.url), registry(valkey.url)
    one.publish(doc(expire_time=time.time() + 3600))  # PATCHed elsewhere: lives an hour more
    two.publish_expired(TENANT, "ab" * 16, time.time())
    assert two.gone([(TENANT, "ab" * 16)]) == set()
    one.publish(doc(expire_time=time.time() - 1))
    two.publish_expired(TENANT, "ab" * 16, time.time())
    assert two.gone([(TENANT, "ab" * 16)]) == {(TENANT, "ab" * 16)}


def test_an_outage_keeps_writes_pending_and_a_store_back_empty_gets_every_row(
    valkey: ValkeyServer,
) -> None:
    one, two = registry(valkey.url), registry(valkey.url)
    deleted_elsewhere, deleted_here, held = doc("01" * 16), doc("02" * 16), doc("05" * 16)
    for entry in (deleted_elsewhere, deleted_here, held):
        assert one.publish(entry)
    one.retry([(entry, 0) for entry in (deleted_elsewhere, deleted_here, held)])  # none missing
    valkey.kill()
    late = doc("04" * 16)
    assert not one.publish(late)  # the store is down (the caller's row is committed locally)
    assert not one.publish_gone(TENANT, "02" * 16)
    with pytest.raises(StoreUnavailable):  # a third failure opens the breaker
        one.listed(TENANT)
    assert one.counts["pending"] == 2 and one.counts["publish_failures"] == 2
    assert one.settle(replace(held, status="failed"), 1) is None
    assert one.counts["pending"] == 2  # a settle is not kept: the watch settles again
    valkey.start()  # back, and empty
    two.publish_gone(TENANT, "01" * 16)  # deleted through another server meanwhile
    deadline = time.monotonic() + 10
    holding = [(entry, 0) for entry in (deleted_elsewhere, held, late)]
    while one.retry(holding) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert one.counts["pending"] == 0
    assert two.listed(TENANT) == {"04" * 16, "05" * 16}
    found = two.fetch(TENANT, ["01" * 16, "02" * 16, "04" * 16, "05" * 16])
    assert {doc_id: entry for doc_id, (entry, _) in found.items()} == {
        "04" * 16: late,
        "05" * 16: held,
    }
    assert two.gone([(TENANT, "01" * 16), (TENANT, "02" * 16)]) == {
        (TENANT, "01" * 16),
        (TENANT, "02" * 16),
    }


class DurableValkey(ValkeyServer):
    """A store that keeps its data across a restart (every write on disk first)."""

    def _options(self) -> list[str]:
        return [*super()._options(), "--appendonly", "yes", "--appendfsync", "always"]


@pytest.fixture
def durable(tmp_path: Path) -> Iterator[DurableValkey]:
    store = DurableValkey(tmp_path)
    store.start()
    try:
        yield store
    finally:
        store.stop()


def retry_all(one: StoreRegistry) -> None:
    """Retry what is pending until nothing is (10 s at most)."""
    deadline = time.monotonic() + 10
    while one.retry() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert one.counts["pending"] == 0


def test_a_text_uploaded_again_while_the_store_is_down_replaces_its_tombstone_once_back(
    durable: DurableValkey,
) -> None:
    one, two = registry(durable.url), registry(durable.url)
    entry = doc("06" * 16)
    assert one.publish(entry)
    assert one.publish_gone(TENANT, "06" * 16)  # deleted: a tombstone, kept on disk
    durable.kill()
    assert not one.publish(entry)  # uploaded again: kept pending
    durable.start()  # back, with its tombstone
    retry_all(one)
    assert two.listed(TENANT) == {"06" * 16}
    assert two.gone([(TENANT, "06" * 16)]) == set()


def test_an_expiry_while_the_store_is_down_never_tombstones_a_later_patch(
    durable: DurableValkey,
) -> None:
    one, two = registry(durable.url), registry(durable.url)
    doc_id = "07" * 16
    held = one.publish(doc(doc_id, expire_time=time.time() + 0.5))
    assert held
    # PATCHed on the other server: it lives an hour more.
    assert two.publish(doc(doc_id, expire_time=time.time() + 3600), patch=True)
    durable.kill()
    time.sleep(0.6)  # expired on the first server, as it holds it
    assert not one.publish_expired(TENANT, doc_id, time.time(), held)  # kept pending
    durable.start()  # back, with the PATCH's row
    retry_all(one)
    assert two.gone([(TENANT, doc_id)]) == set()
    assert (two.fetch(TENANT, [doc_id])[doc_id][0].expire_time or 0) > time.time() + 3000


def test_an_expiry_of_an_unknown_version_is_checked_again_once_the_store_is_back(
    durable: DurableValkey,
) -> None:
    """A server that restored the documents (versions unknown) while the store was down:
    once back, the store's row decides, as when the store answers at once."""
    one, restored = registry(durable.url), registry(durable.url)
    expired, patched = "08" * 16, "09" * 16
    assert one.publish(doc(expired, expire_time=time.time() + 0.5))
    assert one.publish(doc(patched, expire_time=time.time() + 3600))  # PATCHed: lives on
    durable.kill()
    time.sleep(0.6)
    for doc_id in (expired, patched):
        assert not restored.publish_expired(TENANT, doc_id, time.time())  # by its own row
    assert restored.counts["pending"] == 2
    durable.start()
    retry_all(restored)
    assert one.gone([(TENANT, expired), (TENANT, patched)]) == {(TENANT, expired)}
