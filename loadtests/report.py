"""The load-test report: server snapshots, after-load verdict, ``summary.json``, a table, a plot.

After-load health (:func:`after_load_problems`): once the load stops and the requests
drain, no KV block is held by a request (``ragserve_kv_blocks{state="used"}``; pinned
document blocks are counted apart), nothing is running, waiting or admitted, the engine is
alive, and the server's resident memory is back near its level after warm-up: growth at
most ``max(rss_growth_frac × baseline, rss_growth_mib) + lazy_kv_mib``. NOTE: on a CPU
server the KV cache's pages become resident as blocks are first used, so growth up to the
KV budget is expected and not a leak: ``lazy_kv_mib`` is that budget when the runner
started a CPU server itself (0 otherwise: raise ``rss_growth_mib`` for such a target).
"""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

MIB = 2**20
CUSTOM_TYPES = ("TTFT", "ITL", "CACHED%", "READY")  # the rows loadtests.metrics adds
REJECTED_SUFFIX = " [rejected]"
CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class ServerSnapshot:
    """The server's state at one instant, from ``/metrics`` and ``/proc/<pid>/status``."""

    time: float
    alive: bool
    running: int
    waiting: int
    active: int
    kv_used: int
    kv_pinned: int
    kv_cached: int
    kv_total: int
    rss_bytes: int | None
    prompt_tokens_computed: float
    generation_tokens: float
    cache_queried_tokens: float
    cache_hit_tokens: float
    queued_work: float = 0.0  # tokens the server's admission still counts as outstanding
    queue_s: float = 0.0  # the server's expected seconds to finish that work

    @classmethod
    def from_metrics(
        cls, values: dict[str, float], rss_bytes: int | None, time: float
    ) -> ServerSnapshot:
        def get(name: str) -> float:
            return values.get(name, 0.0)

        def blocks(state: str) -> int:
            return int(get(f'ragserve_kv_blocks{{state="{state}"}}'))

        return cls(
            time=time,
            alive=get("ragserve_engine_alive") == 1.0,
            running=int(get("ragserve_num_requests_running")),
            waiting=int(get("ragserve_num_requests_waiting")),
            active=int(get("ragserve_num_requests_active")),
            kv_used=blocks("used"),
            kv_pinned=blocks("pinned"),
            kv_cached=blocks("cached"),
            kv_total=blocks("total"),
            rss_bytes=rss_bytes,
            prompt_tokens_computed=get("ragserve_prompt_tokens_computed_total"),
            generation_tokens=get("ragserve_generation_tokens_total"),
            cache_queried_tokens=get("ragserve_prefix_cache_queried_tokens_total"),
            cache_hit_tokens=get("ragserve_prefix_cache_hit_tokens_total"),
            queued_work=get('ragserve_admission_outstanding_tokens{kind="prompt"}')
            + get('ragserve_admission_outstanding_tokens{kind="answer"}'),
            queue_s=get("ragserve_admission_expected_seconds"),
        )

    @property
    def idle(self) -> bool:
        """Nothing in flight, no block held by a request, no work counted by admission."""
        in_flight = self.running or self.waiting or self.active or self.kv_used
        return not in_flight and self.queued_work == 0


@dataclass(frozen=True)
class HealthLimits:
    rss_growth_frac: float = 0.25
    rss_growth_mib: float = 200.0
    lazy_kv_mib: float = 0.0
    max_failures: int = 0
    overload: bool = False  # expect 503s; tolerate timeouts, nothing else
    max_reject_ms: float = 1000.0


def after_load_problems(
    baseline: ServerSnapshot,
    after: ServerSnapshot,
    client: dict[str, Any],
    limits: HealthLimits,
    drain_timeout: float,
) -> list[str]:
    """Everything wrong with the run, one sentence each; empty when it passed."""
    problems: list[str] = []
    if not after.alive:
        problems.append("the engine is not alive after the load")
    if after.running or after.waiting or after.active:
        problems.append(
            f"requests stuck {drain_timeout:.0f} s after the load: running={after.running} "
            f"waiting={after.waiting} admitted={after.active}"
        )
    if after.queued_work:
        problems.append(
            f"admission still counts {after.queued_work:.0f} tokens of work after the load (want 0)"
        )
    if after.kv_used:
        problems.append(
            f"{after.kv_used} KV blocks still held by requests after the load (want 0; "
            f"{after.kv_pinned} pinned document blocks are not counted)"
        )
    allowed = rss_allowance(baseline, limits)
    if baseline.rss_bytes is not None and after.rss_bytes is not None and allowed is not None:
        growth = after.rss_bytes - baseline.rss_bytes
        if growth > allowed:
            problems.append(
                f"server RSS grew {growth / MIB:.0f} MiB over the run ({baseline.rss_bytes / MIB:.0f}"
                f" -> {after.rss_bytes / MIB:.0f} MiB), more than the {allowed / MIB:.0f} MiB allowed"
            )
    problems += _client_problems(client, limits)
    return problems


