"""``ragserve bench cpu`` end to end on the tiny-llama shape (vLLM left out), and the pieces
that the full run relies on but a tiny run cannot show: each variant's environment and the
process-tree RSS."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ragserve.bench.cpu_engines import make_variants, tree_rss_bytes
from ragserve.bench.cpu_floors import best_ceilings, floors
from ragserve.bench.cpu_report import summarize
from ragserve.bench.cpu_workload import Workload, phase_specs
from ragserve.cli import main
from ragserve.models.llama import ModelShape

TIME_FIGURES = (
    "ttft_64_s",
    "ttft_160_s",
    "questions_total_s",
    "question_cold_s",
    "question_cached_s",
)


@pytest.mark.e2e
def test_bench_cpu_tiny_model_without_vllm(tmp_path: Path) -> None:
    out = tmp_path / "cpu.json"
    code = main(
        [
            "bench", "cpu", "--model-shape", "tiny-llama", "--dtype", "float32", "--quick",
            "--num-prompts", "3", "--input-len", "16", "--output-len", "4",
            "--ttft-lengths", "160,64", "--doc-tokens", "96", "--num-questions", "3",
            "--question-tokens", "8", "--answer-tokens", "3", "--repeats", "2", "--tcmalloc", "none",
            "--vllm-python", str(tmp_path / "missing" / "python"), "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    assert list(result["variants"]) == ["ragserve"]
    assert any("vLLM skipped" in note and "does not exist" in note for note in result["notes"])
    ceilings = result["ceilings"]
    assert set(ceilings) == {"matmul_gflops_float32", "matmul_gflops_bfloat16", "read_gbps"}
    assert all(value > 0 for value in ceilings.values())
    assert list(result["results"]) == ["float32"]

    measured = result["results"]["float32"]
    (run,) = measured["runs"]["ragserve"]
    assert run["returncode"] == 0 and run["attention_backend"] == "cpu"
    assert run["phases"]["throughput"]["output_tokens"] == 3 * 4
    assert "outputs" not in run["phases"]["throughput"]  # dropped once compared
    # Each phase ran twice on fresh prompts; its figure is the better time.
    throughput = run["phases"]["throughput"]
    assert len(throughput["all_seconds"]) == 2
    assert throughput["seconds"] == min(throughput["all_seconds"])
    ttft = run["phases"]["ttft"]
    assert [sorted(t) for t in ttft["all"]] == [["160", "64"]] * 2
    assert ttft["64"] == min(t["64"] for t in ttft["all"])
    questions = run["phases"]["questions"]
    assert len(questions["per_question_s"]) == 2
    assert all(len(session) == 3 for session in questions["per_question_s"])
    assert questions["total_s"] == pytest.approx(min(map(sum, questions["per_question_s"])))
    assert questions["cold_s"] == min(s[0] for s in questions["per_question_s"])
    summary = measured["summary"]
    rate = summary["throughput_tok_s"]
    assert rate["median"]["ragserve"] == pytest.approx(12 / run["phases"]["throughput"]["seconds"])
    # The floor is a ceiling on the rate: measured x floor is the ceiling over the rate.
    assert rate["floor"] == pytest.approx(measured["floors"]["throughput_tok_s"])
    assert rate["best"] == rate["median"]  # one run
    assert rate["x_floor"]["ragserve"] == pytest.approx(rate["floor"] / rate["best"]["ragserve"])
    assert rate["x_floor"]["ragserve"] > 1
    for name in TIME_FIGURES:
        row = summary[name]
        assert row["median"]["ragserve"] > 0 and row["floor"] > 0
        assert row["x_floor"]["ragserve"] == pytest.approx(row["best"]["ragserve"] / row["floor"])
        assert row["x_floor"]["ragserve"] > 1
        assert "vs_vllm" not in row
    # A longer prompt has a higher floor; a cached question a lower one than the cold one.
    assert summary["ttft_160_s"]["floor"] > summary["ttft_64_s"]["floor"]
    assert summary["question_cached_s"]["floor"] < summary["question_cold_s"]["floor"]
    assert 0 < summary["startup_s"]["median"]["ragserve"] < 120
    rss = summary["peak_rss_gb"]["median"]["ragserve"]
    assert 0.05 < rss < 8
    assert summary["kv_pool_gb"]["median"]["ragserve"] == pytest.approx(run["kv_pool_bytes"] / 1e9)


def test_variants_preload_tcmalloc_where_asked(tmp_path: Path) -> None:
    library = tmp_path / "libtcmalloc_minimal.so.4"
    library.touch()
    variants, notes = make_variants(sys.executable, str(library), {"OMP_NUM_THREADS": "2"})
    by_name = {v.name: v for v in variants}
    assert list(by_name) == ["ragserve", "ragserve+tcmalloc", "vllm"] and notes == []
    assert "LD_PRELOAD" not in by_name["ragserve"].env
    assert by_name["ragserve+tcmalloc"].env["LD_PRELOAD"] == str(library)
    vllm = by_name["vllm"]
    assert vllm.env["LD_PRELOAD"] == str(library)
    assert vllm.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert "PYTHONPATH" not in vllm.env  # vLLM's own venv, nothing of ours on its path
    assert all(v.env["OMP_NUM_THREADS"] == "2" for v in variants)
    assert Path(vllm.command[1]).read_text().startswith('"""Runs the ``ragserve bench cpu``')

    alone, notes = make_variants(None, None, {})
    assert [v.name for v in alone] == ["ragserve"] and len(notes) == 2


