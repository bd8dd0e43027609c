"""Two engine replicas on a real local Ray instance behind Ray Serve's proxy, sharing a real
valkey-server (the remote KV tier, and the document registry through it: no shared
folder, as on several machines), driven over real HTTP:
a document's questions stay on one replica; a fallback replica serves the document from
the store; a replica killed under load is restarted by Ray and no other request fails."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
import requests

from tests.server.server_fixtures import (
    BASE_ARGS,
    BLOCK_SIZE,
    assert_error,
    parse_metrics,
    wait_for,
)
from tests.valkey_server import ValkeyServer, free_port

ray = pytest.importorskip(
    "ray", reason="ray[serve] is not installed: pip install -e '.[cluster]'", exc_type=ImportError
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPLICA = "X-Ragserve-Replica"
TIMEOUT = 120  # one request's bound: a hang fails the test instead of stalling it


@dataclass
class Cluster:
    url: str

    def stats(self) -> dict[str, Any]:
        response = requests.get(f"{self.url}/cluster/stats", timeout=TIMEOUT)
        assert response.status_code == 200, response.text
        return dict(response.json())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    from ray import serve

    from ragserve.cluster.deployments import application
    from ragserve.cluster.settings import ClusterSettings

    directory = tmp_path_factory.mktemp("cluster")
    store = ValkeyServer(directory)
    store.start()
    port = free_port()
    settings = ClusterSettings(
        replicas=2,
        busy_threshold=1,  # one request in flight makes a replica busy: fallbacks are easy
        replica_cpus=0.5,
        replica_threads=1,
        serve_args=(
            *BASE_ARGS,
            # NOTE: one thread per replica on a shared machine: no admission time budget.
            "--max-queue-seconds",
            "0",
            "--kv-remote-url",
            store.url,
        ),
    )
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application(settings), name="ragserve", route_prefix="/")
        yield Cluster(f"http://127.0.0.1:{port}")
    finally:
        serve.shutdown()
        ray.shutdown()
        store.stop()


def text(topic: str, sentences: int) -> str:
    return " ".join(
        f"Note {n} on the {topic}: the {topic} was inspected on day {n} and found in order."
        for n in range(sentences)
    )


def upload(cluster: Cluster, body: str) -> tuple[dict[str, Any], int]:
    """The document (ready) and the replica it was uploaded to."""
    response = requests.post(f"{cluster.url}/v1/documents", json={"text": body}, timeout=TIMEOUT)
    assert response.status_code == 202, response.text
    doc = response.json()

    def ready() -> bool:
        state = requests.get(f"{cluster.url}/v1/documents/{doc['id']}", timeout=TIMEOUT)
        assert state.status_code == 200, state.text
        assert state.json()["status"] != "failed", state.text
        return bool(state.json()["status"] == "ready")

    assert wait_for(ready, 120, interval=0.2)
    return doc, int(response.headers[REPLICA])


def question(doc_id: str, words: str, **extra: Any) -> dict[str, Any]:
    return {
        "documents": [doc_id],
        "messages": [{"role": "user", "content": words}],
        "max_tokens": 4,
        "temperature": 0,
        **extra,
    }


def ask(cluster: Cluster, body: dict[str, Any]) -> requests.Response:
    return requests.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=TIMEOUT)


def ask_streaming(cluster: Cluster, body: dict[str, Any]) -> Reply:
    with requests.post(
        f"{cluster.url}/v1/chat/completions",
        json={**body, "stream": True},
        timeout=TIMEOUT,
        stream=True,
    ) as response:
        replica = response.headers.get(REPLICA)
        if response.status_code != 200:
            return Reply(response.status_code, replica, [response.text])
        lines = [line.decode() for line in response.iter_lines() if line]
        return Reply(200, replica, lines)


@dataclass
class Reply:
    """Status, the replica that answered (None: none did) and the body's lines (the SSE
    data lines of a stream)."""

    status: int
    replica: str | None
    lines: list[str]

    @property
    def complete(self) -> bool:
        last = self.lines[-1]
        return self.status == 200 and (last == "data: [DONE]" or '"choices"' in last)


def remote_tokens(response: requests.Response) -> int:
    return int(response.json()["usage"]["ragserve_cache"]["cached_tokens_by_tier"].get("remote", 0))


def test_questions_stay_on_their_replica_and_a_fallback_reads_the_store(cluster: Cluster) -> None:
    doc, home = upload(cluster, text("lighthouse", 14))
    other = 1 - home
    before = cluster.stats()["router"]
    for n in range(3):
        answer = ask(cluster, question(doc["id"], f"What was found on day {n}?"))
        assert answer.status_code == 200, answer.text
        assert int(answer.headers[REPLICA]) == home
    after = cluster.stats()["router"]
    assert after["decisions"]["affinity"] - before["decisions"]["affinity"] >= 3
    assert after["decisions"]["fallback"] == before["decisions"]["fallback"]
    assert after["by_replica"].get(str(other), 0) == before["by_replica"].get(str(other), 0)

    # A long answer keeps the home replica busy; the next question falls back.
    long = question(doc["id"], "Tell the whole story.", max_tokens=96, ignore_eos=True)
    with ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(ask_streaming, cluster, long)
        assert wait_for(
            lambda: cluster.stats()["replicas"][home]["in_flight"] >= 1 or streaming.done(), 60
        )
        assert not streaming.done(), "the long answer ended before the fallback could be forced"
        answer = ask(cluster, question(doc["id"], "Who inspected it?"))
        streamed = streaming.result(timeout=TIMEOUT)
    assert answer.status_code == 200, answer.text
    assert int(answer.headers[REPLICA]) == other
    assert cluster.stats()["router"]["decisions"]["fallback"] == after["decisions"]["fallback"] + 1
    # The replica that never saw the document read its blocks from the store.
    assert remote_tokens(answer) > 0
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= remote_tokens(answer)
    assert streamed.complete and int(streamed.replica or -1) == home, streamed.lines[-3:]

    metrics = parse_metrics(requests.get(f"{cluster.url}/metrics", timeout=TIMEOUT).text)
    assert metrics['ragserve_router_decisions_total{decision="fallback"}'] >= 1
    assert metrics[f'ragserve_kv_tier_hits_total{{replica="{other}",tier="remote"}}'] > 0


def test_the_ingress_holds_more_requests_in_flight_than_ray_serves_default(
    cluster: Cluster,
) -> None:
    """Ray Serve admits 5 requests per deployment replica unless told otherwise; the one
    ingress must pass every request on, or the whole cluster batches at most 5."""
    bodies = [
        {
            "messages": [{"role": "user", "content": f"Count to one hundred, take {n}."}],
            "max_tokens": 48,
            "ignore_eos": True,
            "temperature": 0,
        }
        for n in range(8)
    ]

    seen: list[int] = []

    def more_than_five_or_done() -> bool:
        seen.append(sum(replica["in_flight"] for replica in cluster.stats()["replicas"]))
        return seen[-1] > 5 or all(reply.done() for reply in replies)

    with ThreadPoolExecutor(len(bodies)) as pool:
        replies = [pool.submit(ask_streaming, cluster, body) for body in bodies]
        assert wait_for(more_than_five_or_done, 60)
        finished = [reply.result(timeout=TIMEOUT) for reply in replies]
    assert max(seen) > 5, f"at most {max(seen)} requests reached the replicas at once"
    assert all(reply.complete for reply in finished), [r.lines[-2:] for r in finished]


def test_a_replica_killed_under_load_is_restarted_and_nothing_else_fails(
    cluster: Cluster,
) -> None:
    docs: dict[int, dict[str, Any]] = {}
    for n in range(4):  # new documents are spread in turn: one lands on each replica
        doc, replica = upload(cluster, text(f"harbour {n}", 10))
        docs.setdefault(replica, doc)
        if len(docs) == 2:
            break
    assert len(docs) == 2, "uploads did not reach both replicas"
    victim, survivor = 0, 1
    stats = cluster.stats()["replicas"]
    victim_pid = stats[victim]["pid"]

    def on(replica: int, n: int) -> Reply:
        body = question(docs[replica]["id"], f"Question {n}?", max_tokens=24, ignore_eos=True)
        if n % 2:
            return ask_streaming(cluster, body)
        response = ask(cluster, body)
        return Reply(response.status_code, response.headers.get(REPLICA), [response.text])

    with ThreadPoolExecutor(8) as pool:
        before = [pool.submit(on, replica, n) for n in range(3) for replica in (0, 1)]
        assert wait_for(lambda: cluster.stats()["replicas"][victim]["in_flight"] >= 1, 60)
        os.kill(victim_pid, signal.SIGKILL)
        after = [pool.submit(on, replica, n) for n in (3, 4) for replica in (0, 1)]
        sent_before = [f.result(timeout=TIMEOUT) for f in before]
        sent_after = [f.result(timeout=TIMEOUT) for f in after]

    # What the survivor served, and everything sent after the kill, was answered in full.
    for reply in [r for r in sent_before if r.replica == str(survivor)] + sent_after:
        assert reply.complete, (reply.status, reply.replica, reply.lines[-3:])
    # What the victim held was answered or failed cleanly (503, or a stream's error event).
    failed = [r for r in sent_before if not r.complete]
    for reply in failed:
        if reply.status == 200:
            assert reply.replica == str(victim) and "replica_lost" in reply.lines[-1], reply.lines
        else:
            response = requests.Response()
            response.status_code, response._content = reply.status, reply.lines[0].encode()
            assert_error(response, 503, "replica_lost")

    def restarted() -> bool:
        replica = cluster.stats()["replicas"][victim]
        return bool(replica["up"] and replica["pid"] != victim_pid)

    assert wait_for(restarted, 240, interval=1.0)
    answer = ask(cluster, question(docs[victim]["id"], "And after the restart?"))
    assert answer.status_code == 200, answer.text
    assert int(answer.headers[REPLICA]) == victim
    # The new process started empty: the registry in the store named the document (learned
    # at this question) and the store gave back its blocks.
    full = docs[victim]["prefix_tokens"] // BLOCK_SIZE * BLOCK_SIZE
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= full
    metrics = parse_metrics(requests.get(f"{cluster.url}/metrics", timeout=TIMEOUT).text)
    assert metrics[f'ragserve_kv_tier_hits_total{{replica="{victim}",tier="remote"}}'] > 0
