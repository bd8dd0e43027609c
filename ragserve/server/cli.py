"""``ragserve serve``: the HTTP server on the embedded default model unless told otherwise."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
from typing import Any

logger = logging.getLogger(__name__)


def add_parser(subparsers: Any) -> None:
    from ragserve.cli import add_engine_args

    parser = subparsers.add_parser(
        "serve", help="serve the OpenAI-compatible and document API over HTTP"
    )
    server = parser.add_argument_group("server")
    server.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: loopback only)"
    )
    server.add_argument("--port", type=int, default=8000, help="0 picks a free port (it is logged)")
    server.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require 'Authorization: Bearer KEY' on /v1; repeat for more tenants",
    )
    server.add_argument("--api-key-file", default=None, help="a file with one API key per line")
    server.add_argument("--served-model-name", default=None, help="the model name clients use")
    server.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="requests in flight before new ones get 503 with Retry-After",
    )
    server.add_argument(
        "--max-queue-seconds",
        type=float,
        default=20.0,
        help="503 with Retry-After when a new request's expected time to finish (queued "
        "tokens over the measured token rate) exceeds this; 0 turns it off",
    )
    server.add_argument("--max-request-bytes", type=int, default=32 * 2**20)
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds running requests get to finish on SIGTERM/SIGINT",
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
    from ragserve.cli import CliError, engine_config_from_args
    from ragserve.engine.async_engine import AsyncEngine
    from ragserve.server.app import create_app, serve
    from ragserve.server.auth import read_api_key_file
    from ragserve.server.config import ServerConfig

    missing = thread_policy_env(args.device)
    if missing:
        _restart_with(missing)
    api_keys = list(args.api_key)
    if args.api_key_file:
        api_keys += read_api_key_file(args.api_key_file)
    config = ServerConfig(
        host=args.host,
        port=args.port,
        api_keys=tuple(api_keys),
        served_model_name=args.served_model_name,
        max_waiting_requests=args.max_waiting_requests,
        max_queue_seconds=args.max_queue_seconds,
        max_request_bytes=args.max_request_bytes,
        shutdown_timeout=args.shutdown_timeout,
    )
    engine_config = dataclasses.replace(
        engine_config_from_args(args), max_waiting_requests=args.max_waiting_requests
    )
    engine = AsyncEngine(engine_config)
    try:
        app = create_app(engine, config)
    except BaseException:
        asyncio.run(engine.shutdown())
        raise
    try:
        asyncio.run(serve(app, config))
    except OSError as exc:
        raise CliError(f"cannot serve on {config.host}:{config.port}: {exc}") from None
    return 0
