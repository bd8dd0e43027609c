"""``ragserve bench builds``: two builds of the native CPU kernels alternated in one engine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kernels import cpu_native
from ragserve.bench.builds import base_sources, step_kind, step_order
from ragserve.cli import main

needs_native = pytest.mark.skipif(cpu_native.load() is None, reason="no native CPU kernels")
REPO = Path(__file__).resolve().parents[2]
needs_git = pytest.mark.skipif(
    shutil.which("git") is None or not (REPO / ".git").exists(), reason="not a git checkout"
)


def test_steps_alternate_abba() -> None:
    assert [step_order(i) for i in range(8)] == [
        "base", "tree", "tree", "base", "base", "tree", "tree", "base",
    ]  # fmt: skip


def test_steps_are_told_apart_by_their_prompt_tokens() -> None:
    assert step_kind(0, 4096) == "decode"
    assert step_kind(16, 4096) == "mixed"  # a prompt's last chunk beside the decodes
    assert step_kind(2048, 4096) == step_kind(4096, 4096) == "prefill"


@needs_git
def test_base_sources_are_the_revisions_files(tmp_path: Path) -> None:
    written = base_sources("HEAD", tmp_path)
    assert sorted(p.name for p in written.iterdir()) == sorted(
        (*cpu_native.SOURCES, *cpu_native.HEADERS)
    )
    assert (written / "cpu_kernels.h").read_text().startswith("/*")


@needs_git
def test_an_unknown_revision_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"no kernels/csrc/.* at 'no-such-revision'"):
        base_sources("no-such-revision", tmp_path)


@pytest.mark.e2e
@needs_native
@needs_git
def test_bench_builds_times_both_builds_and_restores_the_tree(tmp_path: Path) -> None:
    tree = cpu_native.load()
    out = tmp_path / "builds.json"
    code = main(
        [
            "bench", "builds", "--base", "HEAD", "--model-shape", "tiny-llama",
            "--dtype", "bfloat16", "--batches", "2", "--num-prompts", "3",
            "--input-len", "16", "--output-len", "5", "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    record = json.loads(out.read_text())
    assert record["base"] == "HEAD"
    assert record["dtype"] == "bfloat16"
    # one counted batch: its 48 prompt tokens in one step (under half the budget: mixed),
    # then 4 decode steps
    builds = record["builds"]
    kinds = ("prefill", "mixed", "decode")
    steps = {b: {k: builds[b][k]["steps"] for k in kinds} for b in ("base", "tree")}
    assert sum(s["prefill"] for s in steps.values()) == 0
    assert sum(s["mixed"] for s in steps.values()) == 1
    assert sum(s["decode"] for s in steps.values()) == 4
    assert min(steps["base"]["decode"], steps["tree"]["decode"]) == 2
    assert record["ratio"]["decode"] > 0
    assert cpu_native.load() is tree


@needs_native
@needs_git
def test_a_bad_revision_stops_the_command() -> None:
    with pytest.raises(SystemExit, match="cannot build the kernels of 'no-such-revision'"):
        main(
            ["bench", "builds", "--base", "no-such-revision", "--model-shape", "tiny-llama"]
        )  # fmt: skip


@needs_native
def test_a_directory_without_the_kernels_is_refused(tmp_path: Path) -> None:
    (tmp_path / "cpu_attention.c").write_text("int x;\n")
    with pytest.raises(RuntimeError, match=r"has no cpu_layer_ops\.c"):
        cpu_native.build_from(tmp_path)
