"""``python -m kernels.bench_cpu_linear``: the paired products and the path without pairs
(streamed for one row, oneDNN for more) timed at every row count asked, their table printed
and their figures written as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kernels import bench_cpu_linear, cpu_linear

pairs_here = cpu_linear.pairs_apply(torch.empty(1, 32, dtype=torch.bfloat16)) and (
    cpu_linear.can_pack(torch.empty(1, 32, dtype=torch.bfloat16))
)


@pytest.mark.skipif(not pairs_here, reason="bf16 products do not run paired on this CPU")
def test_bench_times_both_paths_at_each_row_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "linear.json"
    argv = ["--rows", "1,40", "--layers", "2", "--repeats", "2", "--json", str(out)]
    assert bench_cpu_linear.main(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["rows"] for r in results] == [1, 40]
    assert [r["unpaired_path"] for r in results] == ["streamed", "oneDNN + SiLU pass"]
    for r in results:
        for path in ("paired", "unpaired"):
            assert 0 < r[f"{path}_best_ms"] <= r[f"{path}_median_ms"]
            assert r[f"{path}_gflops"] > 0
        assert r["paired_over_unpaired"] == pytest.approx(
            r["paired_median_ms"] / r["unpaired_median_ms"]
        )
    table = capsys.readouterr().out
    assert "paired / unpaired" in table and "2 layers" in table
