"""``ragserve bench throughput``: offline throughput against transformers ``generate``."""

from __future__ import annotations

import argparse
import time
import traceback
from typing import Any

import torch

from ragserve.bench.common import (
    add_peak_arguments,
    for_its_device,
    int_at_least,
    load_transformers_model,
    peak_rss_mib,
    random_prompts,
    release_device_memory,
    resolve_peaks,
    succeeded,
    transformers_generate,
    transformers_generate_batch,
    write_json,
)
from ragserve.bench.shapes import (
    compute_floor_s,
    decode_weight_bytes,
    generate_flops,
    linear_flops,
)
from ragserve.config import EngineConfig
from ragserve.table import print_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int_at_least(1), default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--variable", action="store_true", help="input and output lengths uniform in [100, 1024]"
    )
    parser.add_argument(
        "--hf-batch-size", type=int, default=None, help="transformers batch (default: all prompts)"
    )
    parser.add_argument(
        "--hf-max-prompts",
        type=int,
        default=None,
        help="time transformers on an evenly spaced subset of this many prompts and compare rates",
    )
    parser.add_argument(
        "--hf-sort",
        action="store_true",
        help="transformers batches of similar output length (longest first) instead of arrival order",
    )
    parser.add_argument(
        "--hf-continuous",
        action="store_true",
        help="also time transformers' continuous batching (generate_batch); fixed lengths only",
    )
    parser.add_argument("--skip-transformers", action="store_true")
    add_peak_arguments(parser)
    parser.add_argument("--out", default="bench-results/throughput.json")


def _workload(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    if not args.variable:
        return [args.input_len] * args.num_prompts, [args.output_len] * args.num_prompts
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randint(100, 1025, (args.num_prompts,), generator=generator).tolist()
    outputs = torch.randint(100, 1025, (args.num_prompts,), generator=generator).tolist()
    return inputs, outputs


def _run_ragserve(
    config: EngineConfig, input_lens: list[int], output_lens: list[int]
) -> dict[str, Any]:
    from ragserve import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM.from_config(config)
    load_seconds = time.perf_counter() - started
    info = llm.info
    prompts = random_prompts(len(input_lens), input_lens, info.model_shape.vocab_size)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]

    first = time.perf_counter()
    succeeded(
        llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    )
    startup = load_seconds + time.perf_counter() - first
    llm.reset_prefix_cache()

    # NOTE: the whole workload runs twice, as transformers' does: the first run is reported
    # apart (first-use costs), the second is the timed figure; the prefix cache is emptied
    # in between so the second computes everything again.
    seconds_by_run = []
    for _ in range(2):
        started = time.perf_counter()
        outputs = succeeded(llm.generate(prompts, params, use_tqdm=True))
        if info.device.type == "cuda":
            torch.cuda.synchronize()
        seconds_by_run.append(time.perf_counter() - started)
        llm.reset_prefix_cache()
    first_run_s, seconds = seconds_by_run
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    kv_utilisation = llm.snapshot().kv_utilisation
    llm.close()
    return {
        "shape": info.model_shape,
        "weight_bytes": info.weight_bytes,
        "seconds": seconds,
        "first_run_s": first_run_s,
        "output_tokens": out_tokens,
        "startup_to_first_token_s": startup,
        "kv_utilisation": kv_utilisation,
        "prompts": prompts,
        "dtype": info.dtype,
        "quantization": info.quantization,
        "device": info.device,
    }


