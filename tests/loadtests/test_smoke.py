"""The load-test runner end to end on the embedded model: a short smoke run, an overload
run, the after-load verdict, and the refusal of non-loopback targets.

Locust is never imported here: it patches the whole process for gevent. It runs in the
runner's subprocess, as in real use.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loadtests import require_loopback
from loadtests.corpus import build_corpus, ingest_text
from loadtests.report import HealthLimits, ServerSnapshot, after_load_problems

REPO = Path(__file__).resolve().parents[2]
MIB = 2**20
needs_locust = pytest.mark.skipif(
    importlib.util.find_spec("locust") is None or importlib.util.find_spec("matplotlib") is None,
    reason="pip install locust matplotlib",
)
# Small and short: the embedded model on a shared CPU.
WORKLOAD = shlex.split("--max-tokens 8 --doc-tokens 300 --num-docs 6 --kv-cache-gib 0.25")
SMOKE = shlex.split("--users 8 --spawn-rate 8 --duration 20 --stop-timeout 8")
OVERLOAD = shlex.split("--overload --overload-limit 2 --users 12 --spawn-rate 12 --duration 8")
REPORT_FILES = (
    "summary.json",
    "report.png",
    "locust.html",
    "locust_stats.csv",
    "locust_stats_history.csv",
    "locust_failures.csv",
    "server_samples.csv",
)
EXPECTED_ROWS = (  # (Type, Name) in locust's stats: every user kind and custom metric
    ("POST", "docqa /v1/chat/completions"),
    ("POST", "chat /v1/chat/completions"),
    ("POST", "summarize /v1/pipelines/summarize"),
    ("GET", "summarize /v1/pipelines/summarize/{id}"),
    ("POST", "ingest /v1/documents"),
    ("TTFT", "docqa"),
    ("ITL", "docqa"),
    ("CACHED%", "chat"),
    ("READY", "ingest"),
    ("JOB", "summarize"),
)


def run_command(
    *args: str, timeout: float = 240.0, **extra_env: str
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", **extra_env}
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def stats_rows(out: Path) -> list[dict[str, str]]:
    with (out / "locust_stats.csv").open(newline="") as handle:
        return list(csv.DictReader(handle))


# -- the smoke run -------------------------------------------------------------------------
@pytest.mark.e2e
@needs_locust
@pytest.mark.slow
def test_smoke_run_passes_and_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "report"
    done = run_command("-m", "ragserve", "loadtest", *SMOKE, *WORKLOAD, "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "verdict" in done.stdout and "OK" in done.stdout

    for name in REPORT_FILES:
        assert (out / name).stat().st_size > 0, name
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is True and summary["problems"] == []
    requests = summary["requests"]
    assert requests["count"] >= 20 and requests["failures"] == 0 and requests["rejected"] == 0
    assert requests["per_s"] > 0
    latency = summary["latency_ms"]
    # NOTE: locust keeps 2 significant digits above 100 ms, so p99 may round above max.
    assert 0 < latency["p50"] <= latency["p95"] <= latency["p99"] <= latency["max"] * 1.05 + 1
    assert summary["ttft_ms"]["count"] >= 5 and summary["ttft_ms"]["p50"] > 0
    assert summary["itl_ms"]["count"] >= 5 and summary["itl_ms"]["p50"] > 0
    # Streams and summarization jobs generated their tokens.
    assert summary["output_tokens"] > 0 and summary["streams"] > 0
    assert summary["summarize_job_ms"]["count"] >= 1
    assert summary["output_tokens_per_s"] > 0
    # Documents are uploaded once and shared: most of a question's prompt is cached.
    assert 0.3 < summary["cache_hit_ratio"] <= 1.0

    server = summary["server"]
    assert server["kv_blocks"]["after"]["used"] == 0
    assert server["kv_blocks"]["peak_used"] > 0
    assert server["kv_blocks"]["after"]["pinned"] > 0  # the corpus documents stay pinned
    rss = server["rss_mib"]
    assert 100 < rss["after_warmup"] <= rss["peak"] and rss["after_load"] > 100

    # Every user kind ran, and the custom metrics are rows of locust's own stats.
    names = {(row["Type"], row["Name"]) for row in stats_rows(out)}
    for expected in EXPECTED_ROWS:
        assert expected in names, (expected, sorted(names))


@pytest.mark.e2e
@needs_locust
@pytest.mark.slow
def test_failed_summarization_jobs_fail_the_run(tmp_path: Path) -> None:
    out = tmp_path / "report"
    run = shlex.split("--user-classes SummarizeUser --users 2 --spawn-rate 2 --duration 8")
    done = run_command(
        "-m", "ragserve", "loadtest", *run, *WORKLOAD, "--out", str(out),
        RAGSERVE_TEST_FAIL_SAMPLING_MARKER="summarize-",  # every job's calls fail
    )  # fmt: skip
    assert done.returncode != 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    failures = summary["requests"]["failures_by_kind"]["job"]
    assert summary["ok"] is False and failures >= 1
    assert summary["requests"]["failures"] == failures
    assert summary["summarize_job_ms"]["count"] == 0
    assert re.search(r"cache hit ratio +- of streamed prompts", done.stdout)


@pytest.mark.e2e
@needs_locust
@pytest.mark.slow
def test_overload_gives_fast_503s_and_no_other_5xx(tmp_path: Path) -> None:
    out = tmp_path / "overload"
    classes = ("--user-classes", "DocQAUser", "ChatUser", "--stop-timeout", "5")
    done = run_command("-m", "loadtests.runner", *OVERLOAD, *classes, *WORKLOAD, "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is True
    assert summary["requests"]["rejected"] >= 5
    assert summary["rejected_latency_ms"]["p95"] < 1000  # rejected at once, not queued
    assert summary["requests"]["count"] > 0  # the admitted ones were served
    assert set(summary["requests"]["failures_by_kind"]) <= {"timeout"}
    with (out / "locust_failures.csv").open(newline="") as handle:
        errors = [row["Error"] for row in csv.DictReader(handle)]
    assert not [e for e in errors if "[http 5" in e], errors
    assert all(
        row["Failure Count"] == "0" for row in stats_rows(out) if "[rejected]" in row["Name"]
    )
    assert summary["server"]["kv_blocks"]["after"]["used"] == 0


# -- refusing targets ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:8000", "http://127.9.8.7:1/", "http://localhost:80", "http://[::1]:8000"],
)
def test_loopback_targets_are_accepted(url: str) -> None:
    assert require_loopback(url) == url.rstrip("/")


@pytest.mark.parametrize(
    "url",
    [
        "http://10.1.2.3:8000",
        "http://192.168.0.1",
        "http://8.8.8.8",
        "http://example.com",
        "http://127.0.0.1.example.com",
        "ftp://127.0.0.1",
        "127.0.0.1:8000",
        "http://[::2]:80",
    ],
)
def test_other_targets_are_refused(url: str) -> None:
    with pytest.raises(ValueError):
        require_loopback(url)


@pytest.mark.e2e
def test_runner_refuses_a_remote_host_before_sending_anything(tmp_path: Path) -> None:
    done = run_command(
        "-m", "loadtests.runner", "--host", "http://10.1.2.3:8000", "--out", str(tmp_path)
    )
    assert done.returncode == 2
    assert "refusing to load-test '10.1.2.3'" in done.stderr
    assert not any(tmp_path.iterdir())  # nothing ran, nothing was written


@pytest.mark.e2e
@needs_locust
def test_locustfile_alone_refuses_a_remote_host() -> None:
    # NOTE: zero users and an unresolvable name: nothing could be sent even if it did not.
    command = shlex.split("-m locust -f loadtests/locustfile.py --headless -u 0 -t 2s")
    done = run_command(*command, "--host", "http://example.invalid:8000")
    assert done.returncode == 2
    assert "refusing to load-test 'example.invalid'" in done.stderr


@pytest.mark.e2e
def test_runner_rejects_unbounded_runs(tmp_path: Path) -> None:
    done = run_command("-m", "loadtests.runner", "--duration", "7200", "--out", str(tmp_path))
    assert done.returncode == 2 and "--duration must be in [1, 3600.0], got 7200.0" in done.stderr


# -- the corpus ------------------------------------------------------------------------------
def test_corpus_is_deterministic_with_zipf_popularity() -> None:
    import random

    first, again = build_corpus(5, 300, seed=3), build_corpus(5, 300, seed=3)
    assert first == again
    assert len({doc.text for doc in first.documents}) == 5
    assert build_corpus(5, 300, seed=4).documents[0].text != first.documents[0].text
    rng = random.Random(0)
    counts = {doc.key: 0 for doc in first.documents}
    for _ in range(4000):
        counts[first.pick(rng).key] += 1
    ranked = [counts[doc.key] for doc in first.documents]
    assert ranked == sorted(ranked, reverse=True) and ranked[0] > 3 * ranked[-1]
    for doc in first.documents:
        words = len(doc.text.split())
        assert 150 <= words <= 200, words  # ≈ 300 tokens at 1.6 tokens a word
        for question in doc.questions:  # every question asks about a unit in the text
            unit = question.split(" of ", 1)[1].split(" run at")[0]
            assert unit in doc.text
    assert ingest_text("a", 300) == ingest_text("a", 300) != ingest_text("b", 300)


# -- the after-load verdict -------------------------------------------------------------------
def snapshot(**changes: Any) -> ServerSnapshot:
    idle = ServerSnapshot(
        time=0.0,
        alive=True,
        running=0,
        waiting=0,
        active=0,
        kv_used=0,
        kv_pinned=20,
        kv_cached=40,
        kv_total=364,
        rss_bytes=1000 * MIB,
        prompt_tokens_computed=0.0,
        generation_tokens=0.0,
        cache_queried_tokens=0.0,
        cache_hit_tokens=0.0,
    )
    return dataclasses.replace(idle, **changes)


def client(**changes: Any) -> dict[str, Any]:
    entry = {"count": 10, "failures": 0, "avg": 5.0, "p50": 5, "p95": 9, "p99": 9, "max": 9}
    values = {"http": entry, "rejected": {**entry, "count": 0}, "failures_by_kind": {}}
    return {**values, "user_exceptions": 0, **changes}


def test_after_load_verdict_names_each_problem() -> None:
    base, limits = snapshot(), HealthLimits()
    assert after_load_problems(base, snapshot(rss_bytes=1240 * MIB), client(), limits, 30) == []

    stuck = after_load_problems(
        base, snapshot(running=1, waiting=2, active=3), client(), limits, 30
    )
    assert stuck == ["requests stuck 30 s after the load: running=1 waiting=2 admitted=3"]
    queued = after_load_problems(base, snapshot(queued_work=12), client(), limits, 30)
    assert queued == ["admission still counts 12 tokens of work after the load (want 0)"]
    held = after_load_problems(base, snapshot(kv_used=7), client(), limits, 30)
    assert held and held[0].startswith("7 KV blocks still held by requests")
    grown = after_load_problems(base, snapshot(rss_bytes=1300 * MIB), client(), limits, 30)
    assert grown == [
        "server RSS grew 300 MiB over the run (1000 -> 1300 MiB), more than the 250 MiB allowed"
    ]
    # A CPU server's KV pages are committed lazily: its budget is allowed on top.
    lazy = HealthLimits(lazy_kv_mib=256)
    assert after_load_problems(base, snapshot(rss_bytes=1300 * MIB), client(), lazy, 30) == []
    assert after_load_problems(base, snapshot(alive=False), client(), limits, 30) == [
        "the engine is not alive after the load"
    ]


def test_after_load_verdict_on_client_results() -> None:
    base = snapshot()
    failed = client(failures_by_kind={"http": 2, "timeout": 1})
    assert after_load_problems(base, base, failed, HealthLimits(), 30) == [
        "3 failed requests (at most 0 allowed): http=2, timeout=1"
    ]
    overload = HealthLimits(overload=True, max_reject_ms=100)
    # Overload tolerates timeouts, nothing else, and needs quick rejections.
    timeouts = client(failures_by_kind={"timeout": 4}, rejected={**client()["http"], "p95": 40})
    assert after_load_problems(base, base, timeouts, overload, 30) == []
    assert after_load_problems(base, base, client(), overload, 30) == [
        "overload mode, but the server rejected no request with 503"
    ]
    slow = client(rejected={**client()["http"], "p95": 400})
    assert after_load_problems(base, base, slow, overload, 30) == [
        "503 rejections are slow: p95 400 ms > 100 ms"
    ]
