"""``ragserve bench serve``: document QA over HTTP against a real ``ragserve serve``."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp

from ragserve.bench import serve_fairness
from ragserve.bench.common import for_its_device, write_json
from ragserve.bench.serve_client import (
    RequestResult,
    chat_body,
    document_text,
    percentile,
    question,
    stream_chat,
    upload_document,
    wait_healthy,
)
from ragserve.cli import CliError
from ragserve.config import EngineConfig
from ragserve.config_flags import to_argv
from ragserve.server.process import ServerProcess, ServerStartError
from ragserve.table import print_table

HOST = "127.0.0.1"
OVERHEAD_TARGET = 1.2
MAX_CONCURRENCY = 1024
MAX_REQUESTS_PER_LEVEL = 100_000
MIN_DOC_TOKENS = 32
OVERHEAD_QUESTION = "In one word: is this document a maintenance manual?"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--concurrency", default="1,4,16,32", help="comma-separated client concurrency levels"
    )
    parser.add_argument("--requests-per-level", type=int, default=32)
    parser.add_argument("--doc-tokens", type=int, default=2000, help="approximate document size")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per answer")
    parser.add_argument(
        "--overhead-repeats", type=int, default=60, help="timed HTTP/offline pairs, interleaved"
    )
    parser.add_argument("--overhead-warmup", type=int, default=5, help="untimed pairs first")
    parser.add_argument(
        "--overhead-only", action="store_true", help="measure the overhead, skip the load levels"
    )
    parser.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="environment for the server and the offline engine alike (e.g. OMP_NUM_THREADS=1)",
    )
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--server-timeout", type=float, default=300.0, help="seconds to start")
    parser.add_argument("--out", default="bench-results/serve.json")
    serve_fairness.add_arguments(parser)


def concurrency_levels(text: str) -> list[int]:
    """``"1,4,16"`` → ``[1, 4, 16]``; ValueError unless each is in [1, MAX_CONCURRENCY]."""
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(
            f"--concurrency must be integers separated by commas, got {text!r}"
        ) from None
    if not levels or any(not 1 <= level <= MAX_CONCURRENCY for level in levels):
        raise ValueError(f"--concurrency levels must be in [1, {MAX_CONCURRENCY}], got {text!r}")
    return levels


def validate(args: argparse.Namespace) -> list[int]:
    """Every run is bounded; returns the concurrency levels."""
    bounds = {
        "--requests-per-level": (args.requests_per_level, 1, MAX_REQUESTS_PER_LEVEL),
        "--doc-tokens": (args.doc_tokens, MIN_DOC_TOKENS, 10_000_000),
        "--max-tokens": (args.max_tokens, 1, 65_536),
        "--overhead-repeats": (args.overhead_repeats, 1, 10_000),
        "--overhead-warmup": (args.overhead_warmup, 0, 1000),
        "--request-timeout": (args.request_timeout, 1, 3600),
        "--server-timeout": (args.server_timeout, 1, 3600),
    }
    for flag, (value, low, high) in bounds.items():
        if not low <= value <= high:
            raise ValueError(f"{flag} must be in [{low}, {high}], got {value}")
    server_env(args.server_env)
    serve_fairness.validate(args)
    return concurrency_levels(args.concurrency)


def server_env(pairs: list[str]) -> dict[str, str]:
    """``["A=1", "B=x"]`` → ``{"A": "1", "B": "x"}``; ValueError for an entry without ``=``."""
    env: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"--server-env takes NAME=VALUE, got {pair!r}")
        env[name] = value
    return env


# -- the server process --------------------------------------------------------------------
def start_server(
    config: EngineConfig, log_path: Path, timeout: float, env: dict[str, str]
) -> ServerProcess:
    """``ragserve serve`` with ``config``'s flags on loopback; CliError (quoting its log) on failure."""
    # NOTE: no work-based admission: each level is a fixed number of closed-loop clients,
    # and what it measures is how the engine serves them, not which ones a budget refuses.
    flags = [*to_argv(config), "--max-queue-seconds", "0"]
    server = ServerProcess(
        flags, log_path, host=HOST, log_level="INFO", env=env, start_timeout=timeout
    )
    try:
        return server.start()
    except ServerStartError as exc:
        raise CliError(str(exc)) from None


@contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into SystemExit, so ``finally`` blocks (stopping the server) still run."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- HTTP ----------------------------------------------------------------------------------
@dataclass
class LevelResult:
    concurrency: int
    wall_s: float
    results: list[RequestResult] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        done = [r for r in self.results if r.error is None]
        ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
        prompt = sum(r.prompt_tokens for r in done)
        return {
            "concurrency": self.concurrency,
            "requests": len(self.results),
            "failures": len(self.results) - len(done),
            "wall_s": self.wall_s,
            "requests_per_s": len(done) / self.wall_s,
            "ttft_p50_s": percentile(ttfts, 0.50) if ttfts else None,
            "ttft_p99_s": percentile(ttfts, 0.99) if ttfts else None,
            "output_tokens_per_s": sum(r.completion_tokens for r in done) / self.wall_s,
            "cached_token_ratio": sum(r.cached_tokens for r in done) / prompt if prompt else None,
            "errors": sorted({r.error for r in self.results if r.error is not None})[:5],
        }


async def run_level(
    session: aiohttp.ClientSession, url: str, bodies: list[dict[str, Any]], concurrency: int
) -> LevelResult:
    """``concurrency`` closed-loop clients working through ``bodies`` once."""
    pending = iter(bodies)
    results: list[RequestResult] = []

    async def client() -> None:
        for body in pending:  # shared: each client takes the next body
            results.append(await stream_chat(session, url, body))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return LevelResult(concurrency, time.perf_counter() - started, results)


async def http_once(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[float, dict[str, Any]]:
    """Round-trip seconds and usage of one non-streamed chat."""
    started = time.perf_counter()
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        payload = await response.json()
        if response.status != 200:
            raise RuntimeError(f"overhead request failed with {response.status}: {payload}")
    return time.perf_counter() - started, payload["usage"]


@dataclass
class OverheadRun:
    """Interleaved timings of the same ``max_tokens=1`` prompt on both paths."""

    http_s: list[float] = field(default_factory=list)
    offline_s: list[float] = field(default_factory=list)
    http_usage: dict[str, Any] = field(default_factory=dict)
    offline_usage: dict[str, Any] = field(default_factory=dict)


async def measure_overhead(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    offline: OfflineWorker,
    repeats: int,
    warmup: int,
) -> OverheadRun:
    """``warmup`` untimed pairs, then ``repeats`` timed pairs, alternating which path goes
    first so that slow drift of the machine falls on both alike."""
    run = OverheadRun()
    for index in range(warmup + repeats):
        for path in ("http", "offline") if index % 2 == 0 else ("offline", "http"):
            if path == "http":
                seconds, run.http_usage = await http_once(session, url, body)
            else:
                seconds, run.offline_usage = offline.run_once()
            if index >= warmup:
                (run.http_s if path == "http" else run.offline_s).append(seconds)
    return run


@dataclass
class HttpRun:
    document: dict[str, Any]
    overhead: OverheadRun
    levels: list[LevelResult]


async def measure_http(
    url: str,
    text: str,
    levels: list[int],
    args: argparse.Namespace,
    offline: OfflineWorker,
) -> HttpRun:
    connector = aiohttp.TCPConnector(limit=max(levels))
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await wait_healthy(session, url, args.server_timeout)
        started = time.perf_counter()
        document = await upload_document(session, url, text, args.request_timeout)
        document["ingest_s"] = time.perf_counter() - started
        doc_id = document["id"]
        offline.start()
        overhead_body = chat_body(doc_id, OVERHEAD_QUESTION, 1, stream=False)
        overhead = await measure_overhead(
            session, url, overhead_body, offline, args.overhead_repeats, args.overhead_warmup
        )
        offline.close()
        results = []
        for index, concurrency in enumerate([] if args.overhead_only else levels):
            first = index * args.requests_per_level
            bodies = [
                chat_body(doc_id, question(first + n), args.max_tokens, stream=True)
                for n in range(args.requests_per_level)
            ]
            results.append(await run_level(session, url, bodies, concurrency))
    return HttpRun(document, overhead, results)


# -- the offline engine --------------------------------------------------------------------
class OfflineWorker:
    """:mod:`ragserve.bench.serve_offline` in a subprocess: one timed generate per call.

    It gets the server's engine flags and environment, so the two sides differ only by
    the HTTP service. Its log (stderr) goes to ``log_path``.
    """

    def __init__(
        self,
        config: EngineConfig,
        text: str,
        log_path: Path,
        env: dict[str, str],
        timeout: float,
    ) -> None:
        self._tempdir = tempfile.TemporaryDirectory(prefix="ragserve-bench-")
        self.doc_path = Path(self._tempdir.name) / "document.txt"
        self.doc_path.write_text(text, encoding="utf-8")
        self.log_path = log_path
        self.command = [sys.executable, "-m", "ragserve.bench.serve_offline"]
        self.command += [str(self.doc_path), OVERHEAD_QUESTION, *to_argv(config)]
        package_root = str(Path(__file__).resolve().parents[2])
        pythonpath = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        self.env = {
            **os.environ,
            "PYTHONPATH": pythonpath,
            "TOKENIZERS_PARALLELISM": "false",
            **env,
        }
        self.timeout = timeout
        self.process: subprocess.Popen[str] | None = None
        self.prompt_tokens = 0

    def start(self) -> None:
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                text=True, env=self.env,
            )  # fmt: skip
        self.prompt_tokens = int(self._read()["prompt_tokens"])

    def run_once(self) -> tuple[float, dict[str, Any]]:
        """Seconds of one ``LLM.generate`` and its usage (prompt and cached tokens)."""
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        reply = self._read()
        usage = {"prompt_tokens": reply["prompt_tokens"], "cached_tokens": reply["cached_tokens"]}
        return float(reply["seconds"]), usage

    def _read(self) -> dict[str, Any]:
        assert self.process is not None and self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], self.timeout)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            self.close()
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise CliError(
                f"the offline engine did not answer within {self.timeout:.0f} s:\n{tail}"
            )
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise CliError(f"the offline engine failed: {reply['error']}")
        return reply

    def close(self) -> None:
        """Stop the subprocess (end of input, then SIGKILL after 30 s); idempotent."""
        process = self.process
        if process is None or process.poll() is not None:
            self._tempdir.cleanup()
            return
        assert process.stdin is not None
        process.stdin.close()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        self._tempdir.cleanup()


