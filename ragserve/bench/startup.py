"""``ragserve bench startup``: start-up of a fresh process, with empty compile caches and then
with the caches the first process left, as its own figure apart from the timed runs.

Each run is a new Python process (the ``bench cpu`` driver, which imports nothing heavy
before it is timed): spawn to engine ready (imports, weights, KV pool, CUDA graphs), then
its first request (a few tokens: the first kernel compilations and plan building), then a
prompt of one full chunk. The first run points Triton's and Inductor's caches at an empty
directory, as on a machine's first start; the second keeps what the first compiled, as on
every later start.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

from ragserve.bench.common import (
    for_its_device,
    machine_description,
    random_prompts,
    write_json,
)
from ragserve.bench.cpu_engines import make_variants, run_variant
from ragserve.config import EngineConfig
from ragserve.table import print_table

RUNS = ("empty compile caches", "compile caches kept")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds one process may take in all"
    )
    parser.add_argument("--out", default="bench-results/startup.json")


def _spec(config: EngineConfig, vocab: int) -> dict[str, Any]:
    chunk = random_prompts(1, config.step_tokens, vocab, seed=11)[0]
    return {
        "phases": [{"kind": "ttft", "prompt_sets": [[chunk]]}],
        "warmup_prompt": random_prompts(1, 8, vocab, seed=3)[0],
        "ragserve_config": dataclasses.asdict(config),
    }


def _vocab(config: EngineConfig) -> int:
    """The model's vocabulary from its config.json (prompts are random token ids below it)."""
    path = Path(config.model or "") / "config.json"
    if config.model and path.is_file():
        return int(json.loads(path.read_text())["vocab_size"])
    return 32000  # NOTE: the embedded default model's tokenizer has 49,152 ids; any lower works


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    config = for_its_device(config)
    results: dict[str, Any] = {"machine": machine_description(), "runs": {}, "errors": []}
    with tempfile.TemporaryDirectory(prefix="ragserve-startup-") as scratch:
        work = Path(scratch)
        spec_path = work / "spec.json"
        spec_path.write_text(json.dumps(_spec(config, _vocab(config))))
        caches = {
            "TRITON_CACHE_DIR": str(work / "triton"),
            "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"),
        }
        variant = make_variants(None, None, caches)[0][0]  # ragserve as users start it
        for name in RUNS:
            print(f"starting a fresh process ({name})", flush=True)
            outcome = run_variant(
                variant, spec_path, work / "driver.log", lambda _: None, args.timeout
            )
            if outcome.get("returncode") != 0 or "startup_s" not in outcome:
                results["errors"].append(
                    f"{name}: exit {outcome.get('returncode')}: {outcome.get('log_tail', '')[-500:]}"
                )
                continue
            chunk_s = next(iter(outcome.get("phases", {}).get("ttft", {}).values()), None)
            results["runs"][name] = {
                "ready_s": outcome["startup_s"],
                "first_request_s": outcome["first_request_s"],
                "first_token_s": outcome["startup_s"] + outcome["first_request_s"],
                "first_chunk_ttft_s": chunk_s,
                "peak_rss_bytes": outcome["peak_rss_bytes"],
                "attention_backend": outcome.get("attention_backend"),
            }
    results["workload"] = {"chunk_tokens": config.max_num_batched_tokens, "model": config.model}
    runs = results["runs"]
    print_table(
        f"start-up of a fresh process (seconds from spawn); then one prompt of "
        f"{config.max_num_batched_tokens} tokens",
        ["", *RUNS],
        [
            [label, *(runs.get(name, {}).get(key) for name in RUNS)]
            for label, key in (
                ("engine ready", "ready_s"),
                ("first request (8 tokens in, 2 out)", "first_request_s"),
                ("first token of the first request", "first_token_s"),
                ("then one chunk, TTFT", "first_chunk_ttft_s"),
            )
        ],
    )
    write_json(args.out, results)
    return 1 if results["errors"] else 0
