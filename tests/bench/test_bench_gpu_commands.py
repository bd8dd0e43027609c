"""The GPU benchmark commands, run end to end on the CPU with the tiny-llama shape.

Each test runs the real command (engine, transformers baseline, tiers on real files) and
checks the JSON it writes: the fields the GPU runs report, with sane values.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ragserve.bench.shapes import (
    LLAMA_3_1_8B,
    TINY_LLAMA,
    decode_floor_s,
    decode_weight_bytes,
    generate_flops,
    prefill_flops,
)
from ragserve.bench.tiers import REPEATS
from ragserve.cli import main
from ragserve.models.llama import ModelShape


@pytest.fixture(autouse=True)
def _single_thread(one_torch_thread: None) -> Iterator[None]:
    yield


def _bench(tmp_path: Path, name: str, *extra: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / f"{name}.json"
    code = main(["bench", name, "--model-shape", "tiny-llama", "--out", str(out), *extra])
    return code, json.loads(out.read_text())


@pytest.mark.slow
def test_ttft_chunked_prefill_then_decode_against_transformers(tmp_path: Path) -> None:
    code, result = _bench(
        tmp_path,
        "ttft",
        "--lengths",
        "64,300",
        "--decode-tokens",
        "4",
        "--max-num-batched-tokens",
        "64",
        "--peak-tflops",
        "791",
        "--peak-tbps",
        "4.25",
    )
    assert code == 0 and result["errors"] == []
    rows = result["rows"]
    assert set(rows) == {"64", "300"}
    assert rows["300"]["ragserve_chunks"] == 5
    for row in rows.values():
        assert row["ragserve_s"] > 0 and row["transformers_s"] > 0
        assert row["ragserve_first_s"] > 0 and row["transformers_first_s"] > 0
        assert row["ragserve_cached_tokens"] == 0  # cold: nothing reused from the warm-up
        assert row["floor_s"] == pytest.approx(row["flops"] / 791e12)
    assert rows["300"]["flops"] > 4 * rows["64"]["flops"]
    decode = result["decode"]
    assert decode["context"] == 300 and decode["tokens"] == 4
    assert decode["ragserve_ms_per_token"] > 0 and decode["transformers_ms_per_token"] > 0
    assert (
        decode["ragserve_first_ms_per_token"] > 0 and decode["transformers_first_ms_per_token"] > 0
    )
    # The floor counts what a step reads: not the untied input embedding (a lookup).
    embedding = TINY_LLAMA["vocab_size"] * TINY_LLAMA["hidden_size"] * 4
    assert decode["weight_bytes_read_per_step"] == result["workload"]["weight_bytes"] - embedding
    kv = (300 + 4) * 2 * 2 * 2 * 16 * 4
    assert decode["floor_ms_per_token"] == pytest.approx(
        (decode["weight_bytes_read_per_step"] + kv) / 4.25e12 * 1e3
    )
    assert result["memory"]["weights_bytes"] == result["workload"]["weight_bytes"] > 0


def test_ttft_longest_prompt_may_exceed_the_shape_limit(tmp_path: Path) -> None:
    """The shape's max_position_embeddings (8192) is raised so 8192 tokens + decode fit."""
    code, result = _bench(
        tmp_path,
        "ttft",
        "--lengths",
        "8192",
        "--decode-tokens",
        "2",
        "--max-num-batched-tokens",
        "4096",
        "--skip-transformers",
    )
    assert code == 0
    assert result["rows"]["8192"]["ragserve_chunks"] == 2
    assert "floor_s" not in result["rows"]["8192"] and "floor_ms_per_token" not in result["decode"]
    assert result["decode"]["ragserve_ms_per_token"] > 0
    assert "transformers_s" not in result["rows"]["8192"]


@pytest.mark.slow
def test_throughput_variable_with_a_transformers_subset(tmp_path: Path) -> None:
    code, result = _bench(
        tmp_path,
        "throughput",
        "--variable",
        "--num-prompts",
        "6",
        "--hf-max-prompts",
        "2",
        "--hf-batch-size",
        "2",
        "--hf-sort",
    )
    assert code == 0 and result["errors"] == []
    ours, theirs = result["ragserve"], result["transformers"]
    assert ours["output_tokens"] == result["workload"]["output_tokens"]
    assert 0.9 <= ours["kv_utilisation"] <= 1.0
    assert theirs["num_prompts"] == 2 and theirs["sorted_by_length"]
    # Both were run once untimed at the timed shape; the first runs are reported apart.
    assert ours["first_run_s"] > 0 and theirs["first_run_s"] > 0
    assert result["speedup_vs_transformers"] == pytest.approx(
        ours["output_tok_s"] / theirs["output_tok_s"]
    )
    # A GPU's peaks say nothing about this CPU: no floor unless the peaks are given.
    assert "floor" not in result


