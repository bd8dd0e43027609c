"""The application factory and the serving loop.

Middlewares, outermost first: heap release → request id → metrics → errors → auth. So
every response, errors included, carries ``X-Request-Id`` and is counted with its final
status, an authentication failure is an ordinary OpenAI-style error, and a large body's
memory goes back to the system once its request is gone.

The application owns the engine it is given: its cleanup stops ingestion and shuts the
engine down.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from aiohttp import web

from ragserve.config import EngineConfig
from ragserve.engine.async_engine import AsyncEngine
from ragserve.engine.engine_info import EngineInfo
from ragserve.server import document_routes, openai_routes, ops_routes, pipeline_routes
from ragserve.server.admission import WorkAdmission
from ragserve.server.auth import make_auth_middleware, tenant_name
from ragserve.server.config import ServerConfig
from ragserve.server.connections import ConnectionLimits, ServingRunner, ensure_open_file_limit
from ragserve.server.document_store import DocumentStore
from ragserve.server.documents import DocumentService
from ragserve.server.errors import error_middleware
from ragserve.server.heap_release import HeapRelease, make_heap_release_middleware
from ragserve.server.metrics import ServerMetrics, make_metrics_middleware
from ragserve.server.prompts import PromptBuilder
from ragserve.server.registry_cipher import RegistryCipher
from ragserve.server.registry_models import ModelRecord
from ragserve.server.request_context import REQUEST_ID
from ragserve.server.state import (
    ADMISSION,
    CONFIG,
    DOCUMENTS,
    DRAINING,
    ENGINE,
    METRICS,
    MODEL_NAME,
    PROMPTS,
    REQUESTS_IN_FLIGHT,
    STARTED_AT,
)
from ragserve.server.store_registry import StoreRegistry
from ragserve.server.tenant_limits import DocumentLimits, RequestsInFlight
from ragserve.server.tokenizer_identity import tokenizer_fingerprint

logger = logging.getLogger(__name__)

ACCESS_LOG_FORMAT = '%a "%r" %s %b %Tfs request_id=%{X-Request-Id}o'
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@web.middleware
async def request_id_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Use the client's ``X-Request-Id`` when it is sane, else a fresh one; echo it back."""
    given = request.headers.get("X-Request-Id", "")
    rid = given if _CLIENT_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
    request[REQUEST_ID] = rid
    response: web.StreamResponse = await handler(request)
    if not response.prepared:
        response.headers["X-Request-Id"] = rid
    return response


def create_app(
    engine: AsyncEngine,
    config: ServerConfig | None = None,
    engine_config: EngineConfig | None = None,
) -> web.Application:
    """``engine_config``: the engine's flags, read for the remote tier's store (the
    document registry is shared through it too); None: no shared registry."""
    config = config or ServerConfig()
    metrics = ServerMetrics()
    heap_release = HeapRelease()
    app = web.Application(
        client_max_size=config.max_request_bytes,
        middlewares=[
            make_heap_release_middleware(heap_release),
            request_id_middleware,
            make_metrics_middleware(metrics),
            error_middleware,
            make_auth_middleware(config.api_keys, config.metrics_key),
        ],
    )
    prompts = PromptBuilder(
        engine.tokenizer,
        max_model_len=engine.max_model_len,
        max_text_bytes=config.max_text_bytes,
    )
    admission = WorkAdmission(config.max_queue_seconds)
    app[ENGINE] = engine
    app[ADMISSION] = admission
    app[CONFIG] = config
    app[METRICS] = metrics
    app[PROMPTS] = prompts
    app[REQUESTS_IN_FLIGHT] = RequestsInFlight(config.max_requests_per_tenant)
    app[DOCUMENTS] = DocumentService(
        engine,
        prompts,
        admission,
        document_store(
            engine.info,
            tokenizer_fingerprint(engine.tokenizer),
            Path(config.registry_dir) if config.registry_dir else None,
            config.ingest_lease_seconds,
        ),
        config.document_ttl,
        DocumentLimits.from_config(config),
        store_registry(engine_config, engine.info.model_fingerprint, config.ingest_lease_seconds),
    )
    app[MODEL_NAME] = config.served_model_name or engine.model_name
    app[STARTED_AT] = int(time.time())
    app[DRAINING] = asyncio.Event()
    openai_routes.add_routes(app)
    document_routes.add_routes(app)
    pipeline_routes.add_routes(app)
    ops_routes.add_routes(app)
    app.on_shutdown.append(_start_draining)
    app.on_cleanup.append(lambda _app: _close(heap_release))
    app.cleanup_ctx.append(_engine_lifecycle)
    return app