# -- the whole run -------------------------------------------------------------------------
def run(args: argparse.Namespace, config: EngineConfig) -> int:
    """Run the benchmark; print the tables and write ``args.out``.

    Steps:

    1. Start ``ragserve serve`` in a subprocess on 127.0.0.1 (port 0, a free port) with this
       command's engine flags (and ``--server-env``; ``--max-queue-seconds 0``: the levels
       are closed loops of fixed size, not offered load), wait for ``/health``, upload one
       deterministic long document and wait until it is ready (its blocks are pinned).
    2. Overhead: start the offline engine (:mod:`ragserve.bench.serve_offline`) in a second
       subprocess with the same flags and environment; it builds exactly the token ids the
       server builds for the chat. Then ``--overhead-warmup`` untimed and
       ``--overhead-repeats`` timed pairs, interleaved: a non-streamed ``max_tokens=1`` chat
       over HTTP (client round trip) and one ``LLM.generate`` of the same ids (timed inside
       the offline process), each with the same cached prefix. Reported: median, p10/p90 and
       min of each side, the ratio of medians (target 1.2x) and the median of the per-pair
       ratios. Only one of the two processes works at any time; the other is idle.
    3. Load (unless ``--overhead-only``): for each ``--concurrency`` level,
       ``--requests-per-level`` streamed chats from that many concurrent clients, every one a
       distinct question on the document (so only the document is a shared prefix). Per
       level: requests/s, time to first token p50/p99, output tokens/s, cached-token ratio
       (``cached_tokens / prompt_tokens`` from the usage chunk) and failures.

    4. Fairness (``--fairness``; ``--fairness-only`` skips 1-3): two tenants on a server of
       their own, one flooding at ``--fairness-ratio`` times the other's rate; see
       :mod:`ragserve.bench.serve_fairness`.

    Traffic goes only to the loopback address the server is bound to. Every subprocess is
    always stopped: on success, errors, Ctrl-C and SIGTERM. Exit code 1 when any request
    failed (a refusal, 429 or 503, of the fairness run is counted, not failed), else 0; the
    overhead target is reported, not enforced.
    """
    from ragserve.commands.serve import thread_policy_env

    levels = validate(args)
    # NOTE: the server sets its own thread policy at start; the offline engine gets the same.
    env = {**thread_policy_env(config.device), **server_env(args.server_env)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    workload = {k: v for k, v in vars(args).items() if k != "func"}
    payload: dict[str, Any] = {"workload": workload, "server_env": env}
    failed = False
    with sigterm_as_exit():
        if not args.fairness_only:
            payload |= single_tenant(args, config, levels, env, out)
            failed = any(level["failures"] for level in payload["levels"])
        if args.fairness or args.fairness_only:
            payload["fairness"] = serve_fairness.run_fairness(args, config, env, out)
            failed |= any(tenant["failed"] for tenant in payload["fairness"]["tenants"])
    write_json(out, payload)
    return int(failed)


def single_tenant(
    args: argparse.Namespace,
    config: EngineConfig,
    levels: list[int],
    env: dict[str, str],
    out: Path,
) -> dict[str, Any]:
    """Steps 1-3 of :func:`run`: print their tables, return their JSON sections."""
    log_path = out.with_suffix(".server.log")
    text = document_text(args.doc_tokens)
    offline_log = out.with_suffix(".offline.log")
    # NOTE: the server's step size, spelled out: the offline engine would default larger.
    offline = OfflineWorker(for_its_device(config), text, offline_log, env, args.request_timeout)
    server = start_server(config, log_path, args.server_timeout, env)
    try:
        served = asyncio.run(measure_http(server.url, text, levels, args, offline))
    finally:
        offline.close()
        server.stop()
    summaries = [level.summary() for level in served.levels]
    overhead = overhead_summary(served.overhead)
    report(args, served.document, summaries, overhead)
    return {
        "server_command": server.command,
        "server_log": str(log_path),
        "offline_log": str(offline_log),
        "document": served.document,
        "levels": summaries,
        "overhead": overhead,
    }


def spread(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "p10": percentile(values, 0.10),
        "p90": percentile(values, 0.90),
        "min": min(values),
    }


def overhead_summary(run: OverheadRun) -> dict[str, Any]:
    http, offline = spread(run.http_s), spread(run.offline_s)
    ratio = http["median"] / offline["median"]
    pair_ratios = [h / o for h, o in zip(run.http_s, run.offline_s, strict=True)]
    return {
        "http_s": http,
        "offline_s": offline,
        "ratio": ratio,
        "pair_ratio": spread(pair_ratios),
        "target_ratio": OVERHEAD_TARGET,
        "within_target": ratio <= OVERHEAD_TARGET,
        "http_prompt_tokens": run.http_usage["prompt_tokens"],
        "http_cached_tokens": run.http_usage["prompt_tokens_details"]["cached_tokens"],
        "offline_prompt_tokens": run.offline_usage["prompt_tokens"],
        "offline_cached_tokens": run.offline_usage["cached_tokens"],
        "repeats": len(run.http_s),
        "http_timings_s": run.http_s,
        "offline_timings_s": run.offline_s,
    }


def report(
    args: argparse.Namespace,
    document: dict[str, Any],
    levels: list[dict[str, Any]],
    overhead: dict[str, Any],
) -> None:
    def ms(value: float | None) -> float | str:
        return "-" if value is None else value * 1000

    if levels:
        print_table(
            f"serve: document QA over HTTP, {document['tokens']}-token document "
            f"(ingested in {document['ingest_s']:.2f} s), {args.max_tokens} new tokens per answer",
            ["concurrency", "requests", "failures", "req/s", "TTFT p50 ms", "TTFT p99 ms",
             "out tok/s", "cached ratio"],
            [
                [s["concurrency"], s["requests"], s["failures"], s["requests_per_s"],
                 ms(s["ttft_p50_s"]), ms(s["ttft_p99_s"]), s["output_tokens_per_s"],
                 "-" if s["cached_token_ratio"] is None else s["cached_token_ratio"]]
                for s in levels
            ],
        )  # fmt: skip
    rows = []
    for name, key, prefix in (
        ("HTTP (non-streamed chat)", "http_s", "http"),
        ("offline LLM.generate", "offline_s", "offline"),
    ):
        t = overhead[key]
        rows.append(
            [name, ms(t["median"]), ms(t["p10"]), ms(t["p90"]), ms(t["min"]),
             overhead[f"{prefix}_prompt_tokens"], overhead[f"{prefix}_cached_tokens"]]
        )  # fmt: skip
    print_table(
        f"server overhead: max_tokens=1 on a cached {overhead['http_prompt_tokens']}-token "
        f"prompt, {overhead['repeats']} interleaved pairs",
        ["path", "median ms", "p10 ms", "p90 ms", "min ms", "prompt tokens", "cached tokens"],
        rows,
    )
    verdict = "within" if overhead["within_target"] else "OVER"
    pairs = overhead["pair_ratio"]
    print(
        f"\nHTTP / offline = {overhead['ratio']:.2f}x ({verdict} the {OVERHEAD_TARGET}x target); "
        f"per pair: median {pairs['median']:.2f}x, p10 {pairs['p10']:.2f}x, p90 {pairs['p90']:.2f}x"
    )
    if overhead["http_prompt_tokens"] != overhead["offline_prompt_tokens"]:
        print("warning: the HTTP and offline prompts differ in length (unequal work)")
    if overhead["http_cached_tokens"] != overhead["offline_cached_tokens"]:
        print("warning: the HTTP and offline prompts differ in cached tokens (unequal work)")
    for s in levels:
        for error in s["errors"]:
            print(f"concurrency {s['concurrency']}: {error}")
