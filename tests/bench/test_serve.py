"""``ragserve bench serve`` end to end, tiny: both sides of the overhead ratio do the same
work (same prompt, same cached prefix) and the report holds medians and spreads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ragserve.bench.serve import server_env

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_overhead_pairs_do_the_same_work(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    command = [
        sys.executable, "-m", "ragserve", "bench", "serve", "--overhead-only",
        "--overhead-repeats", "4", "--overhead-warmup", "1", "--doc-tokens", "120",
        "--kv-cache-gib", "0.25", "--max-num-batched-tokens", "512", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "HTTP / offline =" in done.stdout and "warning" not in done.stdout

    result = json.loads(out.read_text())
    overhead = result["overhead"]
    assert overhead["repeats"] == 4
    assert len(overhead["http_timings_s"]) == len(overhead["offline_timings_s"]) == 4
    assert overhead["http_prompt_tokens"] == overhead["offline_prompt_tokens"] > 100
    # The document's full blocks are cached on both sides, and only they are.
    cached = overhead["http_cached_tokens"]
    assert cached == overhead["offline_cached_tokens"] and cached % 16 == 0 and cached >= 96
    for side in ("http_s", "offline_s"):
        t = overhead[side]
        assert 0 < t["min"] <= t["p10"] <= t["median"] <= t["p90"]
    assert overhead["ratio"] == pytest.approx(
        overhead["http_s"]["median"] / overhead["offline_s"]["median"]
    )
    assert result["levels"] == []  # --overhead-only
    assert Path(result["offline_log"]).exists()
    assert result["server_env"].get("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY"))


def test_server_env_pairs() -> None:
    assert server_env(["A=1", "B=x=y"]) == {"A": "1", "B": "x=y"}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        server_env(["A"])


def test_fairness_summary_counts_refusals_apart_from_failures() -> None:
    from ragserve.bench.serve_client import RequestResult
    from ragserve.bench.serve_fairness import TenantRun

    run = TenantRun("flood", "together", 2.0)
    run.results = [
        RequestResult(1.0, status=200, ttft_s=0.5),
        RequestResult(1.0, status=200, ttft_s=1.5),
        RequestResult(0.1, status=429, error="HTTP 429: over the limit"),
        RequestResult(0.1, status=503, error="HTTP 503: at capacity"),
        RequestResult(0.1, status=None, error="ClientError: reset"),
    ]
    summary = run.summary()
    assert (summary["sent"], summary["admitted"], summary["failed"]) == (5, 2, 1)
    assert summary["refused_429"] == summary["refused_503"] == 1
    assert summary["admitted_share"] == pytest.approx(0.4)
    assert summary["ttft_p50_s"] == pytest.approx(1.0)
    assert summary["errors"] == ["ClientError: reset"]