async def _close(heap_release: HeapRelease) -> None:
    heap_release.close()


async def _start_draining(app: web.Application) -> None:
    # Runs after the listening sockets close, before running handlers are waited for.
    app[DRAINING].set()
    logger.info(
        "shutting down: %d engine requests in flight get %.0f s to finish",
        app[ENGINE].num_active_requests,
        app[CONFIG].shutdown_timeout,
    )


def document_store(
    info: EngineInfo,
    tokenizer: str | None = None,
    directory: Path | None = None,
    lease_s: float = 10.0,
) -> DocumentStore | None:
    """The registry file's home: ``directory`` when given, else the disk KV tier's
    directory when the engine has one. ``tokenizer``: the model's tokenizer digest
    (documents of models sharing it are taken over after a model change). ``lease_s``:
    an ingestion's lease (see :mod:`ragserve.server.registry_ingestions`)."""
    directory = directory or info.disk_tier_dir
    if directory is None:
        return None
    cipher = None
    if info.disk_tier_key_file is not None:
        # NOTE: the engine already read this file at start-up; it is readable and long enough.
        cipher = RegistryCipher.from_file(info.disk_tier_key_file)
    record = ModelRecord(info.kv_model, tokenizer) if tokenizer is not None else None
    return DocumentStore(directory, info.model_fingerprint, cipher, record, lease_s)


def store_registry(
    config: EngineConfig | None, model_fingerprint: str, lease_s: float
) -> StoreRegistry | None:
    """The registry shared through the remote tier's store, when the engine has one. Its
    rows are sealed under the tier's key file when there is one, so the store never holds
    document text in the clear then. ``lease_s``: an ingestion's lease (see
    :mod:`ragserve.server.ingest_leases`)."""
    if config is None or not config.kv_remote_url:
        return None
    cipher = None
    if config.kv_encryption_key_file:
        # NOTE: the engine already read this file at start-up; it is readable and long enough.
        cipher = RegistryCipher.from_file(config.kv_encryption_key_file)
    return StoreRegistry.connect(
        config.kv_remote_url,
        model_fingerprint,
        cipher,
        config.kv_remote_timeout_s,
        config.kv_remote_retry_s,
        lease_s,
    )


async def _engine_lifecycle(app: web.Application) -> AsyncIterator[None]:
    keys = app[CONFIG].api_keys
    tenants = {tenant_name(key) for key in keys} if keys else {""}
    try:
        await app[DOCUMENTS].restore(tenants)
    except Exception:  # NOTE: a registry problem must never stop the server starting
        logger.exception("stored documents could not be restored")
    yield
    await app[DOCUMENTS].close()
    app[PROMPTS].close()
    await app[ENGINE].shutdown()
    logger.info("engine stopped")


def _url(address: Any) -> str:
    host, port = address[0], address[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def start_serving(app: web.Application, config: ServerConfig) -> ServingRunner:
    """Start the application listening on ``config.host``/``config.port`` (port 0: any
    free one, see ``runner.addresses``); the caller owns the runner and cleans it up
    (which shuts down gracefully, see ``serve``). Used by ``serve`` and by a cluster
    replica (:mod:`ragserve.cluster.replica`)."""
    ensure_open_file_limit(config.max_connections)
    runner = ServingRunner(
        app,
        limits=ConnectionLimits.from_config(config),
        handler_cancellation=True,  # a client that disconnects cancels its handler
        shutdown_timeout=config.shutdown_timeout,
        access_log_format=ACCESS_LOG_FORMAT,
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, config.host, config.port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


async def serve(app: web.Application, config: ServerConfig) -> None:
    """Serve until SIGINT or SIGTERM, then shut down gracefully.

    Shutdown: stop listening, refuse new work (503), give running requests
    ``config.shutdown_timeout`` seconds, cancel the rest (aborting their engine requests),
    then stop the engine. Connections are bounded as :mod:`ragserve.server.connections`
    describes.
    """
    runner = await start_serving(app, config)
    try:
        for address in runner.addresses:
            logger.info("ragserve serving %s at %s/v1", app[MODEL_NAME], _url(address))
        if not config.api_keys and config.host not in ("127.0.0.1", "localhost", "::1"):
            logger.warning(
                "listening on %s without --api-key: anyone who can reach it may use it", config.host
            )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    finally:
        await runner.cleanup()
