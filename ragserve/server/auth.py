"""Bearer-key authentication; each API key is a tenant with its own cache namespace.

With API keys set, ``/v1`` and ``/openapi.json`` (which describes it) need one of them,
and so does ``/metrics``, unless a metrics key is set: then only that key opens it (its
counts are the whole server's, every tenant's together). A metrics key alone protects
``/metrics`` only. ``/health`` stays open: load balancers probe it.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from aiohttp import web

from ragserve.server.errors import APIError
from ragserve.server.request_context import TENANT

PROTECTED_PREFIX = "/v1"
SPEC_PATH = "/openapi.json"
METRICS_PATH = "/metrics"


def tenant_name(api_key: str) -> str:
    """A stable, non-reversible name for a key: the namespace its blocks and documents live in."""
    return "tenant-" + hashlib.sha256(api_key.encode()).hexdigest()[:24]


def read_api_key_file(path: str) -> list[str]:
    """One key per line; blank lines and lines starting with ``#`` are skipped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ValueError(f"the API key file {path} holds no key")
    return keys


def make_auth_middleware(api_keys: Iterable[str], metrics_key: str | None = None) -> Any:
    """Without keys every caller is the anonymous tenant ""; the rules are the module's."""
    tenants = [(key.encode(), tenant_name(key)) for key in api_keys]
    # NOTE: the metrics key is no tenant: it opens /metrics and nothing else.
    scrapers = [(metrics_key.encode(), "")] if metrics_key else tenants

    @web.middleware
    async def auth_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        request[TENANT] = ""
        path = request.path
        if tenants and (path.startswith(PROTECTED_PREFIX) or path == SPEC_PATH):
            request[TENANT] = _authenticate(request.headers.get("Authorization", ""), tenants)
        elif scrapers and path == METRICS_PATH:
            _authenticate(request.headers.get("Authorization", ""), scrapers)
        response: web.StreamResponse = await handler(request)
        return response

    return auth_middleware


def _authenticate(header: str, tenants: list[tuple[bytes, str]]) -> str:
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError(
            401,
            "missing API key: send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    given = token.strip().encode()
    found = None
    for key, name in tenants:
        # NOTE: compare against every key, so the time taken does not tell which one matched.
        if hmac.compare_digest(given, key):
            found = name
    if found is None:
        raise APIError(
            401, "invalid API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
        )
    return found