def test_throughput_floor_from_given_peaks(tmp_path: Path) -> None:
    code, result = _bench(
        tmp_path,
        "throughput",
        "--num-prompts",
        "2",
        "--input-len",
        "8",
        "--output-len",
        "3",
        "--skip-transformers",
        "--peak-tflops",
        "0.5",
        "--peak-tbps",
        "0.01",
    )
    assert code == 0
    floor = result["floor"]
    assert floor["seconds"] == max(floor["compute_s"], floor["weights_read_s"]) > 0
    assert floor["compute_s"] == pytest.approx(floor["flops"] / 0.5e12)
    assert (floor["peak_tflops"], floor["peak_tbps"]) == (0.5, 0.01)


def test_continuous_batching_baseline_needs_fixed_lengths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "never.json"
    code = main(["bench", "throughput", "--model-shape", "tiny-llama", "--variable",
                 "--hf-continuous", "--out", str(out)])  # fmt: skip
    assert code == 2 and not out.exists()
    assert "fixed lengths" in capsys.readouterr().err


# NOTE: GPU only: transformers' continuous batching sizes its cache from free memory
# (~40 s and 11 GiB on the CPU).
@pytest.mark.gpu
def test_throughput_against_transformers_continuous_batching(tmp_path: Path) -> None:
    code, result = _bench(tmp_path, "throughput", "--num-prompts", "4", "--input-len", "16",
                          "--output-len", "4", "--hf-continuous")  # fmt: skip
    assert code == 0 and result["errors"] == []
    ours, theirs = result["ragserve"], result["transformers_generate_batch"]
    assert theirs["num_prompts"] == 4 and theirs["output_tokens"] == 16
    assert result["speedup_vs_transformers_generate_batch"] == pytest.approx(
        ours["output_tok_s"] / theirs["output_tok_s"]
    )


