"""``ragserve serve``: the HTTP server on the embedded default model unless told otherwise."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
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
    server.add_argument("--max-request-bytes", type=int, default=32 * 2**20)
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds running requests get to finish on SIGTERM/SIGINT",
    )
    add_engine_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ragserve.cli import CliError, engine_config_from_args
    from ragserve.engine.async_engine import AsyncEngine
    from ragserve.server.app import create_app, serve
    from ragserve.server.auth import read_api_key_file
    from ragserve.server.config import ServerConfig

    api_keys = list(args.api_key)
    if args.api_key_file:
        api_keys += read_api_key_file(args.api_key_file)
    config = ServerConfig(
        host=args.host,
        port=args.port,
        api_keys=tuple(api_keys),
        served_model_name=args.served_model_name,
        max_waiting_requests=args.max_waiting_requests,
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
