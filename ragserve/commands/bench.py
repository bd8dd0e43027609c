"""``ragserve bench <name>``: benchmarks that print a table and write JSON."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from types import ModuleType

from ragserve.cli import Subparsers, add_engine_args, engine_config_from_args

BENCHMARKS = {
    "throughput": "ragserve.bench.throughput",
    "prefix": "ragserve.bench.prefix",
    "summarize": "ragserve.bench.summarize",
    "tiers": "ragserve.bench.tiers",
    "serve": "ragserve.bench.serve",
    "ttft": "ragserve.bench.ttft",
    "ceiling": "ragserve.bench.ceiling",
    "cpu": "ragserve.bench.cpu",
    "startup": "ragserve.bench.startup",
    "cluster": "ragserve.bench.cluster",
    "rag": "ragserve.bench.rag",
    "fp8-quality": "ragserve.bench.fp8_quality",
    "builds": "ragserve.bench.builds",
}


def add_parser(subparsers: Subparsers, name: str) -> None:
    # NOTE: every benchmark is imported before the parser is added, so a missing optional
    # dependency leaves this command unavailable rather than half registered.
    modules = {bench: importlib.import_module(path) for bench, path in BENCHMARKS.items()}
    parser = subparsers.add_parser(name, help="run a benchmark (table + JSON)")
    bench_parsers = parser.add_subparsers(dest="benchmark", required=True)
    for bench, module in modules.items():
        sub = bench_parsers.add_parser(bench, help=module.__doc__)
        module.add_arguments(sub)
        add_engine_args(sub)
        sub.add_argument(
            "--model-shape",
            default=None,
            help="random weights of a named shape (llama-3.1-8b, llama-3.1-70b, tiny-llama) "
            "instead of --model",
        )
        sub.set_defaults(func=_runner(module))


def _runner(module: ModuleType) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        from ragserve.bench.shapes import write_shape_config

        # NOTE: tables must show up as they are measured when stdout is a pipe or a file.
        if hasattr(sys.stdout, "reconfigure"):
            sys.stdout.reconfigure(line_buffering=True)
        if args.model_shape:
            # A benchmark may need sequences longer than the shape's limit (128k + a question).
            needed = getattr(module, "required_model_len", None)
            args.model = write_shape_config(args.model_shape, needed(args) if needed else None)
            args.load_format = "dummy"
        return int(module.run(args, engine_config_from_args(args)))

    return run
