"""The router's decisions and the routing key, alone (no Ray: they are plain code)."""

from __future__ import annotations

import json

import pytest

from ragserve.cluster.affinity_key import LEAD_CHARS, routing_key
from ragserve.cluster.router import Router

UP = [True, True]


def test_a_key_stays_on_its_replica_until_that_replica_is_busy() -> None:
    router = Router(2, "affinity", busy_threshold=2)
    home = router.choose("doc:a", [0, 0], UP)
    assert [router.choose("doc:a", [1, 0] if home == 0 else [0, 1], UP) for _ in range(3)] == [
        home
    ] * 3
    busy = [0, 0]
    busy[home] = 2
    assert router.choose("doc:a", busy, UP) == 1 - home
    assert router.choose("doc:a", [0, 0], UP) == home  # back once it is free
    decisions = router.stats.as_json()["decisions"]
    assert decisions == {"affinity": 4, "new": 1, "fallback": 1, "unkeyed": 0, "round_robin": 0}


def test_a_down_replica_is_routed_around_and_new_keys_spread() -> None:
    router = Router(2, "affinity", busy_threshold=4)
    homes = {router.choose(f"doc:{n}", [0, 0], UP) for n in range(2)}
    assert homes == {0, 1}
    owner = router.owner("doc:0")
    assert owner is not None
    up = [True, True]
    up[owner] = False
    assert router.choose("doc:0", [0, 0], up) == 1 - owner
    assert router.stats.decisions["fallback"] == 1


def test_round_robin_ignores_keys() -> None:
    router = Router(2, "round_robin", busy_threshold=4)
    assert [router.choose("doc:a", [0, 0], UP) for _ in range(4)] == [0, 1, 0, 1]


def test_routing_keys() -> None:
    chat = {"messages": [{"role": "user", "content": "x" * LEAD_CHARS + "tail one"}]}
    other = {"messages": [{"role": "user", "content": "x" * LEAD_CHARS + "tail two"}]}
    key = routing_key("/v1/chat/completions", json.dumps(chat).encode())
    assert key is not None and key.startswith("text:")
    assert key == routing_key("/v1/chat/completions", json.dumps(other).encode())
    d1, d2 = "1" * 32, "2" * 32
    named = {"documents": [d1, d2], "messages": [{"role": "user", "content": "q"}]}
    assert routing_key("/v1/chat/completions", json.dumps(named).encode()) == f"doc:{d1}"
    assert routing_key("/v1/completions", b'{"prompt": ["abc"]}') == routing_key(
        "/v1/completions", b'{"prompt": "abc"}'
    )
    assert routing_key(f"/v1/documents/{d1}", b"") == f"doc:{d1}"
    assert routing_key("/v1/documents", b'{"text": "t"}') is None
    assert routing_key("/v1/completions", b"not json") is None
    # Bodies the replica refuses are no key: nested past the parser's depth, or naming an
    # id of no document's form (the router keeps keys: a client must not size them).
    assert routing_key("/v1/chat/completions", b"[" * 100_000) is None
    huge = {"documents": ["x" * 1_000_000], "messages": [{"role": "user", "content": "q"}]}
    assert routing_key("/v1/chat/completions", json.dumps(huge).encode()) is None
    assert routing_key("/v1/documents/" + "x" * 1000, b"") is None


def test_reports_need_a_key_when_the_replicas_have_keys() -> None:
    import asyncio

    pytest.importorskip(
        "starlette",
        reason="starlette comes with ray[serve] (the cluster extra)",
        exc_type=ImportError,
    )
    from ragserve.cluster.forwarder import Forwarder
    from ragserve.cluster.settings import ClusterSettings, report_keys

    assert report_keys(("--kv-cache-gib", "1")) == frozenset()
    args = ("--api-key", "sk-a", "--api-key", "sk-b", "--metrics-key", "sk-m")
    assert report_keys(args) == {"sk-m"}  # the metrics key alone, when there is one
    assert report_keys(args[:4]) == {"sk-a", "sk-b"}

    async def no_lookup(index: int) -> dict[str, object]:
        raise AssertionError("a report asks no replica for its address")

    async def statuses() -> list[int]:
        forwarder = Forwarder(ClusterSettings(serve_args=args), no_lookup)
        codes = []
        for headers in (
            {},
            {"authorization": "Bearer sk-x"},
            {"authorization": "Bearer sk-m"},
            {"authorization": "Bearer sk-a"},  # a tenant's key: no server-wide counts
            {"authorization": "bearer sk-m"},  # the scheme in any case, as replicas take it
        ):
            response = await forwarder.handle("GET", "/cluster/stats", "", headers, b"")
            codes.append(response.status_code)
        await forwarder.close()
        return codes

    assert asyncio.run(statuses()) == [401, 401, 200, 401, 200]
