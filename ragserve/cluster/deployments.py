"""The two Ray Serve deployments (see :mod:`ragserve.cluster` for the design) and
``build_app``, the application ``ragserve cluster`` runs and ``serve run`` can import:

    serve run ragserve.cluster.deployments:build_app replicas=2 \\
        serve_args="--kv-remote-url redis://store:6379/0"
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response

import ragserve
from ragserve.cluster.forwarder import Forwarder, read_capped
from ragserve.cluster.replica_server import ReplicaServer
from ragserve.cluster.settings import ClusterSettings, document_sharing, request_limit

logger = logging.getLogger(__name__)

# NOTE: on the CPU, OpenMP workers that spin between regions starve the event loops
# (see ragserve.commands.serve); a replica process gets the same policy as `ragserve serve`.
REPLICA_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def code_env() -> dict[str, str]:
    """Environment that makes Ray's worker processes import this very ragserve (a source
    checkout, or an install whose path workers do not search), ahead of any other."""
    root = str(Path(ragserve.__file__).resolve().parents[1])
    paths = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


class EngineReplica:
    """One engine and its ragserve server; Ray restarts the process when it dies or its
    health check fails (the engine thread stopped)."""

    def __init__(self, settings: ClusterSettings) -> None:
        self._server = ReplicaServer(
            settings.serve_args, settings.replica_host, settings.replica_threads
        )
        self._server.start()

    def address(self) -> dict[str, Any]:
        return {"url": self._server.url, "pid": os.getpid()}

    def check_health(self) -> None:
        if not self._server.alive:
            raise RuntimeError("the replica's engine or server has stopped")

    def __del__(self) -> None:
        # NOTE: Ray calls no shutdown hook on a graceful stop; end the engine thread here.
        server = getattr(self, "_server", None)
        if server is not None:
            server.stop()


class ClusterIngress:
    """Every HTTP request the proxy receives: routed and forwarded to a replica."""

    def __init__(self, settings: ClusterSettings, *replicas: DeploymentHandle) -> None:
        self._replicas = replicas

        async def lookup(index: int) -> Mapping[str, Any]:
            found: Mapping[str, Any] = await self._replicas[index].address.remote()
            return found

        self._forwarder = Forwarder(settings, lookup)
        self._request_limit = request_limit(settings.serve_args)
        self._ready: asyncio.Future[None] | None = None

    async def __call__(self, request: Request) -> Response:
        if self._ready is None:
            # NOTE: on the first request, not in __init__: handles answer on a running loop;
            # one lookup shared by the first requests, which all wait for it.
            self._ready = asyncio.ensure_future(self._forwarder.start())
        await asyncio.shield(self._ready)
        body = await read_capped(
            request.stream(), request.headers.get("content-length"), self._request_limit
        )
        if isinstance(body, Response):
            return body
        return await self._forwarder.handle(
            request.method, request.url.path, request.url.query, request.headers, body
        )


# NOTE: decorated by call, not with @, so the classes stay plain classes to the type checker.
REPLICA = serve.deployment(num_replicas=1, health_check_period_s=2, health_check_timeout_s=10)(
    EngineReplica
)
# NOTE: the ingress only forwards; Ray Serve's default of 5 requests in flight per replica
# would hold the whole cluster to 5 (queued in the proxy), starving every engine's batch.
# The replicas' own queues (`--max-num-seqs`, `--max-queue-seconds`) do the limiting.
INGRESS_MAX_ONGOING_REQUESTS = 4096
INGRESS = serve.deployment(num_replicas=1, max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS)(
    ClusterIngress
)


def build_app(args: Mapping[str, Any]) -> serve.Application:
    """The cluster application of ``args`` (see ``ClusterSettings.from_mapping``)."""
    settings = args if isinstance(args, ClusterSettings) else ClusterSettings.from_mapping(args)
    return application(settings)


def application(settings: ClusterSettings) -> serve.Application:
    if settings.replicas > 1 and document_sharing(settings.serve_args) is None:
        logger.warning(
            "the replicas share no document registry (neither --kv-remote-url nor "
            "--registry-dir): a document is known only to the replica it was uploaded to"
        )
    code = code_env()
    options = {
        "num_cpus": settings.replica_cpus,
        "runtime_env": {"env_vars": {**code, **REPLICA_ENV}},
    }
    replicas = [
        REPLICA.options(name=f"replica-{i}", ray_actor_options=options).bind(settings)
        for i in range(settings.replicas)
    ]
    ingress_options = {"num_cpus": 0, "runtime_env": {"env_vars": code}}
    return INGRESS.options(name="ingress", ray_actor_options=ingress_options).bind(
        settings, *replicas
    )
