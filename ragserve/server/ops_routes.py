"""Operations: ``/health``, ``/metrics`` (Prometheus text), ``/openapi.json``.

Who may read them is decided by :mod:`ragserve.server.auth`."""

from __future__ import annotations

import logging

from aiohttp import web

from ragserve.engine.async_engine import EngineDeadError
from ragserve.engine.engine_info import EngineSnapshot
from ragserve.server.metrics import CONTENT_TYPE
from ragserve.server.openapi import build_spec
from ragserve.server.state import ADMISSION, CONFIG, DOCUMENTS, DRAINING, ENGINE, METRICS

logger = logging.getLogger(__name__)

SNAPSHOT_TIMEOUT = 10.0


def add_routes(app: web.Application) -> None:
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)


async def health(request: web.Request) -> web.Response:
    """200 while the engine runs and the server accepts work; 503 otherwise: the engine
    thread died, it has stopped stepping while requests wait, or the server is draining."""
    engine = request.app[ENGINE]
    if not engine.is_alive:
        return web.json_response({"status": "engine_dead"}, status=503)
    stalled = engine.stalled_for()
    if stalled > request.app[CONFIG].engine_stall_seconds:
        body = {"status": "engine_stalled", "stalled_seconds": round(stalled, 1)}
        return web.json_response(body, status=503)
    if request.app[DRAINING].is_set():
        return web.json_response({"status": "shutting_down"}, status=503)
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    app = request.app
    engine = app[ENGINE]
    snapshot: EngineSnapshot | None
    try:
        snapshot = await engine.snapshot(SNAPSHOT_TIMEOUT)
    except EngineDeadError as exc:
        logger.warning("metrics without engine values: %s", exc)
        snapshot = None
    app[METRICS].record_admission(app[ADMISSION])
    shared, directory = app[DOCUMENTS].shared, app[DOCUMENTS].store
    body = app[METRICS].render(
        snapshot,
        engine.num_active_requests,
        app[DOCUMENTS].count_by_status(),
        shared.counts if shared is not None else None,
        directory.counts if directory is not None else None,
    )
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(build_spec(request.app))
