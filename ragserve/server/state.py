"""Typed keys for what the application carries."""

from __future__ import annotations

import asyncio

from aiohttp import web

from ragserve.engine.async_engine import AsyncEngine
from ragserve.server.admission import WorkAdmission
from ragserve.server.config import ServerConfig
from ragserve.server.documents import DocumentService
from ragserve.server.metrics import ServerMetrics
from ragserve.server.prompts import PromptBuilder
from ragserve.server.tenant_limits import RequestsInFlight

ENGINE: web.AppKey[AsyncEngine] = web.AppKey("engine")
CONFIG: web.AppKey[ServerConfig] = web.AppKey("config")
METRICS: web.AppKey[ServerMetrics] = web.AppKey("metrics")
ADMISSION: web.AppKey[WorkAdmission] = web.AppKey("admission")
DOCUMENTS: web.AppKey[DocumentService] = web.AppKey("documents")
PROMPTS: web.AppKey[PromptBuilder] = web.AppKey("prompts")
REQUESTS_IN_FLIGHT: web.AppKey[RequestsInFlight] = web.AppKey("requests_in_flight")
MODEL_NAME: web.AppKey[str] = web.AppKey("model_name", str)
STARTED_AT: web.AppKey[int] = web.AppKey("started_at", int)
# Set once shutdown begins: new work is refused while running requests finish.
DRAINING: web.AppKey[asyncio.Event] = web.AppKey("draining", asyncio.Event)
