"""``ragserve generate``: offline generation from the command line (a quick demo)."""

from __future__ import annotations

import argparse
import time

from ragserve.cli import Subparsers, add_engine_args, engine_config_from_args


def add_parser(subparsers: Subparsers, name: str) -> None:
    parser = subparsers.add_parser(name, help="generate text offline for a few prompts")
    parser.add_argument("prompts", nargs="*", help="user messages (chat template applied)")
    parser.add_argument(
        "--raw", action="store_true", help="send prompts as-is, without the chat template"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--sample-seed", type=int, default=None)
    add_engine_args(parser)
    parser.set_defaults(func=run)


DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about paged memory.",
    "Explain in one sentence why caching a document's KV helps.",
]


def run(args: argparse.Namespace) -> int:
    from ragserve.llm import LLM
    from ragserve.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.sample_seed,
    )
    started = time.perf_counter()
    llm = LLM.from_config(engine_config_from_args(args))
    prompts = args.prompts or DEMO_PROMPTS
    if args.raw:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outputs = llm.chat(
            [[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False
        )
    for prompt, output in zip(prompts, outputs, strict=True):
        answer = f"(failed: {output.error})" if output.error else output.outputs[0].text.strip()
        print(f"> {prompt}\n{answer}\n")
    print(f"({time.perf_counter() - started:.1f}s including model load)")
    return 1 if any(output.error for output in outputs) else 0