def rss_allowance(baseline: ServerSnapshot, limits: HealthLimits) -> float | None:
    """Bytes the server's RSS may grow over the run; None when its RSS is unknown."""
    if baseline.rss_bytes is None:
        return None
    allowed = max(limits.rss_growth_frac * baseline.rss_bytes, limits.rss_growth_mib * MIB)
    return allowed + limits.lazy_kv_mib * MIB


def _client_problems(client: dict[str, Any], limits: HealthLimits) -> list[str]:
    problems: list[str] = []
    http, rejected = client["http"], client["rejected"]
    if http["count"] == 0:
        problems.append("no request was answered")
    kinds: dict[str, int] = client["failures_by_kind"]
    counted = {k: n for k, n in kinds.items() if not (limits.overload and k == "timeout")}
    failures = sum(counted.values())
    if failures > limits.max_failures:
        problems.append(
            f"{failures} failed requests (at most {limits.max_failures} allowed): "
            + ", ".join(f"{k}={n}" for k, n in sorted(counted.items()))
        )
    if client["user_exceptions"]:
        problems.append(
            f"the locust users raised {client['user_exceptions']} exceptions (see locust.log)"
        )
    if limits.overload:
        if rejected["count"] == 0:
            problems.append("overload mode, but the server rejected no request with 503")
        elif rejected["p95"] > limits.max_reject_ms:
            problems.append(
                f"503 rejections are slow: p95 {rejected['p95']:.0f} ms > {limits.max_reject_ms:.0f} ms"
            )
    return problems


def build_summary(
    config: dict[str, Any],
    client: dict[str, Any],
    baseline: ServerSnapshot,
    after: ServerSnapshot,
    samples: Sequence[ServerSnapshot],
    limits: HealthLimits,
    problems: list[str],
    files: dict[str, str],
) -> dict[str, Any]:
    """The content of ``summary.json`` (latencies in ms, RSS in MiB)."""
    elapsed = client["elapsed_s"] or math.nan
    tokens = client["tokens"]
    http = client["http"]
    queried = after.cache_queried_tokens - baseline.cache_queried_tokens
    rss = [s.rss_bytes for s in (baseline, *samples, after) if s.rss_bytes is not None]
    return {
        "ok": not problems,
        "problems": problems,
        "config": config,
        "duration_s": round(client["elapsed_s"], 2),
        "requests": {
            "count": http["count"],
            # NOTE: every failure row, failed jobs and timed-out waits included.
            "failures": sum(client["failures_by_kind"].values()),
            "rejected": client["rejected"]["count"],
            "per_s": _round(http["count"] / elapsed),
            "failures_by_kind": client["failures_by_kind"],
            "failure_examples": client["failure_examples"],
        },
        "latency_ms": _percentiles(http),
        "rejected_latency_ms": _percentiles(client["rejected"]),
        "ttft_ms": _percentiles(client["ttft_ms"]),
        "itl_ms": _percentiles(client["itl_ms"]),
        "document_ready_ms": _percentiles(client["ready_ms"]),
        "summarize_job_ms": _percentiles(client["job_ms"]),
        "streams": tokens["streams"],
        "output_tokens": tokens["completion_tokens"],
        "output_tokens_per_s": _round(tokens["completion_tokens"] / elapsed),
        "cache_hit_ratio": _round(tokens["cached_tokens"] / tokens["prompt_tokens"])
        if tokens["prompt_tokens"]
        else None,
        "cached_pct_per_request": _percentiles(client["cached_pct"]),
        "summarize_route": client["summarize_route"],
        "server": {
            "rss_mib": {
                "after_warmup": _mib(baseline.rss_bytes),
                "after_load": _mib(after.rss_bytes),
                "peak": _mib(max(rss)) if rss else None,
                "growth_allowed": _mib(allowance)
                if (allowance := rss_allowance(baseline, limits))
                else None,
            },
            "kv_blocks": {
                "before": _blocks(baseline),
                "after": _blocks(after),
                "peak_used": max((s.kv_used for s in samples), default=after.kv_used),
            },
            "peak_running": max((s.running for s in samples), default=0),
            "peak_waiting": max((s.waiting for s in samples), default=0),
            "prefix_cache_hit_ratio": _round(
                (after.cache_hit_tokens - baseline.cache_hit_tokens) / queried
            )
            if queried
            else None,
            "prompt_tokens_computed": int(
                after.prompt_tokens_computed - baseline.prompt_tokens_computed
            ),
            "generation_tokens": int(after.generation_tokens - baseline.generation_tokens),
        },
        "files": files,
    }


