"""``ragserve cluster``: N engine replicas on Ray Serve behind its HTTP proxy, with the same
OpenAI and document API as ``ragserve serve`` (see :mod:`ragserve.cluster`).

Starts a local Ray instance, or joins one with ``--ray-address``; ``--host``/``--port``
are the proxy's. Every other ``ragserve serve`` flag goes to every replica.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import threading

from ragserve.cli import Subparsers, add_engine_args, engine_config_from_args
from ragserve.config_flags import add_flags, config_from_args, to_argv
from ragserve.server.config import ServerConfig

logger = logging.getLogger(__name__)

APP_NAME = "ragserve"


def add_parser(subparsers: Subparsers, name: str) -> None:
    import ray  # noqa: F401  NOTE: absent without the `cluster` extra: the command says so

    parser = subparsers.add_parser(name, help="serve N engine replicas on Ray Serve")
    group = parser.add_argument_group("cluster")
    add_cluster_args(group)
    server = parser.add_argument_group("server (--host/--port: the proxy's)")
    add_flags(server, ServerConfig)
    server.add_argument("--api-key-file", default=None, help="one API key per line")
    add_engine_args(parser)
    parser.set_defaults(func=run)


def add_cluster_args(group: argparse._ActionsContainer) -> None:
    group.add_argument("--replicas", type=int, default=2, help="engine replicas (default 2)")
    group.add_argument(
        "--router",
        dest="policy",
        choices=("affinity", "round_robin"),
        default="affinity",
        help="affinity: a document's requests go to the replica that holds it (default)",
    )
    group.add_argument(
        "--busy-threshold",
        type=int,
        default=4,
        help="requests in flight that make a replica busy: its documents' next requests "
        "fall back to the least loaded replica when that one has fewer (default 4)",
    )
    group.add_argument(
        "--replica-host",
        default="127.0.0.1",
        help="where replicas listen; 0.0.0.0 on a cluster of several machines",
    )
    group.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs per replica")
    group.add_argument(
        "--replica-threads", type=int, default=None, help="torch threads per replica"
    )
    group.add_argument(
        "--ray-address", default=None, help="join this Ray cluster (default: start a local one)"
    )


def serve_args_of(args: argparse.Namespace) -> list[str]:
    """The ``ragserve serve`` flags every replica gets: the engine's and the server's, less
    the proxy's own address."""
    from ragserve.server.auth import read_api_key_file

    keys = list(args.api_keys)
    if args.api_key_file:
        keys += read_api_key_file(args.api_key_file)
    server = config_from_args(ServerConfig, args, api_keys=tuple(keys))
    defaults = ServerConfig()
    server = dataclasses.replace(server, host=defaults.host, port=defaults.port)
    return to_argv(engine_config_from_args(args)) + to_argv(server)


def run(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from ragserve.cluster.deployments import application
    from ragserve.cluster.settings import ClusterSettings

    settings = ClusterSettings(
        replicas=args.replicas,
        policy=args.policy,
        busy_threshold=args.busy_threshold,
        serve_args=tuple(serve_args_of(args)),
        replica_host=args.replica_host,
        replica_cpus=args.replica_cpus,
        replica_threads=args.replica_threads,
    )
    ray.init(address=args.ray_address, include_dashboard=False)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(application(settings), name=APP_NAME, route_prefix="/")
        logger.info(
            "ragserve cluster: %d replicas behind http://%s:%d/v1",
            settings.replicas, args.host, args.port,
        )  # fmt: skip
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
