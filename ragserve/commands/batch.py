"""What ``ragserve summarize`` and ``ragserve docqa`` share: batch flags, failure reports,
the JSONL output and the closing table.

Exit codes: 0 all done; 1 done, but some inputs were bad or some requests failed (each
reported on stderr); 2 a usage error; 130 interrupted (the output is valid JSONL: rerun
with ``--resume`` to finish it).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

from pipelines.jsonl_output import JsonlWriter
from ragserve.cli import add_engine_args, engine_config_from_args
from ragserve.table import print_table

MAX_TABLE_ROWS = 40

SEED_NOTE = (
    "--seed also seeds sampling: with --temperature > 0 each request draws from a seed "
    "derived from --seed and what the request is, so a resumed run samples as a full one."
)


def add_batch_args(parser: argparse.ArgumentParser) -> None:
    """The output, resume and sampling flags both commands take, then the engine's."""
    parser.add_argument("--out", required=True, metavar="FILE", help="JSONL results, one line each")
    parser.add_argument(
        "--resume", action="store_true", help="keep the results in --out, do the rest"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="requests in the engine at once (default: --max-num-seqs)",
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_args(parser)


class Reporter:
    """Prints each skipped input or failed request on stderr and counts them."""

    def __init__(self, command: str) -> None:
        self.command = command
        self.failures = 0

    def __call__(self, source: str, reason: str) -> None:
        self.failures += 1
        print(f"ragserve {self.command}: skipped {source}: {reason}", file=sys.stderr, flush=True)


Row: TypeAlias = dict[str, Any]
# Does a command's work: (arguments, prompt template or None, output, reporter) -> new rows.
Work: TypeAlias = Callable[[argparse.Namespace, str | None, JsonlWriter, Reporter], list[Row]]


@dataclass(frozen=True)
class ResultTable:
    """How a command shows its results: a row per result (the first ``MAX_TABLE_ROWS``),
    then a line of totals from all rows and the seconds taken."""

    header: Sequence[str]
    cells: Callable[[Row], list[Any]]
    total: Callable[[list[Row], float], str]


def run_batch(
    args: argparse.Namespace,
    slots: Sequence[str],
    work: Work,
    table: ResultTable,
    inputs: Sequence[str],
) -> int:
    """Check the flags, run ``work`` into ``--out``, print ``table``; the exit code (see the
    module docstring). ``slots`` must each appear once in ``--prompt-template``; ``inputs``:
    the files and folders the command reads."""
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    _check_out_is_no_input(Path(args.out), [*inputs, *filter(None, [args.prompt_template])])
    template = (
        Path(args.prompt_template).read_text(encoding="utf-8") if args.prompt_template else None
    )
    for slot in slots:
        if template is not None and template.count(slot) != 1:
            raise ValueError(
                f"the prompt template {args.prompt_template} must contain {slot} exactly once"
            )
    reporter = Reporter(args.command)
    with JsonlWriter(args.out, resume=args.resume, overwrite=args.overwrite) as writer:
        started = time.perf_counter()
        try:
            rows = work(args, template, writer, reporter)
        except KeyboardInterrupt:
            print(
                f"ragserve {args.command}: interrupted; {writer.num_written} results written to "
                f"{args.out}; rerun with --resume to finish",
                file=sys.stderr,
            )
            return 130
        seconds = time.perf_counter() - started
    _print_results(args.command, table, rows, seconds)
    if reporter.failures:
        print(
            f"ragserve {args.command}: {reporter.failures} inputs or requests failed",
            file=sys.stderr,
        )
    return 1 if reporter.failures else 0


def _check_out_is_no_input(out: Path, inputs: Sequence[str]) -> None:
    """ValueError for an ``--out`` that is an input, or lies in an input folder (it would
    be overwritten, or read back as input)."""
    target = out.resolve()
    for name in inputs:
        source = Path(name).resolve()
        if target == source or (source.is_dir() and source in target.parents):
            raise ValueError(f"--out {out} would overwrite or be read as the input {name}")


def load_llm(args: argparse.Namespace) -> Any:
    from ragserve.llm import LLM

    return LLM.from_config(engine_config_from_args(args))


def write_all(results: Iterator[Row], writer: JsonlWriter) -> Iterator[Row]:
    """Each result, once written to ``writer``."""
    try:
        for result in results:
            writer.write(result)
            yield result
    finally:
        # NOTE: closing the pipeline's generator aborts its in-flight requests right away.
        close = getattr(results, "close", None)
        if close is not None:
            close()


def say(command: str, message: str) -> None:
    print(f"ragserve {command}: {message}", file=sys.stderr, flush=True)


def _print_results(command: str, table: ResultTable, rows: list[Row], seconds: float) -> None:
    if not rows:
        print(f"nothing new written ({seconds:.1f}s)")
        return
    shown = rows[:MAX_TABLE_ROWS]
    print_table(f"ragserve {command}", table.header, [table.cells(row) for row in shown])
    if len(rows) > len(shown):
        print(f"... and {len(rows) - len(shown)} more in the output file")
    print(table.total(rows, seconds))