def _percentiles(entry: dict[str, Any]) -> dict[str, float]:
    return {key: entry[key] for key in ("count", "avg", "p50", "p95", "p99", "max")}


def _blocks(snapshot: ServerSnapshot) -> dict[str, int]:
    return {
        "used": snapshot.kv_used,
        "pinned": snapshot.kv_pinned,
        "cached": snapshot.kv_cached,
        "total": snapshot.kv_total,
    }


def _mib(value: float | None) -> float | None:
    return None if value is None else round(value / MIB, 1)


def _round(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 3)


def write_summary(summary: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(summary, indent=2, allow_nan=False))


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def format_table(summary: dict[str, Any]) -> str:
    """A short human-readable digest of ``summary``."""
    config, requests, server = summary["config"], summary["requests"], summary["server"]
    rss, kv = server["rss_mib"], server["kv_blocks"]

    def pct(entry: dict[str, Any]) -> str:
        if not entry["count"]:
            return "-"
        return f"p50 {entry['p50']:.0f}  p95 {entry['p95']:.0f}  p99 {entry['p99']:.0f}  (n={entry['count']})"

    rows = [
        ("target", f"{config['target']}  {config['users']} users, {summary['duration_s']:.0f} s"),
        ("requests", f"{requests['count']}  ({requests['per_s']}/s)"),
        ("failures", f"{requests['failures']}  {requests['failures_by_kind'] or ''}"),
        ("rejected (503)", f"{requests['rejected']}  {pct(summary['rejected_latency_ms'])}"),
        ("latency ms", pct(summary["latency_ms"])),
        ("TTFT ms", pct(summary["ttft_ms"])),
        ("ITL ms", pct(summary["itl_ms"])),
        (
            "output tokens/s",
            f"{summary['output_tokens_per_s']}  ({summary['output_tokens']} tokens)",
        ),
        ("summarize job ms", pct(summary["summarize_job_ms"])),
        (
            "cache hit ratio",
            f"{_or_dash(summary['cache_hit_ratio'])} of streamed prompts  "
            f"(server: {_or_dash(server['prefix_cache_hit_ratio'])})",
        ),
        (
            "server RSS MiB",
            f"{rss['after_warmup']} -> {rss['after_load']}  (peak {rss['peak']}, growth allowed "
            f"{rss['growth_allowed']})",
        ),
        ("summarize route", summary["summarize_route"]),
        (
            "KV blocks used",
            f"{kv['before']['used']} -> {kv['after']['used']}  (peak {kv['peak_used']}; pinned "
            f"{kv['before']['pinned']} -> {kv['after']['pinned']}, total {kv['after']['total']})",
        ),
        ("verdict", "OK" if summary["ok"] else "FAILED: " + "; ".join(summary["problems"])),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def write_samples(samples: Sequence[ServerSnapshot], path: Path) -> None:
    names = [f.name for f in fields(ServerSnapshot)]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=names)
        writer.writeheader()
        for sample in samples:
            writer.writerow(asdict(sample))


