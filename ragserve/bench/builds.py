"""Two builds of the native CPU kernels in one engine, alternated step by step (``--base REV``,
a git revision or a directory of kernel sources): each build's median prefill and decode
step, and their ratio.

Why: on a shared machine one process's speed drifts by a tenth over minutes, more than most
kernel changes are worth, so two processes run one after the other compare minutes rather
than builds. Here one engine runs with both libraries loaded, this tree's ``kernels/csrc``
and REV's (read with git, or the sources in REV where it is a directory), each step on one
of them in the order ABBA, so that both meet the same minutes. The workload is
``--batches`` batches of ``--num-prompts`` random prompts of ``--input-len`` tokens, each
generating ``--output-len`` greedy tokens (by default the CPU throughput shape, 32 x (256
in, 64 out)); the first batch warms both builds and is not counted. REV's kernels must take
the arguments this tree's ``kernels/cpu_native.py`` binds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

import kernels.cpu_native as cpu_native
from ragserve.bench.common import random_prompts
from ragserve.config import EngineConfig
from ragserve.table import print_table

BUILDS = ("base", "tree")
KINDS = ("prefill", "mixed", "decode")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base",
        required=True,
        help="git revision whose kernels to compare, or a directory of kernel sources",
    )
    parser.add_argument("--batches", type=int, default=3, help="batches (the first warms up)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", default=None, help="write the results here as JSON")


def base_sources(revision: str, into: Path) -> Path:
    """``kernels/csrc`` as of git ``revision``, written under ``into``. Raises RuntimeError
    where git cannot give one of the files this tree builds."""
    root = Path(cpu_native.__file__).resolve().parents[1]
    for name in (*cpu_native.SOURCES, *cpu_native.HEADERS):
        result = subprocess.run(
            ["git", "-C", str(root), "show", f"{revision}:kernels/csrc/{name}"],
            capture_output=True,
            check=False,
        )
        if result.returncode != 0:
            reason = result.stderr.decode(errors="replace").strip().splitlines()
            raise RuntimeError(f"no kernels/csrc/{name} at {revision!r}: {' '.join(reason[-1:])}")
        (into / name).write_bytes(result.stdout)
    return into


def step_kind(prompt_tokens: int, step_tokens: int) -> str:
    """``prefill`` for a step whose prompt tokens fill half its budget or more, ``decode`` for
    one without any, ``mixed`` between (a prompt's last chunk beside the running decodes)."""
    if prompt_tokens == 0:
        return "decode"
    return "prefill" if 2 * prompt_tokens >= step_tokens else "mixed"


def step_order(step: int) -> str:
    """The build of step ``step``: base, tree, tree, base, base, tree, ... (ABBA), so that
    neither build always runs right after the other."""
    return BUILDS[(step + step // 2) % 2]


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    from ragserve import LLM, SamplingParams

    if min(args.batches, args.num_prompts, args.input_len, args.output_len) < 1:
        raise SystemExit("--batches, --num-prompts, --input-len and --output-len must be >= 1")
    if args.batches < 2:
        raise SystemExit("--batches must be at least 2: the first only warms up")
    tree = cpu_native.load()
    if tree is None:
        raise SystemExit("the native CPU kernels cannot be built here (see the log)")
    with tempfile.TemporaryDirectory() as scratch:
        try:
            given = Path(args.base)
            sources = given if given.is_dir() else base_sources(args.base, Path(scratch))
            base = cpu_native.build_from(sources)
        except (RuntimeError, OSError) as exc:  # OSError: no git, or a library dlopen refuses
            raise SystemExit(f"cannot build the kernels of {args.base!r}: {exc}") from None
    libraries = {"base": base, "tree": tree}
    # NOTE: no async scheduling: a step must run its own forward on its own build.
    llm = LLM.from_config(dataclasses.replace(config, device="cpu", async_scheduling=False))
    engine = llm.engine
    vocab = engine.info.model_shape.vocab_size
    step_tokens = engine.info.max_num_batched_tokens
    dtype = str(engine.info.dtype).removeprefix("torch.")
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    times: dict[str, dict[str, list[float]]] = {b: {k: [] for k in KINDS} for b in BUILDS}
    step = 0
    try:
        for batch in tqdm(range(args.batches), desc="bench builds", unit="batch"):
            prompts = random_prompts(args.num_prompts, args.input_len, vocab, seed=batch)
            for index, prompt in enumerate(prompts):
                engine.add_request(f"{batch}-{index}", prompt, params)
            while engine.has_unfinished_requests():
                build = step_order(step)
                cpu_native.install(libraries[build])
                prompt_tokens = engine.stats.prompt_tokens_computed
                started = time.perf_counter()
                engine.step()
                elapsed = time.perf_counter() - started
                kind = step_kind(engine.stats.prompt_tokens_computed - prompt_tokens, step_tokens)
                if batch > 0:
                    times[build][kind].append(elapsed)
                step += 1
    finally:
        cpu_native.install(tree)
        llm.close()
    results = _summary(times)
    rows = [
        [kind, *(results["builds"][b][kind]["median_ms"] for b in BUILDS), results["ratio"][kind]]
        for kind in KINDS
    ]
    print_table(
        f"median step, ms ({args.batches - 1} batches of {args.num_prompts} x "
        f"({args.input_len}, {args.output_len}); base = {args.base})",
        ["step", "base", "tree", "tree / base"],
        rows,
    )
    if args.out:
        workload = {
            k: getattr(args, k) for k in ("batches", "num_prompts", "input_len", "output_len")
        }
        record = {"base": args.base, "dtype": dtype, "workload": workload, **results}
        Path(args.out).write_text(json.dumps(record, indent=1, default=str))
    return 0


def _summary(times: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    builds = {
        build: {
            kind: {
                "steps": len(values),
                "median_ms": statistics.median(values) * 1e3 if values else None,
            }
            for kind, values in times[build].items()
        }
        for build in BUILDS
    }
    ratio = {}
    for kind in KINDS:
        base, tree = builds["base"][kind]["median_ms"], builds["tree"][kind]["median_ms"]
        ratio[kind] = tree / base if base and tree else None
    return {"builds": builds, "ratio": ratio}