@pytest.mark.e2e
@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads /proc")
def test_tree_rss_counts_the_children() -> None:
    # A parent that holds little and a child that holds 200 MB: the tree holds both.
    child = "import time; b = bytearray(200 * 2**20); print(flush=True); time.sleep(30)"
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"
    proc = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while tree_rss_bytes(proc.pid) < 200 * 2**20 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tree_rss_bytes(proc.pid) >= 200 * 2**20
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the child too
        proc.wait()


def test_ratios_to_vllm_best_over_best_and_round_by_round() -> None:
    """Each engine's best over every round (its speed in the quietest minute it met) against
    vLLM's best; and, for the spread, the median and range of the rounds' own ratios.
    Failed runs count in neither."""

    def run(ttft: float, returncode: int = 0) -> dict[str, Any]:
        throughput = {"seconds": ttft, "output_tokens": 100}  # rate 100 / ttft
        return {
            "returncode": returncode,
            "phases": {"ttft": {"64": ttft}, "throughput": throughput},
        }

    runs = {
        "ragserve": [run(1.0), run(4.0), run(2.0), run(9.0, returncode=1)],
        "vllm": [run(2.0), run(5.0), run(1.0), run(1.0)],
    }
    row = summarize(runs, {}, (64,))["ttft_64_s"]
    assert row["median"] == {"ragserve": 2.0, "vllm": 1.5}
    assert row["best"] == {"ragserve": 1.0, "vllm": 1.0}
    assert row["best_vs_vllm"] == {"ragserve": 1.0}
    assert row["vs_vllm"]["ragserve"] == pytest.approx(0.8)  # of 0.5, 0.8 and 2.0
    assert row["vs_vllm_range"]["ragserve"] == [0.5, 2.0]
    rate = summarize(runs, {}, (64,))["throughput_tok_s"]  # higher is better: the best is the most
    assert rate["best"] == {"ragserve": 100.0, "vllm": 100.0}
    assert rate["best_vs_vllm"] == {"ragserve": 1.0}


def test_repeats_get_prompts_that_share_no_prefix() -> None:
    """A repeat served from an earlier repeat's prefix cache would not be a cold timing."""
    throughput, ttft, questions = phase_specs(Workload(repeats=3), vocab_size=49152)
    first_blocks = [tuple(p[:16]) for prompts in throughput["prompt_sets"] for p in prompts]
    first_blocks += [tuple(p[:16]) for prompts in ttft["prompt_sets"] for p in prompts]
    first_blocks += [tuple(doc["document"][:16]) for doc in questions["documents"]]
    assert len(first_blocks) == 3 * 32 + 3 * 3 + 3
    assert len(set(first_blocks)) == len(first_blocks)
    assert [len(p) for p in ttft["prompt_sets"][2]] == [2048, 4096, 8191]


def test_floors_come_from_the_quietest_ceilings() -> None:
    """Ceilings are measured before every round; each keeps its best (a busy minute's
    lower rates would put floors above what the engines reach in quiet ones)."""
    busy = {"matmul_gflops_bfloat16": 615.0, "read_gbps": 25.7}
    quiet = {"matmul_gflops_bfloat16": 2005.0, "read_gbps": 15.0}
    assert best_ceilings(busy, quiet) == {"matmul_gflops_bfloat16": 2005.0, "read_gbps": 25.7}
    assert best_ceilings(busy) == busy


def test_bf16_floors_take_the_faster_matmul_rate() -> None:
    """bf16 values multiply exactly in float32: where float32 is the faster rate (a CPU
    without AMX), bf16 prefill's floor is the float32 one, and the decode floors' bytes stay
    bf16's."""
    shape, workload = ModelShape(30, 9, 3, 64, 576, 1536, 49152), Workload()  # SmolLM2-135M
    slow_bf16 = {"matmul_gflops_bfloat16": 150.0, "matmul_gflops_float32": 300.0, "read_gbps": 20.0}
    fast_bf16 = {**slow_bf16, "matmul_gflops_bfloat16": 600.0}
    as_float32 = floors(shape, workload, "float32", slow_bf16)
    slow, fast = (floors(shape, workload, "bfloat16", c) for c in (slow_bf16, fast_bf16))
    assert slow["ttft_s"] == as_float32["ttft_s"]
    assert fast["ttft_s"]["2048"] == pytest.approx(slow["ttft_s"]["2048"] / 2)
    assert slow["throughput_s"] < as_float32["throughput_s"]  # half the bytes per decode step
