"""``ragserve docqa``: answers to questions about documents, each document computed once
(exit codes: see :mod:`ragserve.commands.batch`)."""

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
        name, help="answer questions about documents, each document computed once", epilog=SEED_NOTE
    )
    parser.add_argument("--docs", nargs="+", required=True, metavar="PATH")
    parser.add_argument(
        "--questions",
        required=True,
        metavar="FILE",
        help='JSONL lines {"doc": <file name or id>, "question": ..., "id"?: ...}',
    )
    parser.add_argument("--max-tokens", type=int, default=256, help="answer tokens at most")
    parser.add_argument(
        "--prompt-template",
        default=None,
        metavar="FILE",
        help="user prompt with {document} then {question}",
    )
    add_batch_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return run_batch(
        args, ["{document}", "{question}"], _docqa, TABLE, [*args.docs, args.questions]
    )


def _docqa(
    args: argparse.Namespace, template: str | None, writer: JsonlWriter, reporter: Reporter
) -> list[Row]:
    from pipelines.docqa import DEFAULT_QA_TEMPLATE, docqa, load_questions
    from pipelines.documents import DocumentIndex, load_documents

    questions = load_questions(args.questions, reporter)
    documents = load_documents(args.docs, reporter, leave_out=[args.questions])
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
    say(args.command, f"questions to answer: {len(todo)} ({done} already done)")
    if not todo:
        return []
    llm = load_llm(args)
    results = docqa(
        llm,
        documents,
        todo,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        prompt_template=template or DEFAULT_QA_TEMPLATE,
        concurrency=args.concurrency,
        use_tqdm=not args.no_progress,
        on_error=reporter,
    )
    return list(write_all(results, writer))


def _total(rows: list[Row], seconds: float) -> str:
    prompt = sum(r["prompt_tokens"] for r in rows)
    cached = sum(r["cached_tokens"] for r in rows)
    return (
        f"{len(rows)} answers in {seconds:.1f}s ({len(rows) / seconds:.2f}/s); "
        f"{prompt} prompt tokens, {cached} served from the prefix cache"
    )


TABLE = ResultTable(
    header=["id", "doc", "prompt tokens", "cached", "answer tokens", "seconds"],
    cells=lambda r: [
        r["id"],
        r["doc"],
        r["prompt_tokens"],
        r["cached_tokens"],
        r["answer_tokens"],
        r["seconds"],
    ],
    total=_total,
)
