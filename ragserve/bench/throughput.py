"""``ragserve bench throughput``: offline throughput against transformers ``generate``."""

from __future__ import annotations

import argparse
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--variable", action="store_true", help="input and output lengths uniform in [100, 1024]")
    parser.add_argument("--hf-batch-size", type=int, default=None, help="transformers batch (default: all prompts)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--out", default="bench-results/throughput.json")


def run(args: argparse.Namespace, config: Any) -> int:
    from ragserve import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM.from_config(config)
    load_seconds = time.perf_counter() - started
    engine = llm.engine
    dtype, device = engine.dtype, engine.device
    vocab = engine.loaded.model.shape.vocab_size
    if args.variable:
        generator = torch.Generator().manual_seed(1)
        input_lens = torch.randint(100, 1025, (args.num_prompts,), generator=generator).tolist()
        output_lens = torch.randint(100, 1025, (args.num_prompts,), generator=generator).tolist()
    else:
        input_lens = [args.input_len] * args.num_prompts
        output_lens = [args.output_len] * args.num_prompts
    prompts = random_prompts(args.num_prompts, input_lens, vocab)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]

    first = time.perf_counter()
    llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    first_token_seconds = load_seconds + time.perf_counter() - first
    llm.reset_prefix_cache()

    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_tokens = sum(input_lens)
    results: dict[str, Any] = {
        "workload": {"num_prompts": args.num_prompts, "input_lens": "uniform 100..1024" if args.variable else args.input_len,
                     "output_lens": "uniform 100..1024" if args.variable else args.output_len},
        "ragserve": {"seconds": seconds, "output_tok_s": out_tokens / seconds,
                     "total_tok_s": (in_tokens + out_tokens) / seconds,
                     "startup_to_first_token_s": first_token_seconds, "peak_rss_mib": peak_rss_mib()},
    }
    rows = [["ragserve", f"{seconds:.2f}", out_tokens / seconds, (in_tokens + out_tokens) / seconds, 1.0]]
    if not args.skip_transformers:
        del llm, engine, outputs
        hf = load_transformers_model(config.model, config.load_format, dtype, device)
        hf_batch = args.hf_batch_size or args.num_prompts
        pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
        # One generate per distinct output length keeps "EOS ignored" exact for both.
        hf_seconds = 0.0
        hf_out = 0
        for length in sorted(set(output_lens)):
            group = [p for p, n in zip(prompts, output_lens, strict=True) if n == length]
            s, n = transformers_generate(hf, group, length, hf_batch, pad)
            hf_seconds += s
            hf_out += n
        ratio = hf_seconds / seconds
        rows.append(["transformers generate", f"{hf_seconds:.2f}", hf_out / hf_seconds,
                     (in_tokens + hf_out) / hf_seconds, 1 / ratio])
        rows[0][-1] = ratio
        results["transformers"] = {"seconds": hf_seconds, "batch_size": hf_batch,
                                   "output_tok_s": hf_out / hf_seconds,
                                   "total_tok_s": (in_tokens + hf_out) / hf_seconds}
        results["speedup_vs_transformers"] = ratio
    print_table(
        f"throughput: {args.num_prompts} prompts x ({'variable' if args.variable else args.input_len} in, "
        f"{'variable' if args.variable else args.output_len} out), EOS ignored",
        ["engine", "seconds", "output tok/s", "total tok/s", "speed-up"],
        rows,
    )
    print(f"start-up to first token {first_token_seconds:.1f}s, peak RSS {peak_rss_mib():.0f} MiB")
    write_json(args.out, results)
    return 0


