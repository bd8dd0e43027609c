"""What each request carries, set by the middlewares: its id and its tenant."""

from __future__ import annotations

from aiohttp import web

# Plain keys: ``web.RequestKey`` needs a newer aiohttp than we require.
REQUEST_ID = "ragserve.request_id"
TENANT = "ragserve.tenant"


def request_id(request: web.Request) -> str:
    value: str = request[REQUEST_ID]
    return value


def tenant(request: web.Request) -> str:
    """The caller's cache namespace: "" without API keys, a digest of its key otherwise."""
    value: str = request.get(TENANT, "")
    return value
