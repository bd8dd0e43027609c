"""Headless load test: ``python -m loadtests.runner`` (also ``ragserve loadtest``).

Steps: start ``ragserve serve`` on loopback (or target ``--host``, which must be a loopback
URL), warm it up (one document, two chats), take a baseline from ``/metrics`` and the
server's ``/proc/<pid>/status``, run locust headless as a subprocess for a bounded time
while sampling the server every second, wait for the requests to drain, check the
after-load health (see :mod:`loadtests.report`), stop the server, and write the report
folder: locust's CSV files and HTML page, ``summary.json``, ``server_samples.csv``,
``report.png`` and the logs. Exit code 0: the run passed; 1: a check failed (the reasons
are printed); 2: bad arguments.

``--overload`` starts the server with ``--max-waiting-requests`` = ``--overload-limit``
so clients get 503s: those are counted as rejections (not failures), timeouts are
tolerated, and the run fails unless some requests were rejected, quickly.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from prometheus_client.parser import text_string_to_metric_families

from loadtests import require_loopback
from loadtests.corpus import build_corpus
from loadtests.report import (
    HealthLimits,
    ServerSnapshot,
    after_load_problems,
    build_summary,
    format_table,
    plot,
    write_samples,
    write_summary,
)
from ragserve.server.process import ServerProcess

REPO = Path(__file__).resolve().parents[1]
LOCUSTFILE = Path(__file__).with_name("locustfile.py")
USER_CLASSES = ("DocQAUser", "ChatUser", "SummarizeUser", "IngestUser")
MAX_DURATION_S = 3600.0
MAX_USERS = 1000
SERVER_START_TIMEOUT_S = 300.0
_ENGINE_READY = re.compile(
    r"engine ready in .* on (\S+) \(.*?\), \d+ KV blocks of \d+ tokens \(([\d.]+) GiB\)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    load = parser.add_argument_group("load")
    load.add_argument("--users", "-u", type=int, default=8, help="concurrent users")
    load.add_argument(
        "--spawn-rate", "-r", type=float, default=4.0, help="users started per second"
    )
    load.add_argument("--duration", "-t", type=float, default=30.0, help="seconds of load")
    load.add_argument(
        "--stop-timeout", type=float, default=10.0, help="seconds for tasks to finish"
    )
    load.add_argument("--user-classes", nargs="+", default=list(USER_CLASSES), choices=USER_CLASSES)
    load.add_argument("--out", default=None, help="report folder (default loadtest-results/<time>)")
    target = parser.add_argument_group("target")
    target.add_argument("--host", default=None, help="a running server (loopback URL only)")
    target.add_argument("--server-pid", type=int, default=None, help="its pid, to read its RSS")
    target.add_argument("--model", default=None, help="served model (default: the embedded one)")
    target.add_argument("--kv-cache-gib", type=float, default=0.5)
    target.add_argument("--max-num-seqs", type=int, default=None)
    target.add_argument("--max-num-batched-tokens", type=int, default=512)
    target.add_argument("--max-waiting-requests", type=int, default=None)
    target.add_argument(
        "--max-queue-seconds",
        type=float,
        default=None,
        help="the server's budget for a new request's expected time to finish (503 past it)",
    )
    target.add_argument("--server-args", default="", help="more `ragserve serve` flags, quoted")
    work = parser.add_argument_group("workload")
    work.add_argument("--max-tokens", type=int, default=16)
    work.add_argument("--doc-tokens", type=int, default=300)
    work.add_argument("--num-docs", type=int, default=8)
    work.add_argument("--corpus-seed", type=int, default=0)
    work.add_argument("--zipf", type=float, default=1.1)
    work.add_argument("--chat-turns", type=int, default=4)
    work.add_argument("--ingest-burst", type=int, default=3)
    work.add_argument("--request-timeout", type=float, default=60.0)
    checks = parser.add_argument_group("checks")
    checks.add_argument("--drain-timeout", type=float, default=30.0)
    checks.add_argument("--rss-growth-frac", type=float, default=0.25)
    checks.add_argument("--rss-growth-mib", type=float, default=200.0)
    checks.add_argument("--max-failures", type=int, default=0)
    checks.add_argument("--overload", action="store_true", help="expect and count 503s")
    checks.add_argument("--overload-limit", type=int, default=2, help="server admission limit")
    checks.add_argument("--max-reject-ms", type=float, default=1000.0, help="503 p95 bound")
    checks.add_argument("--sample-interval", type=float, default=1.0)


def validate(args: argparse.Namespace) -> None:
    """Every run stops by itself: users, duration and timeouts are bounded."""
    _bounded("--users", args.users, 1, MAX_USERS)
    _bounded("--spawn-rate", args.spawn_rate, 0.01, 1000)
    _bounded("--duration", args.duration, 1, MAX_DURATION_S)
    _bounded("--stop-timeout", args.stop_timeout, 0, 120)
    _bounded("--request-timeout", args.request_timeout, 1, 600)
    _bounded("--drain-timeout", args.drain_timeout, 0, 600)
    _bounded("--max-tokens", args.max_tokens, 1, 8192)
    _bounded("--num-docs", args.num_docs, 1, 10_000)
    _bounded("--sample-interval", args.sample_interval, 0.1, 60)
    _bounded("--overload-limit", args.overload_limit, 1, 10_000)
    if args.host is not None:
        args.host = require_loopback(args.host)
    elif args.server_pid is not None:
        raise ValueError("--server-pid goes with --host (the runner knows its own server's pid)")
    build_corpus(1, args.doc_tokens)  # rejects sizes the corpus cannot make


def _bounded(flag: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ValueError(f"{flag} must be in [{low}, {high}], got {value}")


# -- the server ----------------------------------------------------------------------------
@dataclass
class Target:
    """The server under load: our own ``server`` (None for ``--host``) or a given URL."""

    url: str
    pid: int | None
    server: ServerProcess | None = None
    # NOTE: a CPU server's KV pages become resident as blocks are first used (calloc), so
    # RSS may grow by up to the KV budget without leaking: the RSS check allows for it.
    lazy_kv_mib: float = 0.0

    def check_alive(self) -> None:
        """RuntimeError if our own server has exited."""
        if self.server is not None:
            self.server.check_alive()

    def stop(self) -> None:
        """SIGTERM our own server (graceful), SIGKILL if it lingers."""
        if self.server is not None:
            self.server.stop()


def server_args(args: argparse.Namespace) -> list[str]:
    """``ragserve serve`` flags for our own server (host and port are the helper's)."""
    waiting = args.overload_limit if args.overload else args.max_waiting_requests
    flags = ["--kv-cache-gib", str(args.kv_cache_gib)]
    flags += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.model:
        flags += ["--model", args.model]
    if args.max_num_seqs is not None:
        flags += ["--max-num-seqs", str(args.max_num_seqs)]
    if waiting is not None:
        flags += ["--max-waiting-requests", str(waiting)]
    if args.max_queue_seconds is not None:
        flags += ["--max-queue-seconds", str(args.max_queue_seconds)]
    return flags + shlex.split(args.server_args)


def start_server(flags: list[str], log_path: Path) -> Target:
    """Start ``ragserve serve`` on loopback port 0; RuntimeError (quoting its log) on failure."""
    server = ServerProcess(flags, log_path, start_timeout=SERVER_START_TIMEOUT_S).start()
    target = Target(require_loopback(server.url), server.pid, server)
    engine = _ENGINE_READY.search(server.log())
    if engine is not None and engine.group(1) == "cpu":
        target.lazy_kv_mib = float(engine.group(2)) * 1024
    return target


def _pythonpath() -> str:
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def read_rss(pid: int | None) -> int | None:
    """Resident set size in bytes (``VmRSS``), None if unknown or the process is gone."""
    if pid is None:
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(r"^VmRSS:\s+(\d+)\s+kB", status, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def snapshot(target: Target, timeout: float = 10.0) -> ServerSnapshot:
    text = requests.get(f"{target.url}/metrics", timeout=timeout).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return ServerSnapshot.from_metrics(values, read_rss(target.pid), time.time())


def wait_idle(target: Target, timeout: float) -> ServerSnapshot:
    """Poll until nothing is in flight; the last snapshot either way."""
    deadline = time.monotonic() + timeout
    state = snapshot(target)
    while not state.idle and time.monotonic() < deadline:
        time.sleep(0.25)
        state = snapshot(target)
    return state


class Sampler(threading.Thread):
    """Snapshots the server every ``interval`` seconds until stopped; misses are skipped."""

    def __init__(self, target: Target, interval: float) -> None:
        super().__init__(name="server-sampler", daemon=True)
        self.target, self.interval = target, interval
        self.samples: list[ServerSnapshot] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            try:
                self.samples.append(snapshot(self.target, timeout=self.interval * 5))
            except requests.RequestException:
                continue

    def stop(self) -> list[ServerSnapshot]:
        self._stop_event.set()
        self.join()
        return self.samples


def warm_up(target: Target, args: argparse.Namespace) -> None:
    """One document (ready) and two streamed chats, so the baseline has paid first costs."""
    doc = build_corpus(1, args.doc_tokens, args.corpus_seed, args.zipf).documents[0]
    timeout = args.request_timeout
    upload = requests.post(f"{target.url}/v1/documents", json={"text": doc.text}, timeout=timeout)
    upload.raise_for_status()
    doc_id = upload.json()["id"]
    deadline = time.monotonic() + timeout
    while (
        requests.get(f"{target.url}/v1/documents/{doc_id}", timeout=timeout).json()["status"]
        == "ingesting"
    ):
        if time.monotonic() > deadline:
            raise RuntimeError(f"warm-up: document {doc_id} not ready after {timeout:.0f} s")
        time.sleep(0.2)
    for documents in ([doc_id], []):
        body = {
            "messages": [{"role": "user", "content": doc.questions[0]}],
            "documents": documents,
            "max_tokens": args.max_tokens,
            "stream": True,
        }
        with requests.post(
            f"{target.url}/v1/chat/completions", json=body, stream=True, timeout=timeout
        ) as answer:
            answer.raise_for_status()
            for _ in answer.iter_lines():
                pass


# -- locust --------------------------------------------------------------------------------
@dataclass
class LocustRun:
    prefix: Path
    returncode: int
    client_summary: dict[str, Any] = field(default_factory=dict)


def locust_command(args: argparse.Namespace, url: str, out: Path) -> list[str]:
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless"]
    command += ["--host", url, "-u", str(args.users), "-r", str(args.spawn_rate)]
    command += [
        "-t",
        f"{max(1, round(args.duration))}s",
        "--stop-timeout",
        f"{round(args.stop_timeout)}s",
    ]
    command += [
        "--csv",
        str(out / "locust"),
        "--csv-full-history",
        "--html",
        str(out / "locust.html"),
    ]
    command += ["--only-summary", "--exit-code-on-error", "0", "--loglevel", "WARNING"]
    command += ["--max-tokens", str(args.max_tokens), "--doc-tokens", str(args.doc_tokens)]
    command += ["--num-docs", str(args.num_docs), "--corpus-seed", str(args.corpus_seed)]
    command += ["--zipf", str(args.zipf), "--chat-turns", str(args.chat_turns)]
    command += ["--ingest-burst", str(args.ingest_burst)]
    command += ["--request-timeout", str(args.request_timeout)]
    command += ["--client-summary", str(out / "client_summary.json")]
    return command + list(args.user_classes)


def run_locust(args: argparse.Namespace, url: str, out: Path) -> LocustRun:
    """Run locust to completion; it is killed if it outlives its run time by a minute."""
    command = locust_command(args, url, out)
    limit = args.duration + args.stop_timeout + 60
    env = {**os.environ, "PYTHONPATH": _pythonpath()}
    with (out / "locust.log").open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        try:
            returncode = process.wait(limit)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise RuntimeError(
                f"locust ran past {limit:.0f} s and was killed; see {out / 'locust.log'}"
            ) from None
    if returncode != 0:
        raise RuntimeError(f"locust exited with {returncode}; see {out / 'locust.log'}")
    summary_path = out / "client_summary.json"
    if not summary_path.exists():
        raise RuntimeError(f"locust wrote no {summary_path.name}; see {out / 'locust.log'}")
    return LocustRun(out / "locust", returncode, json.loads(summary_path.read_text()))


# -- the whole run -------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    validate(args)
    for module in ("locust", "matplotlib"):
        if importlib.util.find_spec(module) is None:
            raise RuntimeError(f"{module} is not installed: pip install locust matplotlib")
    out = Path(args.out or REPO / "loadtest-results" / time.strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    if args.host is not None:
        target = Target(args.host, args.server_pid)
    else:
        target = start_server(server_args(args), out / "server.log")
    try:
        return _measure(target, args, out)
    finally:
        target.stop()


def _measure(target: Target, args: argparse.Namespace, out: Path) -> int:
    warm_up(target, args)
    baseline = wait_idle(target, args.drain_timeout)
    sampler = Sampler(target, args.sample_interval)
    sampler.start()
    try:
        locust = run_locust(args, target.url, out)
    finally:
        samples = sampler.stop()
    target.check_alive()
    try:
        after = wait_idle(target, args.drain_timeout)
    except requests.RequestException as exc:
        raise RuntimeError(f"the server stopped answering after the load: {exc}") from None
    limits = HealthLimits(
        rss_growth_frac=args.rss_growth_frac,
        rss_growth_mib=args.rss_growth_mib,
        lazy_kv_mib=target.lazy_kv_mib,
        max_failures=args.max_failures,
        overload=args.overload,
        max_reject_ms=args.max_reject_ms,
    )
    problems = after_load_problems(
        baseline, after, locust.client_summary, limits, args.drain_timeout
    )
    write_samples([baseline, *samples, after], out / "server_samples.csv")
    history = locust.prefix.with_name("locust_stats_history.csv")
    plot(history, [baseline, *samples, after], out / "report.png")
    files = {
        "summary": "summary.json",
        "plot": "report.png",
        "html": "locust.html",
        "stats_csv": "locust_stats.csv",
        "history_csv": history.name,
        "failures_csv": "locust_failures.csv",
        "server_samples_csv": "server_samples.csv",
    }
    summary = build_summary(
        _config(args, target),
        locust.client_summary,
        baseline,
        after,
        samples,
        limits,
        problems,
        files,
    )
    write_summary(summary, out / "summary.json")
    print(format_table(summary))
    print(f"report: {out}")
    return 0 if summary["ok"] else 1


def _config(args: argparse.Namespace, target: Target) -> dict[str, Any]:
    keys = (
        "users",
        "spawn_rate",
        "duration",
        "stop_timeout",
        "user_classes",
        "max_tokens",
        "doc_tokens",
        "num_docs",
        "corpus_seed",
        "zipf",
        "chat_turns",
        "ingest_burst",
        "overload",
        "overload_limit",
        "kv_cache_gib",
        "max_num_seqs",
        "max_waiting_requests",
        "max_queue_seconds",
        "server_args",
    )
    config = {key: getattr(args, key) for key in keys}
    config["target"] = target.url
    config["own_server"] = target.server is not None
    return config


def run_checked(args: argparse.Namespace) -> int:
    """:func:`run`, with a run that broke (server, locust, HTTP) reported as exit code 1.
    Bad arguments still raise ValueError (exit code 2 in both command lines)."""
    try:
        return run(args)
    except (RuntimeError, requests.RequestException) as exc:
        print(f"loadtest: error: {exc}", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.runner", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_checked(args)
    except ValueError as exc:
        print(f"loadtest: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
