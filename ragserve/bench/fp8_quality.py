"""``ragserve bench fp8-quality``: how far 8-bit KV (fp8 or int8), FP8 weights and both move
a real model's next-token distributions from the same engine in the model's dtype.

Prompts are RAG questions over 1 to 8 documents of the pool (1k to 8k tokens with the
default sizes). The baseline engine answers each greedily; the baseline and every variant
are then teacher-forced along that answer: step ``t`` asks for one token after the prompt
plus the first ``t`` answer tokens (prefix caching keeps that to the new tokens, computed
through the engine's own KV, as decoding would). Per variant:

- ``top1_agreement``: the steps whose most likely token is the baseline's greedy answer
  token. The greedy answer was decoded with other step shapes than the teacher-forced
  steps, so the baseline itself scores below 1.0 where near ties flip with rounding: this
  mixes the variant's deviation with that noise.
- ``top1_forced_agreement``: the steps whose most likely token is the teacher-forced
  baseline's at the same step (same prompts, same step shapes): the baseline scores 1.0
  and only the variant's own deviation counts.
- ``mean_kl``: KL(teacher-forced baseline || variant), over the baseline's ``--top`` most
  likely tokens with the rest as one outcome (below the full KL where both lists hold
  those tokens, since merging outcomes never raises it).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

from ragserve.bench.common import release_device_memory, succeeded, write_json
from ragserve.bench.rag_workload import make_pool, make_questions
from ragserve.config import EngineConfig
from ragserve.table import print_table

VARIANTS: dict[str, dict[str, Any]] = {  # name: engine settings that differ from the baseline
    # NOTE: the yardstick: the baseline's dtype with other step shapes (rounding noise alone)
    "baseline with 512-token steps": {"max_num_batched_tokens": 512},
    "fp8 KV": {"kv_cache_dtype": "fp8"},
    "int8 KV": {"kv_cache_dtype": "int8"},
    "fp8 weights": {"quantization": "fp8"},
    "fp8 weights + KV": {"kv_cache_dtype": "fp8", "quantization": "fp8"},
    "fp8 weights + int8 KV": {"kv_cache_dtype": "int8", "quantization": "fp8"},
}

TopLogprobs = dict[int, float]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--pool-docs", type=int, default=16)
    parser.add_argument("--doc-tokens", type=int, default=1000)
    parser.add_argument("--docs-per-prompt", default="1,8", help="min,max")
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--top", type=int, default=20, help="logprobs per step (at most 20)")
    parser.add_argument(
        "--variants",
        type=_variant_names,
        default=list(VARIANTS),
        help=f"comma-separated, of: {', '.join(VARIANTS)}",
    )
    parser.add_argument("--out", default="bench-results/fp8_quality.json")


def _variant_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown variants {unknown}; choose from: {', '.join(VARIANTS)}"
        )
    return names


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    from ragserve import LLM

    low, high = (int(x) for x in args.docs_per_prompt.split(","))
    baseline = LLM.from_config(config)
    tokenizer = baseline.engine.tokenizer
    if tokenizer is None:
        raise SystemExit("fp8-quality needs a model with a tokenizer (real weights)")
    docs, asks = make_pool(tokenizer, args.pool_docs, args.doc_tokens)
    prompts = [
        q.token_ids for q in make_questions(tokenizer, docs, asks, args.num_prompts, (low, high))
    ]
    answers = greedy_answers(baseline, prompts, args.answer_tokens)
    reference = teacher_forced(baseline, prompts, answers, args.top)
    baseline.close()
    del baseline
    release_device_memory()
    results: dict[str, Any] = {
        "workload": {k: v for k, v in vars(args).items() if k != "func"},
        "dtype": config.dtype,
        "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
    }
    rows: list[list[Any]] = []

    def record(name: str, steps: list[list[TopLogprobs]]) -> None:
        scores = compare(reference, steps, answers)
        results[name] = dataclasses.asdict(scores)
        rows.append([name, scores.top1_agreement, scores.top1_forced_agreement, scores.mean_kl])
        write_json(args.out, results, quiet=True)

    record("baseline, teacher-forced", reference)
    for name in args.variants:
        with LLM.from_config(dataclasses.replace(config, **VARIANTS[name])) as llm:
            steps = teacher_forced(llm, prompts, answers, args.top)
        release_device_memory()
        record(name, steps)
    print_table(
        f"fp8 quality: {len(prompts)} prompts of {results['prompt_tokens'][0]}-"
        f"{results['prompt_tokens'][1]} tokens, {args.answer_tokens} answer tokens each, "
        f"against the {config.dtype} engine",
        [
            "variant",
            "top-1 vs greedy answer",
            "top-1 vs forced baseline",
            f"mean KL (top-{args.top} + rest)",
        ],
        rows,
    )
    write_json(args.out, results)
    return 0


def greedy_answers(llm: Any, prompts: list[list[int]], length: int) -> list[list[int]]:
    from ragserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in succeeded(llm.generate(prompts, params))]


def teacher_forced(
    llm: Any, prompts: list[list[int]], answers: list[list[int]], top: int
) -> list[list[TopLogprobs]]:
    """Per prompt, per answer step: the engine's ``top`` logprobs for the next token."""
    from ragserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=top)
    steps: list[list[TopLogprobs]] = [[] for _ in prompts]
    for t in range(len(answers[0])):
        batch = [p + a[:t] for p, a in zip(prompts, answers, strict=True)]
        for row, out in enumerate(succeeded(llm.generate(batch, params, use_tqdm=False))):
            (logprobs,) = out.outputs[0].logprobs
            steps[row].append({token: lp.logprob for token, lp in logprobs.items()})
    return steps


@dataclasses.dataclass(frozen=True)
class Scores:
    """One variant against the baseline (the module docstring says what each measures)."""

    top1_agreement: float  # with the baseline's greedy answer
    top1_forced_agreement: float  # with the teacher-forced baseline's top-1, step by step
    mean_kl: float


def compare(
    reference: list[list[TopLogprobs]], variant: list[list[TopLogprobs]], answers: list[list[int]]
) -> Scores:
    """A variant's teacher-forced steps against the baseline's, over all steps."""
    agree, forced, kls = 0, 0, []
    for ref_steps, var_steps, answer in zip(reference, variant, answers, strict=True):
        for ref, var, token in zip(ref_steps, var_steps, answer, strict=True):
            top = max(var, key=var.__getitem__)
            agree += top == token
            forced += top == max(ref, key=ref.__getitem__)
            kls.append(top_kl(ref, var))
    return Scores(agree / len(kls), forced / len(kls), sum(kls) / len(kls))


def top_kl(ref: TopLogprobs, var: TopLogprobs) -> float:
    """KL over the reference's listed tokens plus one 'rest' outcome. A token the variant did
    not list gets the variant's smallest listed probability (it is at most that)."""
    floor = min(var.values())
    p = {token: math.exp(lp) for token, lp in ref.items()}
    q = {token: math.exp(var.get(token, floor)) for token in ref}
    p_rest, q_rest = max(0.0, 1 - sum(p.values())), max(1e-12, 1 - sum(q.values()))
    kl = sum(p[t] * (math.log(p[t]) - math.log(q[t])) for t in p if p[t] > 0)
    if p_rest > 0:
        kl += p_rest * (math.log(p_rest) - math.log(q_rest))
    return max(0.0, kl)