# -- the plot ------------------------------------------------------------------------------
def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def read_history(path: Path) -> dict[str, Any]:
    """Per second (locust's 10 s windows): HTTP requests/s, chat completions/s, rejected/s,
    failures/s, and p50/p95 of chat completions and of TTFT by user kind."""
    throughput: dict[int, float] = defaultdict(float)
    chats: dict[int, float] = defaultdict(float)
    rejected: dict[int, float] = defaultdict(float)
    failures: dict[int, float] = defaultdict(float)
    # (user kind, "request" | "ttft") -> [(second, p50, p95)]
    latency: dict[tuple[str, str], list[tuple[int, float, float]]] = defaultdict(list)
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            kind, name, second = row["Type"], row["Name"], int(row["Timestamp"])
            if name == "Aggregated":
                continue
            chat = name.endswith(CHAT_PATH)
            if kind not in CUSTOM_TYPES:
                rate = _number(row["Requests/s"])
                (rejected if name.endswith(REJECTED_SUFFIX) else throughput)[second] += rate
                chats[second] += rate if chat else 0.0
                failures[second] += _number(row["Failures/s"])
            p50, p95 = _number(row["50%"]), _number(row["95%"])
            # NOTE: locust writes 0 for a row with no request in its 10 s window yet.
            if (kind == "TTFT" or (chat and kind not in CUSTOM_TYPES)) and p50 > 0:
                key = (name, "ttft") if kind == "TTFT" else (name.split()[0], "request")
                latency[key].append((second, p50, p95))
    return {
        "throughput": throughput,
        "chats": chats,
        "rejected": rejected,
        "failures": failures,
        "latency": latency,
    }


def plot(history_path: Path, samples: Sequence[ServerSnapshot], out: Path) -> None:
    """Three panels over time: throughput, latency (p50 solid, p95 dashed), server state."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = read_history(history_path)
    seconds = sorted(set(history["throughput"]) | set(history["rejected"]))
    start = min([*seconds, *(int(s.time) for s in samples)], default=0)
    figure, (top, middle, bottom) = plt.subplots(3, 1, figsize=(10, 10), sharex=True)

    def series(data: dict[int, float]) -> tuple[list[int], list[float]]:
        return [s - start for s in seconds], [data.get(s, 0.0) for s in seconds]

    top.plot(*series(history["throughput"]), label="answered req/s (all routes)")
    top.plot(*series(history["chats"]), label="answered chat completions/s")
    top.plot(*series(history["rejected"]), label="rejected (503) req/s")
    top.plot(*series(history["failures"]), label="failures/s")
    top.set_ylabel("requests/s")
    top.set_title("throughput (locust's 10 s window)")
    top.legend(loc="upper left")

    kinds = sorted({kind for kind, _ in history["latency"]})
    for (kind, metric), points in sorted(history["latency"].items()):
        color = f"C{kinds.index(kind) % 10}"
        xs = [p[0] - start for p in points]
        if metric == "ttft":
            middle.plot(xs, [p[1] for p in points], color=color, linestyle=":")
            continue
        middle.plot(xs, [p[1] for p in points], color=color, label=kind)
        middle.plot(xs, [p[2] for p in points], color=color, linestyle="--")
    times = [s.time - start for s in samples]
    middle.plot(
        times, [s.queue_s * 1000 for s in samples], color="black", label="server: expected queue"
    )
    middle.set_ylabel("ms")
    middle.set_title("chat completions by user kind: p50 (solid), p95 (dashed), TTFT p50 (dotted)")
    middle.legend(loc="upper left", fontsize="small")

    bottom.plot(times, [s.kv_used for s in samples], label="KV blocks used")
    bottom.plot(times, [s.kv_pinned for s in samples], label="KV blocks pinned")
    bottom.plot(times, [s.running for s in samples], label="running")
    bottom.plot(times, [s.waiting for s in samples], label="waiting")
    bottom.set_ylabel("count")
    bottom.set_xlabel("seconds")
    bottom.set_title("server")
    bottom.legend(loc="upper left", fontsize="small")
    rss = [(t, s.rss_bytes / MIB) for t, s in zip(times, samples, strict=True) if s.rss_bytes]
    if rss:
        twin = bottom.twinx()
        twin.plot([p[0] for p in rss], [p[1] for p in rss], color="black", linestyle=":")
        twin.set_ylabel("RSS MiB (dotted)")
    figure.tight_layout()
    figure.savefig(out, dpi=90)
    plt.close(figure)