def _hf_subset(count: int, limit: int | None) -> list[int]:
    """Indices of ``limit`` evenly spaced prompts (all when ``limit`` is None or too big)."""
    if limit is None or limit >= count:
        return list(range(count))
    if limit < 1:
        raise ValueError(f"--hf-max-prompts must be >= 1, got {limit}")
    return [index * count // limit for index in range(limit)]


def _run_transformers(
    config: EngineConfig,
    run: dict[str, Any],
    input_lens: list[int],
    output_lens: list[int],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """transformers ``generate`` in padded batches; only the tokens each prompt asked for count."""
    chosen = _hf_subset(len(output_lens), args.hf_max_prompts)
    if args.hf_sort:
        chosen.sort(key=lambda i: (output_lens[i], input_lens[i]), reverse=True)
    batch_size = args.hf_batch_size or len(chosen)
    free_gib = None
    if torch.cuda.is_available():
        free_gib = torch.cuda.mem_get_info()[0] / 2**30
        print(f"device memory free before transformers loads: {free_gib:.1f} GiB", flush=True)
    hf = load_transformers_model(config.model, config.load_format, run["dtype"], run["device"])
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    seconds = 0.0
    useful = 0
    batch_seconds = []
    try:
        # NOTE: the first batch runs once untimed at the very shape it is then timed at: a
        # cold first batch took twice a warm one on an NVIDIA H200 (first-use allocations,
        # kernel picks), and a shorter warm-up left part of that in the timed run.
        first = chosen[:batch_size]
        first_run_s, _ = transformers_generate(
            hf,
            [run["prompts"][i] for i in first],
            max(output_lens[i] for i in first),
            batch_size,
            pad,
        )
        print(
            f"transformers first run (untimed): {len(first)} prompts in {first_run_s:.1f} s",
            flush=True,
        )
        for start in range(0, len(chosen), batch_size):
            batch = chosen[start : start + batch_size]
            # NOTE: a padded batch generates its longest output for every row.
            longest = max(output_lens[i] for i in batch)
            spent, _ = transformers_generate(
                hf, [run["prompts"][i] for i in batch], longest, batch_size, pad
            )
            seconds += spent
            batch_seconds.append(spent)
            useful += sum(output_lens[i] for i in batch)
            print(
                f"transformers batch {start // batch_size + 1}: {len(batch)} prompts x {longest} "
                f"steps in {spent:.1f} s",
                flush=True,
            )
    finally:
        del hf
        release_device_memory()
    return {
        "seconds": seconds,
        "output_tokens": useful,
        "batch_size": batch_size,
        "first_run_s": first_run_s,
        "batch_seconds": batch_seconds,
        "device_free_gib_at_start": free_gib,
        "num_prompts": len(chosen),
        "input_tokens": sum(input_lens[i] for i in chosen),
        "sorted_by_length": args.hf_sort,
    }


def _run_transformers_continuous(
    config: EngineConfig, run: dict[str, Any], output_len: int, chosen: list[int]
) -> dict[str, Any]:
    """transformers' ``generate_batch`` over the same prompts, timed on its second run (the
    first, at the same shape, is reported as ``first_run_s``)."""
    hf = load_transformers_model(config.model, config.load_format, run["dtype"], run["device"])
    try:
        prompts = [run["prompts"][i] for i in chosen]
        first_run_s, _ = transformers_generate_batch(hf, prompts, output_len)
        seconds, produced = transformers_generate_batch(hf, prompts, output_len)
        print(
            f"transformers generate_batch: {len(prompts)} prompts, {produced} tokens in {seconds:.1f} s "
            f"(first run {first_run_s:.1f} s, untimed)",
            flush=True,
        )
    finally:
        del hf
        release_device_memory()
    return {
        "seconds": seconds,
        "output_tokens": produced,
        "first_run_s": first_run_s,
        "num_prompts": len(chosen),
    }


def _floor(
    run: dict[str, Any], input_lens: list[int], output_lens: list[int], args: argparse.Namespace
) -> dict[str, float]:
    """Lower bound on the workload's time: all its FLOPs at the matmul ceiling, or reading
    the weights a decode step reads once per step of the longest request, whichever is
    longer."""
    flops = sum(
        generate_flops(run["shape"], i, o) for i, o in zip(input_lens, output_lens, strict=True)
    )
    fp8_flops = 0.0
    if run["quantization"] == "fp8":
        tokens = sum(i + max(0, o - 1) for i, o in zip(input_lens, output_lens, strict=True))
        fp8_flops = linear_flops(run["shape"], tokens)
    compute = compute_floor_s(flops, fp8_flops, args.peak_tflops, args.peak_fp8_tflops)
    step_bytes = decode_weight_bytes(run["shape"], run["dtype"].itemsize, run["quantization"])
    memory = max(output_lens) * step_bytes / (args.peak_tbps * 1e12)
    return {
        "flops": flops,
        "compute_s": compute,
        "weights_read_s": memory,
        "seconds": max(compute, memory),
    }


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    config = for_its_device(config)
    if args.hf_continuous and args.variable:
        raise ValueError(
            "--hf-continuous needs fixed lengths: generate_batch takes one max_new_tokens"
        )
    input_lens, output_lens = _workload(args)
    ours = _run_ragserve(config, input_lens, output_lens)
    release_device_memory()
    in_tokens = sum(input_lens)

    shape = "variable 100..1024" if args.variable else f"{args.input_len} in, {args.output_len} out"
    results: dict[str, Any] = {
        "workload": {
            "num_prompts": args.num_prompts,
            "lengths": shape,
            "model": config.model or "default",
            "load_format": config.load_format,
            "dtype": str(ours["dtype"]),
            "quantization": ours["quantization"],
            "input_tokens": in_tokens,
            "output_tokens": sum(output_lens),
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
        },
        "ragserve": {
            k: ours[k]
            for k in (
                "seconds",
                "first_run_s",
                "output_tokens",
                "startup_to_first_token_s",
                "kv_utilisation",
            )
        },
        "errors": [],
    }
    out_rate = ours["output_tokens"] / ours["seconds"]
    total_rate = (in_tokens + ours["output_tokens"]) / ours["seconds"]
    results["ragserve"] |= {
        "output_tok_s": out_rate,
        "total_tok_s": total_rate,
        "peak_rss_mib": peak_rss_mib(),
    }
    floor = (
        _floor(ours, input_lens, output_lens, args) if resolve_peaks(args, ours["device"]) else None
    )
    if floor is not None:
        results["floor"] = floor | {
            "peak_tflops": args.peak_tflops,
            "peak_fp8_tflops": args.peak_fp8_tflops if ours["quantization"] == "fp8" else None,
            "peak_tbps": args.peak_tbps,
        }
    rows: list[list[Any]] = [
        [
            "ragserve",
            ours["seconds"],
            out_rate,
            total_rate,
            None,
            ours["seconds"] / floor["seconds"] if floor else None,
        ]
    ]
    print(
        f"ragserve: {ours['seconds']:.1f} s, {out_rate:.0f} output tok/s, "
        f"KV utilisation {ours['kv_utilisation']:.1%}",
        flush=True,
    )
    write_json(args.out, results, quiet=True)
    if not args.skip_transformers:
        try:
            theirs = _run_transformers(config, ours, input_lens, output_lens, args)
            hf_out = theirs["output_tokens"] / theirs["seconds"]
            hf_total = (theirs["input_tokens"] + theirs["output_tokens"]) / theirs["seconds"]
            # NOTE: on a subset only the rates compare; on the whole workload this equals
            # the ratio of seconds.
            speedup = out_rate / hf_out
            rows[0][4] = speedup
            label = "transformers generate"
            if theirs["num_prompts"] < len(input_lens):
                label += f" ({theirs['num_prompts']} of {len(input_lens)} prompts, rate)"
            rows.append([label, theirs["seconds"], hf_out, hf_total, 1.0, None])
            results["transformers"] = theirs | {"output_tok_s": hf_out, "total_tok_s": hf_total}
            results["speedup_vs_transformers"] = speedup
        except Exception as exc:  # NOTE: keep the engine's figures; the JSON says what failed.
            traceback.print_exc()
            results["errors"].append(f"transformers: {type(exc).__name__}: {exc}")
            release_device_memory()
    if args.hf_continuous and not args.skip_transformers:
        try:
            chosen = _hf_subset(len(output_lens), args.hf_max_prompts)
            continuous = _run_transformers_continuous(config, ours, output_lens[0], chosen)
            rate = continuous["output_tokens"] / continuous["seconds"]
            total = (sum(input_lens[i] for i in chosen) + continuous["output_tokens"]) / continuous[
                "seconds"
            ]
            results["transformers_generate_batch"] = continuous | {
                "output_tok_s": rate,
                "total_tok_s": total,
            }
            results["speedup_vs_transformers_generate_batch"] = out_rate / rate
            rows.append(
                [
                    "transformers generate_batch",
                    continuous["seconds"],
                    rate,
                    total,
                    out_rate / rate,
                    None,
                ]
            )
        except Exception as exc:  # NOTE: as above, the engine's figures stay
            traceback.print_exc()
            results["errors"].append(f"transformers generate_batch: {type(exc).__name__}: {exc}")
            release_device_memory()
    if floor is not None:
        rows.append(
            [
                f"floor ({args.peak_tflops:g} TFLOP/s, {args.peak_tbps:g} TB/s)",
                floor["seconds"],
                sum(output_lens) / floor["seconds"],
                (in_tokens + sum(output_lens)) / floor["seconds"],
                None,
                1.0,
            ]
        )
    print_table(
        f"throughput: {args.num_prompts} prompts ({shape}), EOS ignored, {ours['dtype']} on {ours['device']}",
        ["engine", "seconds", "output tok/s", "total tok/s", "speed-up (output tok/s)", "x floor"],
        rows,
    )
    print(
        f"start-up to first token {ours['startup_to_first_token_s']:.1f}s, "
        f"KV utilisation (tokens stored / slots allocated, averaged over steps) "
        f"{ours['kv_utilisation']:.1%}, peak RSS of the engine {results['ragserve']['peak_rss_mib']:.0f} MiB"
    )
    write_json(args.out, results)
    return 1 if results["errors"] else 0
