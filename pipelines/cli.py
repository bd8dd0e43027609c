"""``ragserve summarize`` and ``ragserve docqa``: the batch pipelines from the command line.

Exit codes: 0 all done; 1 done, but some inputs were bad or some requests failed (each
reported on stderr); 2 a usage error; 130 interrupted (the output is valid JSONL: rerun
with ``--resume`` to finish it).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipelines.jsonl_output import JsonlWriter

MAX_TABLE_ROWS = 40

SEED_NOTE = (
    "--seed also seeds sampling: with --temperature > 0 each request draws from a seed "
    "derived from --seed and what the request is, so a resumed run samples as a full one."
)


def add_parser(subparsers: Any) -> None:
    from ragserve.cli import add_engine_args

    summarize = subparsers.add_parser(
        "summarize", help="map-reduce summaries of long documents, batched", epilog=SEED_NOTE
    )
    summarize.add_argument("paths", nargs="+", metavar="PATH", help=".txt/.md/.jsonl files or folders")
    summarize.add_argument("--max-summary-tokens", type=int, default=128)
    summarize.add_argument("--chunk-tokens", type=int, default=None,
                           help="document tokens per request (default: what the context allows)")
    summarize.add_argument("--overlap-tokens", type=int, default=None,
                           help="tokens shared by consecutive chunks (default: a tenth of a chunk)")
    summarize.add_argument("--prompt-template", default=None, metavar="FILE",
                           help="user prompt with {text}, for the map and reduce steps")
    _add_batch_args(summarize)
    add_engine_args(summarize)
    summarize.set_defaults(func=run)

    docqa = subparsers.add_parser(
        "docqa", help="answer questions about documents, each document computed once", epilog=SEED_NOTE
    )
    docqa.add_argument("--docs", nargs="+", required=True, metavar="PATH")
    docqa.add_argument("--questions", required=True, metavar="FILE",
                       help='JSONL lines {"doc": <file name or id>, "question": ..., "id"?: ...}')
    docqa.add_argument("--max-tokens", type=int, default=256, help="answer tokens at most")
    docqa.add_argument("--prompt-template", default=None, metavar="FILE",
                       help="user prompt with {document} then {question}")
    _add_batch_args(docqa)
    add_engine_args(docqa)
    docqa.set_defaults(func=run)


def _add_batch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, metavar="FILE", help="JSONL results, one line each")
    parser.add_argument("--resume", action="store_true", help="keep the results in --out, do the rest")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="requests in the engine at once (default: --max-num-seqs)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


class _Reporter:
    """Prints each skipped input or failed request on stderr and counts them."""

    def __init__(self, command: str) -> None:
        self.command = command
        self.failures = 0

    def __call__(self, source: str, reason: str) -> None:
        self.failures += 1
        print(f"ragserve {self.command}: skipped {source}: {reason}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    template = Path(args.prompt_template).read_text(encoding="utf-8") if args.prompt_template else None
    slots = ["{text}"] if args.command == "summarize" else ["{document}", "{question}"]
    for slot in slots:
        if template is not None and template.count(slot) != 1:
            raise ValueError(f"the prompt template {args.prompt_template} must contain {slot} exactly once")
    reporter = _Reporter(args.command)
    with JsonlWriter(args.out, resume=args.resume, overwrite=args.overwrite) as writer:
        started = time.perf_counter()
        try:
            if args.command == "summarize":
                rows = _summarize(args, template, writer, reporter)
            else:
                rows = _docqa(args, template, writer, reporter)
        except KeyboardInterrupt:
            print(
                f"ragserve {args.command}: interrupted; {writer.num_written} results written to "
                f"{args.out}; rerun with --resume to finish",
                file=sys.stderr,
            )
            return 130
        seconds = time.perf_counter() - started
    _print_table(args.command, rows, seconds)
    if reporter.failures:
        print(f"ragserve {args.command}: {reporter.failures} inputs or requests failed", file=sys.stderr)
    return 1 if reporter.failures else 0


def _load_llm(args: argparse.Namespace) -> Any:
    from ragserve.cli import engine_config_from_args
    from ragserve.llm import LLM

    return LLM.from_config(engine_config_from_args(args))


def _summarize(
    args: argparse.Namespace, template: str | None, writer: JsonlWriter, reporter: _Reporter
) -> list[dict[str, Any]]:
    from pipelines.documents import load_documents
    from pipelines.summarize import summarize

    documents = load_documents(args.paths, reporter)
    todo = [d for d in documents if d.id not in writer.done]
    _say(args.command, f"documents to summarize: {len(todo)} ({len(documents) - len(todo)} already done)")
    if not todo:
        return []
    llm = _load_llm(args)
    results = summarize(
        llm, todo,
        max_summary_tokens=args.max_summary_tokens, chunk_tokens=args.chunk_tokens,
        overlap_tokens=args.overlap_tokens, prompt_template=template,
        concurrency=args.concurrency, temperature=args.temperature, top_p=args.top_p,
        seed=args.seed, use_tqdm=not args.no_progress, on_error=reporter,
    )
    return list(_write_all(results, writer))


def _docqa(
    args: argparse.Namespace, template: str | None, writer: JsonlWriter, reporter: _Reporter
) -> list[dict[str, Any]]:
    from pipelines.docqa import DEFAULT_QA_TEMPLATE, docqa, load_questions
    from pipelines.documents import DocumentIndex, load_documents

    questions = load_questions(args.questions, reporter)
    documents = load_documents(args.docs, reporter)
    index = DocumentIndex(documents)
    todo = []
    for question in questions:
        if question.id in writer.done:
            continue
        try:
            index.find(question.doc)
        except KeyError as exc:
            reporter(question.source, str(exc.args[0]))
            continue
        todo.append(question)
    done = sum(q.id in writer.done for q in questions)
    _say(args.command, f"questions to answer: {len(todo)} ({done} already done)")
    if not todo:
        return []
    llm = _load_llm(args)
    results = docqa(
        llm, documents, todo,
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
        prompt_template=template or DEFAULT_QA_TEMPLATE, concurrency=args.concurrency,
        use_tqdm=not args.no_progress, on_error=reporter,
    )
    return list(_write_all(results, writer))


def _write_all(results: Iterator[dict[str, Any]], writer: JsonlWriter) -> Iterator[dict[str, Any]]:
    try:
        for result in results:
            writer.write(result)
            yield result
    finally:
        # NOTE: closing the pipeline's generator aborts its in-flight requests right away.
        close = getattr(results, "close", None)
        if close is not None:
            close()


def _say(command: str, message: str) -> None:
    print(f"ragserve {command}: {message}", file=sys.stderr, flush=True)


def _print_table(command: str, rows: list[dict[str, Any]], seconds: float) -> None:
    from ragserve.table import print_table

    if not rows:
        print(f"nothing new written ({seconds:.1f}s)")
        return
    shown = rows[:MAX_TABLE_ROWS]
    if command == "summarize":
        header = ["id", "chunks", "depth", "doc tokens", "summary tokens", "seconds"]
        cells = [[r["id"], r["num_chunks"], r["reduce_depth"], r["document_tokens"],
                  r["summary_tokens"], r["seconds"]] for r in shown]
        tokens = sum(r["document_tokens"] for r in rows)
        total = (f"{len(rows)} documents, {tokens} document tokens in {seconds:.1f}s: "
                 f"{len(rows) * 3600 / seconds:.0f} documents/hour, {tokens / seconds:.0f} document tokens/s")
    else:
        header = ["id", "doc", "prompt tokens", "cached", "answer tokens", "seconds"]
        cells = [[r["id"], r["doc"], r["prompt_tokens"], r["cached_tokens"], r["answer_tokens"],
                  r["seconds"]] for r in shown]
        prompt = sum(r["prompt_tokens"] for r in rows)
        cached = sum(r["cached_tokens"] for r in rows)
        total = (f"{len(rows)} answers in {seconds:.1f}s ({len(rows) / seconds:.2f}/s); "
                 f"{prompt} prompt tokens, {cached} served from the prefix cache")
    print_table(f"ragserve {command}", header, cells)
    if len(rows) > len(shown):
        print(f"... and {len(rows) - len(shown)} more in the output file")
    print(total)
