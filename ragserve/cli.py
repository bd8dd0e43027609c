"""``ragserve`` command line: serve, generate, bench, and the batch pipelines."""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import sys
from collections.abc import Callable, Sequence

from ragserve.config import EngineConfig

# Each subcommand lives in its own module exposing ``add_parser(subparsers)``; the parser
# it adds carries ``func=run`` taking the parsed arguments and returning an exit code.
SUBCOMMAND_MODULES = (
    "ragserve.commands.generate",
    "ragserve.server.cli",
    "ragserve.bench.cli",
    "pipelines.cli",
    "ragserve.commands.loadtest",
)


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared by every command that builds an engine."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None, help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    group.add_argument("--tokenizer", default=None)
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    group.add_argument("--device", default="auto")
    group.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--kv-cache-gib", type=float, default=None)
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    group.add_argument("--no-prefix-caching", action="store_true")
    group.add_argument("--attention-backend", default=None)
    group.add_argument("--enforce-eager", action="store_true", help="run decode steps eagerly (no CUDA graphs)")
    group.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="launch each decode step before reading the previous one's tokens (default: on CUDA)",
    )
    group.add_argument("--kv-cpu-gib", type=float, default=0.0)
    group.add_argument("--kv-disk-dir", default=None)
    group.add_argument("--kv-disk-gib", type=float, default=0.0)
    group.add_argument(
        "--kv-load-gib-per-step",
        type=float,
        default=1.0,
        help="KV loaded from the CPU/disk tiers per step, all sequences together (the rest streams in later steps)",
    )
    group.add_argument("--seed", type=int, default=0)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        device=args.device,
        load_format=args.load_format,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        kv_cpu_gib=args.kv_cpu_gib,
        kv_disk_dir=args.kv_disk_dir,
        kv_disk_gib=args.kv_disk_gib,
        kv_load_gib_per_step=args.kv_load_gib_per_step,
        seed=args.seed,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ragserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            # NOTE: one command's missing optional dependency must not break the others.
            broken = subparsers.add_parser(name.split(".")[-2 if name.endswith(".cli") else -1])
            broken.set_defaults(func=_unavailable(f"{name} cannot be imported: {exc}"))
            continue
        module.add_parser(subparsers)
    return parser


def _unavailable(message: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        raise CliError(message)

    return run


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    func: Callable[[argparse.Namespace], int] = args.func
    # NOTE: the objects alive now (every imported module: torch, transformers, ...) live
    # as long as the process; freezing them keeps the collector's full passes, which a
    # serving loop's allocations trigger every few steps, from walking them again and again.
    gc.collect()
    gc.freeze()
    try:
        return func(args)
    except (CliError, ValueError, FileNotFoundError) as exc:
        print(f"ragserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ragserve {args.command}: interrupted", file=sys.stderr)
        return 130
