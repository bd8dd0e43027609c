"""``ragserve serve``: the HTTP server on the embedded default model unless told otherwise."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from ragserve.cli import CliError, Subparsers, add_engine_args, engine_config_from_args
from ragserve.config_flags import add_flags, config_from_args
from ragserve.server.config import ServerConfig

logger = logging.getLogger(__name__)


def add_parser(subparsers: Subparsers, name: str) -> None:
    parser = subparsers.add_parser(
        name, help="serve the OpenAI-compatible and document API over HTTP"
    )
    server = parser.add_argument_group("server")
    add_flags(server, ServerConfig)
    server.add_argument(
        "--api-key-file", default=None, help="a file with one API key per line (adds to --api-key)"
    )
    add_engine_args(parser)
    parser.set_defaults(func=run)


# NOTE: measured with ``ragserve bench serve`` on two shared cores: OpenMP workers that
# spin between parallel regions (libgomp's default) compete with the event loop and the
# other processes; sleeping at once made the cached max_tokens=1 round trip faster and
# far steadier (BENCHMARKS.md, "Serve overhead").
CPU_THREAD_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def thread_policy_env(device: str) -> dict[str, str]:
    """Environment the server wants on the CPU that is not set yet (the user's own
    settings win). Empty on an accelerator."""
    import torch

    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if not on_cpu:
        return {}
    return {name: value for name, value in CPU_THREAD_ENV.items() if name not in os.environ}


def _restart_with(env: dict[str, str]) -> None:
    """Replace this process with the same command under ``env`` (same pid, same output).

    NOTE: OpenMP reads its settings when torch loads, before any of our code can run;
    restarting the interpreter is the only way to apply them to ``ragserve serve`` itself.
    """
    logger.info("restarting with %s", " ".join(f"{k}={v}" for k, v in sorted(env.items())))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, **env})


def run(args: argparse.Namespace) -> int:
    from ragserve.engine.async_engine import AsyncEngine
    from ragserve.server.app import create_app, serve
    from ragserve.server.auth import read_api_key_file

    missing = thread_policy_env(args.device)
    if missing:
        _restart_with(missing)
    api_keys = list(args.api_keys)
    if args.api_key_file:
        api_keys += read_api_key_file(args.api_key_file)
    config = config_from_args(ServerConfig, args, api_keys=tuple(api_keys))
    engine_config = engine_config_from_args(args)
    engine = AsyncEngine(engine_config)
    try:
        app = create_app(engine, config, engine_config)
    except BaseException:
        asyncio.run(engine.shutdown())
        raise
    try:
        asyncio.run(serve(app, config))
    except OSError as exc:
        raise CliError(f"cannot serve on {config.host}:{config.port}: {exc}") from None
    return 0
