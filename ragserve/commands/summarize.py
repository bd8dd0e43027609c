"""``ragserve summarize``: map-reduce summaries of long documents, batched (exit codes: see
:mod:`ragserve.commands.batch`)."""

from __future__ import annotations

import argparse

from pipelines.jsonl_output import JsonlWriter
from ragserve.cli import Subparsers
from ragserve.commands.batch import (
    SEED_NOTE,
    Reporter,
    ResultTable,
    Row,
    add_batch_args,
    load_llm,
    run_batch,
    say,
    write_all,
)


def add_parser(subparsers: Subparsers, name: str) -> None:
    parser = subparsers.add_parser(
        name, help="map-reduce summaries of long documents, batched", epilog=SEED_NOTE
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help=".txt/.md/.jsonl files or folders")
    parser.add_argument("--max-summary-tokens", type=int, default=128)
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=None,
        help="document tokens per request (default: what the context allows)",
    )
    parser.add_argument(
        "--overlap-tokens",
        type=int,
        default=None,
        help="tokens shared by consecutive chunks (default: a tenth of a chunk)",
    )
    parser.add_argument(
        "--prompt-template",
        default=None,
        metavar="FILE",
        help="user prompt with {text}, for the map and reduce steps",
    )
    add_batch_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return run_batch(args, ["{text}"], _summarize, TABLE, args.paths)


def _summarize(
    args: argparse.Namespace, template: str | None, writer: JsonlWriter, reporter: Reporter
) -> list[Row]:
    from pipelines.documents import load_documents
    from pipelines.summarize import summarize

    documents = load_documents(args.paths, reporter)
    todo = [d for d in documents if d.id not in writer.done]
    say(
        args.command,
        f"documents to summarize: {len(todo)} ({len(documents) - len(todo)} already done)",
    )
    if not todo:
        return []
    llm = load_llm(args)
    results = summarize(
        llm,
        todo,
        max_summary_tokens=args.max_summary_tokens,
        chunk_tokens=args.chunk_tokens,
        overlap_tokens=args.overlap_tokens,
        prompt_template=template,
        concurrency=args.concurrency,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        use_tqdm=not args.no_progress,
        on_error=reporter,
    )
    return list(write_all(results, writer))


def _total(rows: list[Row], seconds: float) -> str:
    tokens = sum(r["document_tokens"] for r in rows)
    return (
        f"{len(rows)} documents, {tokens} document tokens in {seconds:.1f}s: "
        f"{len(rows) * 3600 / seconds:.0f} documents/hour, {tokens / seconds:.0f} document tokens/s"
    )


TABLE = ResultTable(
    header=["id", "chunks", "depth", "doc tokens", "summary tokens", "seconds"],
    cells=lambda r: [
        r["id"],
        r["num_chunks"],
        r["reduce_depth"],
        r["document_tokens"],
        r["summary_tokens"],
        r["seconds"],
    ],
    total=_total,
)
