"""One replica's ragserve server: the real engine and application (as ``ragserve serve``
builds them) on an event loop thread of its own, listening on a free port.

NOTE: a thread of its own, not the caller's loop: the host process (a Ray Serve replica)
runs its own loop for its own calls, and the engine's server must not depend on how that
loop is run or blocked.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future

from aiohttp import web

from ragserve.server.connections import ServingRunner

logger = logging.getLogger(__name__)


def advertised_host(bind_host: str) -> str:
    """The address other machines reach a server bound to ``bind_host`` at."""
    if bind_host in ("0.0.0.0", "::", ""):
        import socket

        # NOTE: the address of the interface that routes outward; no packet is sent.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect(("10.255.255.255", 1))
                return str(probe.getsockname()[0])
            except OSError:
                return "127.0.0.1"
    return bind_host


class ReplicaServer:
    """Start with ``start``; ``url`` is where it serves; ``alive`` is False once its loop
    thread or its engine has stopped; ``stop`` shuts it down gracefully."""

    def __init__(self, serve_args: Sequence[str], host: str, threads: int | None = None) -> None:
        self._serve_args = list(serve_args)
        self._host = host
        self._threads = threads
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="replica-server")
        self._runner: ServingRunner | None = None
        self._app: web.Application | None = None
        self.url = ""
        self.pid = os.getpid()

    def start(self, timeout: float | None = None) -> str:
        """Build the engine and the app, start listening; returns the URL. Raises what
        building them raised."""
        self._thread.start()
        started: Future[str] = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        self.url = started.result(timeout)
        return self.url

    async def _start(self) -> str:
        from ragserve.cluster.settings import replica_configs
        from ragserve.engine.async_engine import AsyncEngine
        from ragserve.server.app import create_app, start_serving

        if self._threads is not None:
            import torch

            torch.set_num_threads(self._threads)
        engine_config, server_config, _ = replica_configs(self._serve_args, self._host)
        engine = AsyncEngine(engine_config)
        try:
            app = create_app(engine, server_config, engine_config)
        except BaseException:
            await engine.shutdown()
            raise
        self._runner = await start_serving(app, server_config)
        self._app = app
        port = self._runner.addresses[0][1]
        host = advertised_host(self._host)
        url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        logger.info("replica serving at %s", url)
        return url

    @property
    def alive(self) -> bool:
        from ragserve.server.state import ENGINE

        if not self._thread.is_alive() or self._runner is None or self._app is None:
            return False
        return bool(self._app[ENGINE].is_alive)

    def stop(self, timeout: float = 60.0) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self._loop).result(timeout)
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
