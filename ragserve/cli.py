"""``ragserve`` command line: serve, generate, bench, and the batch pipelines."""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from typing import TypeAlias

from ragserve.config import EngineConfig
from ragserve.config_flags import add_flags, config_from_args

# Every subcommand: its name, then the module that defines it. The module exposes
# ``add_parser(subparsers, name)``, which adds the parser ``name`` with ``func=run``
# (parsed arguments in, exit code out).
COMMANDS: dict[str, str] = {
    "generate": "ragserve.commands.generate",
    "serve": "ragserve.commands.serve",
    "cluster": "ragserve.commands.cluster",
    "bench": "ragserve.commands.bench",
    "summarize": "ragserve.commands.summarize",
    "docqa": "ragserve.commands.docqa",
    "loadtest": "ragserve.commands.loadtest",
}

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared by every command that builds an engine: one per
    :class:`EngineConfig` field."""
    add_flags(parser.add_argument_group("engine"), EngineConfig)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine config of a command line parsed with :func:`add_engine_args`'s flags."""
    return config_from_args(EngineConfig, args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ragserve", description=__doc__)
    parser.add_argument(
        "--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, metavar="LEVEL"
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, module_name in COMMANDS.items():
        try:
            importlib.import_module(module_name).add_parser(subparsers, name)
        except ImportError as exc:
            # NOTE: one command's missing optional dependency must not break the others;
            # add_parser imports what it needs before it adds its parser.
            broken = subparsers.add_parser(name)
            # Any arguments, so the user is told why the command is missing, not that
            # its flags are unknown.
            broken.add_argument("ignored", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
            broken.set_defaults(func=_unavailable(f"{module_name} cannot be imported: {exc}"))
    return parser


def _unavailable(message: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        raise CliError(message)

    return run


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    func: Callable[[argparse.Namespace], int] = args.func
    # NOTE: the objects alive now (every imported module: torch, transformers, ...) live
    # as long as the process; freezing them keeps the collector's full passes, which a
    # serving loop's allocations trigger every few steps, from walking them again and again.
    gc.collect()
    gc.freeze()
    try:
        return func(args)
    except (CliError, ValueError, OSError) as exc:
        print(f"ragserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ragserve {args.command}: interrupted", file=sys.stderr)
        return 130
