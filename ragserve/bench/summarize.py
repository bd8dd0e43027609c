"""``ragserve bench summarize``: map-reduce summaries of long documents, batched vs a naive loop.

Both sides run the same plan (chunks, prompts, reduce tree) from :mod:`pipelines.summarize`:
ragserve submits every document's calls to the engine at once; the baseline sends one
call at a time through transformers ``generate`` on the same model, as a simple script
would. Summaries may differ in length between the two, so each side's reduce tree (and
call count) is reported with its timing.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ragserve.bench.common import load_transformers_model, peak_rss_mib, write_json
from ragserve.table import print_table

_WORDS = [
    "the",
    "a",
    "engine",
    "cache",
    "block",
    "token",
    "prefix",
    "request",
    "batch",
    "memory",
    "document",
    "summary",
    "model",
    "layer",
    "attention",
    "query",
    "key",
    "value",
    "page",
    "disk",
    "tier",
    "scheduler",
    "step",
    "kernel",
    "device",
    "host",
    "copy",
    "budget",
    "reader",
    "writer",
    "contract",
    "clause",
    "party",
    "term",
    "payment",
    "notice",
    "period",
    "manual",
    "section",
    "chapter",
    "figure",
    "table",
    "result",
    "method",
    "system",
    "user",
    "service",
    "latency",
    "throughput",
    "capacity",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-docs", type=int, default=8)
    parser.add_argument(
        "--doc-tokens", type=int, default=4096, help="approximate tokens per generated document"
    )
    parser.add_argument(
        "--docs",
        default=None,
        metavar="DIR",
        help="summarize these files instead of generated ones",
    )
    parser.add_argument("--chunk-tokens", type=int, default=1024)
    parser.add_argument("--overlap-tokens", type=int, default=None)
    parser.add_argument("--max-summary-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=None, help="default: --max-num-seqs")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--out", default="bench-results/summarize.json")


def write_documents(folder: Path, count: int, approx_tokens: int, seed: int = 0) -> None:
    """``count`` .txt files of paragraphs of random sentences, about ``approx_tokens`` each."""
    rng = random.Random(seed)
    for number in range(count):
        paragraphs: list[str] = []
        words = 0
        while words * 4 < approx_tokens * 3:  # about 4 tokens for 3 words
            sentences = []
            for _ in range(rng.randint(3, 6)):
                length = rng.randint(6, 18)
                words += length
                sentences.append(
                    " ".join(rng.choice(_WORDS) for _ in range(length)).capitalize() + "."
                )
            paragraphs.append(" ".join(sentences))
        (folder / f"doc{number:04d}.txt").write_text("\n\n".join(paragraphs) + "\n")


def run(args: argparse.Namespace, config: Any) -> int:
    from pipelines.documents import load_documents
    from pipelines.summarize import SummarizeOptions, Summarizer, run_summaries
    from ragserve import LLM, SamplingParams

    with tempfile.TemporaryDirectory(prefix="ragserve-bench-docs-") as scratch:
        folder = Path(args.docs) if args.docs else Path(scratch)
        if not args.docs:
            write_documents(folder, args.num_docs, args.doc_tokens)
        documents = load_documents([folder])
    if not documents:
        raise ValueError(f"no documents to summarize in {folder}")
    options = SummarizeOptions(
        max_summary_tokens=args.max_summary_tokens,
        chunk_tokens=args.chunk_tokens,
        overlap_tokens=args.overlap_tokens,
    )
    llm = LLM.from_config(config)
    engine, info = llm.engine, llm.info
    summarizer = Summarizer(engine.tokenizer, info.max_model_len, options)
    llm.generate("Warm up.", SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)

    started = time.perf_counter()
    results = list(
        run_summaries(engine, summarizer, documents, args.concurrency or config.max_num_seqs)
    )
    if info.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    doc_tokens = sum(r["document_tokens"] for r in results)
    side = _side(len(results), doc_tokens, results, seconds)
    report: dict[str, Any] = {
        "workload": {
            "documents": len(documents),
            "document_tokens": doc_tokens,
            "chunk_tokens": summarizer.chunk_tokens,
            "overlap_tokens": summarizer.overlap_tokens,
            "max_summary_tokens": args.max_summary_tokens,
            "generated": not args.docs,
        },
        "ragserve": {
            **side,
            "concurrency": args.concurrency or config.max_num_seqs,
            "peak_rss_mib": peak_rss_mib(),
        },
    }
    rows = [_row("ragserve (batched)", side, 1.0)]
    if not args.skip_transformers:
        eos = list(info.eos_token_ids)
        del llm, engine
        hf = load_transformers_model(config.model, config.load_format, info.dtype, info.device)
        naive = _naive_loop(hf, summarizer, documents, eos)
        speedup = naive["seconds"] / seconds
        rows[0][-1] = speedup
        rows.append(_row("transformers, one call at a time", naive, 1 / speedup))
        report["transformers_naive"] = naive
        report["speedup_vs_naive"] = speedup
    print_table(
        f"summarize: {len(documents)} documents, {doc_tokens} tokens, chunks of {summarizer.chunk_tokens}, "
        f"summaries <= {args.max_summary_tokens} tokens",
        ["engine", "seconds", "documents/hour", "doc tok/s", "total tok/s", "calls", "speed-up"],
        rows,
    )
    write_json(args.out, report)
    return 0


def _side(
    count: int, doc_tokens: int, results: list[dict[str, Any]], seconds: float
) -> dict[str, Any]:
    processed = sum(r["prompt_tokens"] + r["generated_tokens"] for r in results)
    return {
        "seconds": seconds,
        "documents_per_hour": count * 3600 / seconds,
        "document_tok_s": doc_tokens / seconds,
        "total_tok_s": processed / seconds,
        "generated_tokens": sum(r["generated_tokens"] for r in results),
        "calls": sum(r["num_calls"] for r in results),
        "mean_reduce_depth": sum(r["reduce_depth"] for r in results) / max(1, count),
    }


def _row(name: str, side: dict[str, Any], speedup: float) -> list[Any]:
    return [
        name,
        f"{side['seconds']:.2f}",
        side["documents_per_hour"],
        side["document_tok_s"],
        side["total_tok_s"],
        side["calls"],
        speedup,
    ]


@torch.inference_mode()
def _naive_loop(
    model: Any, summarizer: Any, documents: list[Any], eos: list[int]
) -> dict[str, Any]:
    """The same map-reduce plan, one greedy ``generate`` call after another."""
    tokenizer = summarizer.tokenizer
    device = next(model.parameters()).device
    limit = summarizer.max_summary_tokens
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else eos[0]
    started = time.perf_counter()
    results = []
    for document in documents:
        job = summarizer.start(document)
        calls = job.first_calls()
        while calls:
            follow_ups = []
            for call in calls:
                ids = torch.tensor([call.prompt], device=device)
                out = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=limit,
                    do_sample=False,
                    eos_token_id=eos,
                    pad_token_id=pad,
                )
                new = out[0, ids.shape[1] :].tolist()
                stopped = bool(new) and new[-1] in eos
                text = tokenizer.decode(new, skip_special_tokens=True)
                follow_ups += job.complete(call, text, len(new), "stop" if stopped else "length")
            calls = follow_ups
        results.append(job.result())
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return _side(len(results), sum(r["document_tokens"] for r in results), results, seconds)