def test_tiers_report_bytes_rates_and_references(tmp_path: Path) -> None:
    code, result = _bench(
        tmp_path,
        "tiers",
        "--doc-tokens",
        "400",
        "--question-tokens",
        "8",
        "--max-num-batched-tokens",
        "128",
        "--disk-dir",
        str(tmp_path / "disk"),
    )
    assert code == 0 and result["errors"] == []
    tiers = result["tiers"]
    doc_blocks = 400 // 16
    assert tiers["device tier"]["cached_tokens"] == doc_blocks * 16
    assert tiers["device tier"]["bytes_moved"] == 0
    cpu = tiers["CPU tier"]
    assert cpu["blocks_moved"] == doc_blocks and cpu["cached_tokens"] == doc_blocks * 16
    assert cpu["bytes_moved"] == result["document_kv_bytes"] and cpu["gbps"] > 0
    for warm in (tiers["device tier"], cpu):  # each restore timed REPEATS times: the median
        assert len(warm["ttft_s_runs"]) == REPEATS
        assert warm["ttft_s"] == sorted(warm["ttft_s_runs"])[REPEATS // 2]
    disk = next(v for k, v in tiers.items() if k.startswith("disk tier"))
    assert disk["blocks_moved"] == doc_blocks and disk["gbps"] > 0
    refs = result["references"]
    assert refs["disk_record_files"] >= doc_blocks and refs["disk_read_gbps"] > 0
    assert disk["ratio_to_reference"] == pytest.approx(disk["gbps"] / refs["disk_read_gbps"])
    # The drive's own O_DIRECT read of a probe file is measured too (None where refused).
    direct = refs["disk_direct_read_gbps_by_requests"]
    assert set(direct) == {"1", "4", "16", "64"}
    assert refs["disk_read_gbps"] >= max(
        [*refs["disk_read_gbps_by_threads"].values(), *filter(None, direct.values())]
    )
    assert result["page_cache_drop"] in ("drop_caches", "fadvise", "none")
    assert not any((tmp_path / "disk").iterdir())  # records removed after the run


def test_tiers_without_the_disk_phases(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    code, result = _bench(tmp_path, "tiers", "--doc-tokens", "160", "--question-tokens", "4",
                          "--disk-dir", str(disk), "--skip-disk")  # fmt: skip
    assert code == 0 and result["errors"] == []
    assert set(result["tiers"]) == {"cold (computed)", "device tier", "CPU tier"}
    assert result["tiers"]["CPU tier"]["blocks_moved"] == 160 // 16
    assert "disk_read_gbps" not in result["references"] and not any(disk.iterdir())


def test_tiers_refuse_a_tier_smaller_than_the_document(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    code = main(
        [
            "bench",
            "tiers",
            "--model-shape",
            "tiny-llama",
            "--doc-tokens",
            "400",
            "--tier-gib",
            "0.0001",
            "--out",
            str(out),
        ]
    )
    assert code == 2  # a ValueError with the sizes, before any measurement


def test_throughput_floor_reads_fp8_bytes_with_fp8_weights(tmp_path: Path) -> None:
    shape = ModelShape(2, 4, 2, 16, 64, 128, 512)  # tiny-llama
    floors = {}
    for quantization in ("none", "fp8"):
        code, result = _bench(
            tmp_path, "throughput", "--num-prompts", "1", "--input-len", "4", "--output-len",
            "2", "--skip-transformers", "--peak-tflops", "0.5", "--peak-tbps", "0.01",
            "--quantization", quantization,
        )  # fmt: skip
        assert code == 0
        floors[quantization] = result["floor"]["weights_read_s"]
    # float32 on the CPU: 4 bytes a weight, against 1 (plus a float32 scale per channel).
    want = decode_weight_bytes(shape, 4, "fp8") / decode_weight_bytes(shape, 4)
    assert floors["fp8"] / floors["none"] == pytest.approx(want)
    assert want < 0.5


def test_floors_of_the_8b_shape_match_the_issue() -> None:
    shape = ModelShape(32, 32, 8, 128, 4096, 14336, 128256)
    assert LLAMA_3_1_8B["hidden_size"] == shape.hidden_size and TINY_LLAMA["num_hidden_layers"] == 2
    # 6.98 G non-embedding params; causal attention on top.
    assert prefill_flops(shape, 32768) / 791e12 == pytest.approx(0.934, rel=0.01)
    assert prefill_flops(shape, 131072) / 791e12 == pytest.approx(8.01, rel=0.01)
    # A decode step at 1k reads 15.0 GB of weights (no input embedding) and 134 MB of KV.
    step_bytes = decode_weight_bytes(shape, 2) + 1024 * shape.kv_bytes_per_token(torch.bfloat16)
    assert decode_floor_s(step_bytes, 0, 4.25) * 1e3 == pytest.approx(3.56, abs=0.01)
    one_request = generate_flops(shape, 512, 128)
    assert one_request == pytest.approx(
        prefill_flops(shape, 512) + sum(prefill_flops(shape, 1, 512 + s - 1) for s in range(1, 128))
    )


def test_ceiling_reports_burst_and_sustained_rates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ceiling.json"
    code = main(["bench", "ceiling", "--matmul", "256,128,192", "--burst-seconds", "0.02",
                 "--seconds", "0.1", "--copy-mib", "4", "--out", str(out)])  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    assert result["workload"]["matmul"] == [256, 128, 192]
    for figure in ("matmul_tflops", "copy_gbps"):
        rates = result[figure]
        assert rates["burst"] > 0 and rates["sustained"] > 0
        assert rates["sustained_seconds"] >= 0.1
    assert "sustained / burst" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [("--matmul", "64,64", "M,K,N"), ("--matmul", "64,0,64", ">= 1"), ("--seconds", "0", "> 0"),
     ("--copy-mib", "lots", "a number")],
)  # fmt: skip
def test_ceiling_refuses_bad_arguments(flag: str, value: str, message: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "ceiling", flag, value])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_startup_of_fresh_processes_with_empty_then_kept_caches(tmp_path: Path) -> None:
    code, result = _bench(tmp_path, "startup", "--max-num-batched-tokens", "128")
    assert code == 0 and result["errors"] == []
    for run in result["runs"].values():
        assert 0 < run["ready_s"] < run["first_token_s"]
        assert run["first_token_s"] == pytest.approx(run["ready_s"] + run["first_request_s"])
        assert run["first_chunk_ttft_s"] > 0 and run["peak_rss_bytes"] > 0
    assert list(result["runs"]) == ["empty compile caches", "compile caches kept"]
