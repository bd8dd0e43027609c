"""The figures of ``ragserve bench cpu`` from its runs: each variant's best (and median),
the best against this CPU's floor and, where vLLM ran, as a ratio to vLLM's (best over
best, and per round, then the median), next to issue #20's targets."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from ragserve.table import print_table

RunFigure = Callable[[dict[str, Any]], float | None]


def _get(run: dict[str, Any], *keys: str) -> float | None:
    value: Any = run
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


def _rate(run: dict[str, Any]) -> float | None:
    seconds = _get(run, "phases", "throughput", "seconds")
    tokens = _get(run, "phases", "throughput", "output_tokens")
    return tokens / seconds if seconds and tokens else None


def _rss_gb(run: dict[str, Any]) -> float | None:
    rss = _get(run, "peak_rss_bytes")
    return rss / 1e9 if rss else None


def _kv_pool_gb(run: dict[str, Any]) -> float | None:
    kv = _get(run, "kv_pool_bytes")
    return kv / 1e9 if kv is not None else None


# name, label, how to read it from a run, higher is better, issue #20's target for ragserve
Figure = tuple[str, str, RunFigure, bool, str]


def figure_list(ttft_lengths: tuple[int, ...]) -> list[Figure]:
    def at(*keys: str) -> RunFigure:
        return lambda run: _get(run, "phases", *keys)

    figures: list[Figure] = [
        ("throughput_tok_s", "throughput, output tok/s", _rate, True, ">= 1.3x vLLM")
    ]
    figures += [
        (f"ttft_{n}_s", f"cold TTFT {n}, s", at("ttft", str(n)), False, "<= 0.8x vLLM")
        for n in ttft_lengths
    ]
    figures += [
        (
            "questions_total_s",
            "questions, total s",
            at("questions", "total_s"),
            False,
            "<= 0.7x vLLM",
        ),
        ("question_cold_s", "  first (cold), s", at("questions", "cold_s"), False, ""),
        (
            "question_cached_s",
            "  cached (median), s",
            at("questions", "cached_median_s"),
            False,
            "",
        ),
        ("startup_s", "start-up, s", lambda run: _get(run, "startup_s"), False, "<= 5 s"),
        ("peak_rss_gb", "peak RSS (process tree), GB", _rss_gb, False, "<= 1.5 GB + KV pool"),
        ("kv_pool_gb", "  KV pool (allocated), GB", _kv_pool_gb, False, ""),
    ]
    return figures


def _floor(name: str, floor: dict[str, Any]) -> float | None:
    if name.startswith("ttft_"):
        return floor.get("ttft_s", {}).get(name.removeprefix("ttft_").removesuffix("_s"))
    value = floor.get(name)
    return float(value) if isinstance(value, (int, float)) else None


def _paired_ratios(
    ours: list[dict[str, Any]], theirs: list[dict[str, Any]], read: RunFigure
) -> list[float]:
    """Round i's figure of one variant over the other's, for the rounds both completed."""
    ratios = []
    for a, b in zip(ours, theirs, strict=False):
        if a.get("returncode") == 0 and b.get("returncode") == 0:
            x, y = read(a), read(b)
            if x is not None and y:
                ratios.append(x / y)
    return ratios


def summarize(
    runs: dict[str, list[dict[str, Any]]], floor: dict[str, Any], ttft_lengths: tuple[int, ...]
) -> dict[str, Any]:
    """Per figure: each variant's best and median over its successful runs, the floor, how
    many times the floor each best is (time over least time; for a rate, ceiling over
    rate), and each ragserve variant's ratio to vLLM two ways: best over best, and the
    median of the rounds' own ratios, with their range.

    NOTE: on a shared host whose load changes from minute to minute, the best of every
    round and repeat is each engine's speed in the quietest minute it met, the fairest
    comparison when the rounds are several; the rounds' ratios show the spread."""
    summary: dict[str, Any] = {}
    for name, _label, read, higher_better, target in figure_list(ttft_lengths):
        medians: dict[str, float | None] = {}
        bests: dict[str, float | None] = {}
        for variant, variant_runs in runs.items():
            values = [
                v
                for v in (read(r) for r in variant_runs if r.get("returncode") == 0)
                if v is not None
            ]
            medians[variant] = statistics.median(values) if values else None
            bests[variant] = (max(values) if higher_better else min(values)) if values else None
        row: dict[str, Any] = {
            "best": bests,
            "median": medians,
            "floor": _floor(name, floor),
            "target": target,
        }
        if row["floor"]:
            row["x_floor"] = {
                v: (row["floor"] / b if higher_better else b / row["floor"]) if b else None
                for v, b in bests.items()
            }
        if "vllm" in runs:
            theirs = bests.get("vllm")
            row["best_vs_vllm"] = {
                v: b / theirs if b is not None and theirs else None
                for v, b in bests.items()
                if v != "vllm"
            }
            paired = {v: _paired_ratios(runs[v], runs["vllm"], read) for v in runs if v != "vllm"}
            if any(paired.values()):
                row["vs_vllm"] = {v: statistics.median(r) if r else None for v, r in paired.items()}
                row["vs_vllm_range"] = {v: [min(r), max(r)] for v, r in paired.items() if r}
        summary[name] = row
    return summary


def print_summary(
    title: str, summary: dict[str, Any], variants: list[str], ttft_lengths: tuple[int, ...]
) -> None:
    ours = [v for v in variants if v != "vllm"]
    with_vllm = "vllm" in variants
    header = ["figure (best)", *variants, "floor", *(f"{v} x floor" for v in variants)]
    if with_vllm:
        header += [f"{v} / vllm" for v in ours]
        header += [f"{v} / vllm, rounds' median" for v in ours]
    header.append("target")
    rows: list[list[Any]] = []
    for name, label, _read, _higher, _target in figure_list(ttft_lengths):
        row = summary[name]
        x_floor = row.get("x_floor", {})
        cells: list[Any] = [label, *(row["best"].get(v) for v in variants), row["floor"]]
        cells += [x_floor.get(v) for v in variants]
        if with_vllm:
            cells += [row.get("best_vs_vllm", {}).get(v) for v in ours]
            cells += [row.get("vs_vllm", {}).get(v) for v in ours]
        rows.append([*cells, row["target"] or None])
    print_table(title, header, rows)
