"""``ragserve bench rag``: questions over 4 to 8 documents from a pool, each in a fresh
random order: full prefill vs prefix caching vs blend at several recompute ratios (TTFT,
prompt tokens computed, greedy answers equal to full prefill's), and blend quality against
full prefill (teacher-forced KL over the answer, up to its end) for the selection rules of
``rag_quality.py``, with bf16-vs-float32 rounding as the yardstick of noise.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm

from ragserve.bench.common import load_transformers_model, time_request, write_json
from ragserve.bench.rag_quality import RULES, BlendEmulator, score
from ragserve.bench.rag_workload import (
    RagQuestion,
    make_pool,
    make_questions,
    random_workload,
)
from ragserve.config import EngineConfig
from ragserve.table import print_table


def parse_rules(text: str) -> tuple[str, ...]:
    """``--rules``: comma-separated, each named once, in the order given."""
    rules = tuple(dict.fromkeys(rule.strip() for rule in text.split(",") if rule.strip()))
    unknown = [rule for rule in rules if rule not in RULES]
    if unknown or not rules:
        raise argparse.ArgumentTypeError(
            f"unknown selection rule(s) {', '.join(unknown) or '(none given)'}; "
            f"choose from {', '.join(RULES)}"
        )
    return rules


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pool-docs", type=int, default=8)
    parser.add_argument("--doc-tokens", type=int, default=1000)
    parser.add_argument("--docs-per-question", default="4,8", help="min,max")
    parser.add_argument("--num-questions", type=int, default=12)
    parser.add_argument("--ratios", default="0,0.05,0.15,0.3,0.5,1", help="blend recompute ratios")
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument(
        "--rules",
        type=parse_rules,
        default=RULES,
        help=f"selection rules whose quality to measure, of {','.join(RULES)} "
        "(rag_quality.py says what each does)",
    )
    parser.add_argument("--skip-engine", action="store_true", help="quality only")
    parser.add_argument("--skip-quality", action="store_true", help="engine timings only")
    parser.add_argument("--quality-questions", type=int, default=None, help="default: all")
    parser.add_argument("--out", default="bench-results/rag.json")
    parser.add_argument("--plot", default="bench-results/rag_quality.png")


@dataclasses.dataclass
class Answer:
    tokens: list[int]
    ttft_s: float
    computed: int  # prompt tokens the engine ran for this question (segments included)
    cached: int
    blended: int


def ask(
    llm: Any, request_id: str, question: RagQuestion, answer_tokens: int, **reuse: Any
) -> Answer:
    before = llm.snapshot().prompt_tokens_computed
    timing = time_request(
        llm.engine,
        question.token_ids,
        answer_tokens,
        request_id=request_id,
        documents=question.spans,
        **reuse,
    )
    return Answer(
        timing.token_ids,
        timing.ttft_s,
        llm.snapshot().prompt_tokens_computed - before,
        timing.num_cached_tokens,
        timing.num_blended_tokens,
    )


def ingest(llm: Any, docs: list[list[int]], head: list[int], blend: bool) -> None:
    """Each pool document computed once before the questions, as an upload would: its
    prefix after the head, and (blend) its segment."""
    from ragserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1)
    for index, doc in enumerate(docs):
        other = docs[(index + 1) % len(docs)]
        prompt = head + (other + doc if blend else doc) + head[:1]
        spans = [(len(head), len(head) + len(other)), (len(head) + len(other), len(prompt) - 1)]
        kwargs: dict[str, Any] = {"documents": spans} if blend else {}
        llm.engine.add_request(f"ingest-{index}", prompt, params, **kwargs)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        if blend:  # its prefix too
            llm.engine.add_request(f"ingest-p{index}", head + doc + head[:1], params)
            while llm.engine.has_unfinished_requests():
                llm.engine.step()


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    from ragserve import LLM

    ratios = [float(r) for r in args.ratios.split(",")]
    low, high = (int(x) for x in args.docs_per_question.split(","))
    results: dict[str, Any] = {"workload": {k: v for k, v in vars(args).items() if k != "func"}}
    probe = LLM.from_config(dataclasses.replace(config, enable_prefix_caching=False))
    tokenizer, device = probe.engine.tokenizer, probe.info.device
    if tokenizer is None:  # NOTE: random weights of a real shape: timings only
        vocab = probe.info.model_shape.vocab_size
        docs, questions = random_workload(
            vocab, args.pool_docs, args.doc_tokens, args.num_questions, (low, high)
        )
        args.skip_quality = True
    else:
        docs, asks = make_pool(tokenizer, args.pool_docs, args.doc_tokens)
        questions = make_questions(tokenizer, docs, asks, args.num_questions, (low, high))
    head = questions[0].token_ids[: questions[0].spans[0][0]]
    results["prompt_tokens_mean"] = sum(len(q.token_ids) for q in questions) / len(questions)
    if not args.skip_engine:
        results["engine"] = engine_columns(args, config, probe, docs, head, questions, ratios)
        write_json(args.out, results)
    del probe
    if not args.skip_quality:
        count = args.quality_questions or len(questions)
        results["quality"] = quality(args, config, device, questions[:count], ratios)
        write_json(args.out, results)
        plot(results["quality"], args.plot)
    return 0


def engine_columns(
    args: argparse.Namespace,
    config: EngineConfig,
    full: Any,
    docs: list[list[int]],
    head: list[int],
    questions: list[RagQuestion],
    ratios: list[float],
) -> dict[str, Any]:
    from ragserve import LLM

    def engine(reuse: str) -> Any:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        llm = LLM.from_config(dataclasses.replace(config, kv_reuse=reuse))
        ingest(llm, docs, head, blend=reuse == "blend")
        return llm

    # NOTE: one engine at a time (each takes its KV budget), each with the pool ingested.
    modes: list[tuple[str, Callable[[], Any], dict[str, Any]]] = [
        ("full prefill", lambda: full, {}),
        ("prefix caching", lambda: engine("prefix"), {}),
    ]
    modes += [(f"blend r={r:g}", lambda: engine("blend"), {"recompute_ratio": r}) for r in ratios]
    reference: list[list[int]] = []
    table, out = [], {}
    for name, make, reuse in modes:
        llm = make()
        answers = [
            ask(llm, f"{name}-{i}", q, args.answer_tokens, **reuse) for i, q in enumerate(questions)
        ]
        if not reference:
            reference = [a.tokens for a in answers]
        n = len(answers)
        row = {
            "ttft_s": sum(a.ttft_s for a in answers) / n,
            "prompt_tokens_computed": sum(a.computed for a in answers) / n,
            "cached_tokens": sum(a.cached for a in answers) / n,
            "blended_tokens": sum(a.blended for a in answers) / n,
            "exact_match": sum(a.tokens == r for a, r in zip(answers, reference, strict=True)) / n,
        }
        out[name] = row
        table.append([name, *row.values()])
        del llm
    print_table(
        f"rag: {len(questions)} questions over {args.docs_per_question} of {args.pool_docs} "
        f"documents of ~{args.doc_tokens} tokens, {args.answer_tokens} answer tokens "
        f"({config.dtype}, means per question)",
        ["mode", "TTFT s", "prompt tok computed", "exact hit tok", "blended tok", "exact match"],
        table,
    )
    return out


def quality(
    args: argparse.Namespace,
    config: EngineConfig,
    device: Any,
    questions: list[RagQuestion],
    ratios: list[float],
) -> dict[str, Any]:
    from ragserve.models.hf_export import hf_dir_for

    # NOTE: a GGUF model as dense float32 safetensors: transformers' GGUF path keeps the
    # weights packed and is many times slower.
    directory = str(hf_dir_for(config.model))
    model = load_transformers_model(directory, "auto", torch.float32, device)
    model.config._attn_implementation = "eager"  # NOTE: custom 4D masks
    emulator = BlendEmulator(model, config.block_size)
    rules = args.rules
    # NOTE: one step per forward pass: the references, each (rule, ratio) pass, the bf16 ones
    bar = tqdm(total=len(questions) * (2 + len(rules) * len(ratios)), desc="blend quality")
    refs = []
    for q in questions:
        refs.append(emulator.reference(q, args.answer_tokens))
        bar.update()
    out: dict[str, Any] = {"questions": len(questions)}
    rows: list[list[Any]] = []
    for rule in rules:
        for ratio in ratios:
            scores = []
            for q, ref in zip(questions, refs, strict=True):
                scores.append(
                    score(ref, emulator.blended(q, emulator.select(q, ratio, rule, ref), ref))
                )
                bar.update()
            exact = sum(s.exact for s in scores) / len(scores)
            kl = sum(s.kl for s in scores) / len(scores)
            out[f"{rule} r={ratio:g}"] = {
                "rule": rule,
                "ratio": ratio,
                "exact_match": exact,
                "kl": kl,
            }
            rows.append([rule, ratio, exact, kl])
    del model
    half = load_transformers_model(directory, "auto", torch.bfloat16, device)
    scores = []
    for q, ref in zip(questions, refs, strict=True):
        scores.append(score(ref, _logprobs(half, q, ref.answer)))
        bar.update()
    bar.close()
    bf16 = {
        "exact_match": sum(s.exact for s in scores) / len(scores),
        "kl": sum(s.kl for s in scores) / len(scores),
    }
    out["bf16 full prefill"] = bf16
    rows.append(["bf16 full prefill", None, bf16["exact_match"], bf16["kl"]])
    print_table(
        f"blend quality vs float32 full prefill, {len(questions)} questions, answers of at "
        f"most {args.answer_tokens} tokens teacher-forced",
        ["selection", "r", "greedy exact match", "mean KL"],
        rows,
    )
    return out


@torch.inference_mode()
def _logprobs(model: Any, question: RagQuestion, answer: list[int]) -> torch.Tensor:
    ids = torch.tensor([question.token_ids + answer[:-1]], device=model.device)
    logits = model(input_ids=ids).logits[0, len(question.token_ids) - 1 :]
    return torch.log_softmax(logits.float(), dim=-1)


def plot(quality: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    measured = [v for v in quality.values() if isinstance(v, dict) and "rule" in v]
    # NOTE: at r = 0 no rule chooses anything, so one rule's point there is every rule's
    no_recompute = next((v for v in measured if v["ratio"] == 0), None)
    for rule, marker in zip(RULES, "osD^", strict=True):
        runs = [v for v in measured if v["rule"] == rule]
        if not runs:
            continue
        if no_recompute and all(v["ratio"] != 0 for v in runs):
            runs.append(no_recompute)
        points = sorted((v["ratio"], v["kl"], v["exact_match"]) for v in runs)
        ratios = [p[0] for p in points]
        left.plot(ratios, [p[1] for p in points], marker=marker, label=rule)
        right.plot(ratios, [p[2] for p in points], marker=marker, label=rule)
    bf16 = quality["bf16 full prefill"]
    left.axhline(bf16["kl"], linestyle="--", color="gray", label="bf16 vs float32")
    right.axhline(bf16["exact_match"], linestyle="--", color="gray", label="bf16 vs float32")
    if no_recompute:
        left.axhline(
            no_recompute["kl"] / 5, linestyle=":", color="red", label="target: r = 0's / 5"
        )
    right.axhline(0.8, linestyle=":", color="red", label="target")
    left.set(xlabel="recompute ratio r", ylabel="mean KL vs full prefill", yscale="symlog")
    left.set_yscale("symlog", linthresh=1e-3)
    left.set_ylim(bottom=0)
    right.set(xlabel="recompute ratio r", ylabel="greedy answers = full prefill", ylim=(0, 1.05))
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend()
    fig.suptitle(f"blend quality vs recompute ratio ({quality['questions']} questions)")
    fig.tight_layout()
    from pathlib import Path

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
