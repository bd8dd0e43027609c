"""``ragserve bench throughput``: offline throughput against transformers ``generate``."""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import torch

from ragserve.bench.common import (
    load_transformers_model,
    peak_rss_mib,
    print_table,
    random_prompts,
    transformers_generate,
    write_json,
)
from ragserve.config import EngineConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--variable", action="store_true", help="input and output lengths uniform in [100, 1024]")
    parser.add_argument("--hf-batch-size", type=int, default=None, help="transformers batch (default: all prompts)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--out", default="bench-results/throughput.json")


def _workload(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    if not args.variable:
        return [args.input_len] * args.num_prompts, [args.output_len] * args.num_prompts
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randint(100, 1025, (args.num_prompts,), generator=generator).tolist()
    outputs = torch.randint(100, 1025, (args.num_prompts,), generator=generator).tolist()
    return inputs, outputs


def _run_ragserve(config: EngineConfig, input_lens: list[int], output_lens: list[int]) -> dict[str, Any]:
    from ragserve import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM.from_config(config)
    load_seconds = time.perf_counter() - started
    engine = llm.engine
    prompts = random_prompts(len(input_lens), input_lens, engine.loaded.model.shape.vocab_size)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]

    first = time.perf_counter()
    llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    startup = load_seconds + time.perf_counter() - first
    llm.reset_prefix_cache()

    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    llm.close()
    return {
        "seconds": seconds,
        "output_tokens": out_tokens,
        "startup_to_first_token_s": startup,
        "kv_utilisation": engine.stats.kv_utilisation,
        "prompts": prompts,
        "dtype": engine.dtype,
        "device": engine.device,
    }


def _run_transformers(
    config: EngineConfig, run: dict[str, Any], output_lens: list[int], batch_size: int
) -> dict[str, Any]:
    hf = load_transformers_model(config.model, config.load_format, run["dtype"], run["device"])
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    prompts = run["prompts"]
    seconds = 0.0
    useful = 0
    for start in range(0, len(prompts), batch_size):
        # NOTE: a padded batch generates its longest output for every row; only the tokens
        # each prompt asked for count as output.
        lengths = output_lens[start : start + batch_size]
        spent, _ = transformers_generate(hf, prompts[start : start + batch_size], max(lengths), batch_size, pad)
        seconds += spent
        useful += sum(lengths)
    return {"seconds": seconds, "output_tokens": useful, "batch_size": batch_size}


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    input_lens, output_lens = _workload(args)
    ours = _run_ragserve(config, input_lens, output_lens)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    in_tokens = sum(input_lens)

    def rates(result: dict[str, Any]) -> tuple[float, float]:
        return (result["output_tokens"] / result["seconds"],
                (in_tokens + result["output_tokens"]) / result["seconds"])

    shape = "variable" if args.variable else f"{args.input_len} in, {args.output_len} out"
    results: dict[str, Any] = {
        "workload": {"num_prompts": args.num_prompts, "lengths": shape, "model": config.model or "default",
                     "load_format": config.load_format, "dtype": str(ours["dtype"])},
        "ragserve": {k: ours[k] for k in ("seconds", "output_tokens", "startup_to_first_token_s", "kv_utilisation")},
    }
    out_rate, total_rate = rates(ours)
    results["ragserve"] |= {"output_tok_s": out_rate, "total_tok_s": total_rate, "peak_rss_mib": peak_rss_mib()}
    rows = [["ragserve", ours["seconds"], out_rate, total_rate, 1.0]]
    if not args.skip_transformers:
        theirs = _run_transformers(config, ours, output_lens, args.hf_batch_size or args.num_prompts)
        hf_out, hf_total = rates(theirs)
        speedup = theirs["seconds"] / ours["seconds"]
        rows[0][-1] = speedup
        rows.append(["transformers generate", theirs["seconds"], hf_out, hf_total, 1.0])
        results["transformers"] = theirs | {"output_tok_s": hf_out, "total_tok_s": hf_total}
        results["speedup_vs_transformers"] = speedup
    print_table(
        f"throughput: {args.num_prompts} prompts ({shape}), EOS ignored, {ours['dtype']} on {ours['device']}",
        ["engine", "seconds", "output tok/s", "total tok/s", "speed-up"],
        rows,
    )
    print(f"start-up to first token {ours['startup_to_first_token_s']:.1f}s, "
          f"KV utilisation {ours['kv_utilisation']:.1%}, peak RSS {peak_rss_mib():.0f} MiB")
    write_json(args.out, results)
    return 0
