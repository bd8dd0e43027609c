"""``/v1/documents``: upload (JSON, or a multipart .txt/.md file with the same optional
fields: see :mod:`ragserve.server.upload_form`), inspect, list, change (PATCH: expiry,
metadata), delete."""

from __future__ import annotations

from aiohttp import web

from ragserve.server.admission_checks import check_admission
from ragserve.server.body import (
    parse_json_object,
    read_body,
    require_content_type,
    within_body_timeout,
)
from ragserve.server.document_lifecycle import DocumentPatch
from ragserve.server.protocol import DocumentRequest
from ragserve.server.request_context import tenant
from ragserve.server.state import CONFIG, DOCUMENTS, DRAINING, ENGINE, PROMPTS
from ragserve.server.upload_form import read_upload_form


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/documents", upload_document)
    app.router.add_get("/v1/documents", list_documents)
    app.router.add_get("/v1/documents/{id}", get_document)
    app.router.add_patch("/v1/documents/{id}", patch_document)
    app.router.add_delete("/v1/documents/{id}", delete_document)


async def upload_document(request: web.Request) -> web.Response:
    """202 with ``status: ingesting`` for a new document, 200 with its state for a known one."""
    app = request.app
    kind = require_content_type(request, "application/json", "multipart/form-data")
    ttl: float | None = None
    expire_time: float | str | None = None
    if kind == "application/json":
        body = DocumentRequest.model_validate(parse_json_object(await read_body(request)))
        text, metadata = body.text, body.metadata
        ttl, expire_time = body.ttl, body.expire_time
    else:
        reading = read_upload_form(request, app[CONFIG].max_request_bytes)
        form = await within_body_timeout(request, reading)
        text, metadata, ttl, expire_time = form.text, form.metadata, form.ttl, form.expire_time
    app[PROMPTS].text_limit.check([text], "text")
    docs = app[DOCUMENTS]
    namespace = tenant(request)
    if docs.existing(namespace, text) is None:
        check_admission(app[ENGINE], app[CONFIG], 1, app[DRAINING].is_set())
    doc, created = await docs.add(namespace, text, metadata, ttl, expire_time)
    return web.json_response(doc.to_json(docs.block_size), status=202 if created else 200)


async def list_documents(request: web.Request) -> web.Response:
    docs = request.app[DOCUMENTS]
    await docs.learn_listed(tenant(request))  # uploaded through a server on another machine
    data = [doc.to_json(docs.block_size) for doc in docs.list_for(tenant(request))]
    return web.json_response({"object": "list", "data": data})


async def get_document(request: web.Request) -> web.Response:
    docs = request.app[DOCUMENTS]
    await docs.learn(tenant(request), [request.match_info["id"]])
    doc = docs.get(tenant(request), request.match_info["id"])
    kv = await request.app[ENGINE].locate_prefix(doc.prefix_ids, doc.namespace)
    return web.json_response(doc.to_json(docs.block_size, kv))


async def patch_document(request: web.Request) -> web.Response:
    """Change ``ttl`` / ``expire_time`` (null: never expires) and/or ``metadata``."""
    require_content_type(request, "application/json")
    patch = DocumentPatch.model_validate(parse_json_object(await read_body(request)))
    docs = request.app[DOCUMENTS]
    await docs.learn(tenant(request), [request.match_info["id"]])  # uploaded elsewhere
    doc = await docs.update(tenant(request), request.match_info["id"], patch)
    return web.json_response(doc.to_json(docs.block_size))


async def delete_document(request: web.Request) -> web.Response:
    docs = request.app[DOCUMENTS]
    # NOTE: uploaded through another server: deleted here all the same, everywhere.
    await docs.learn(tenant(request), [request.match_info["id"]])
    doc = await docs.remove(tenant(request), request.match_info["id"])
    return web.json_response({"id": doc.id, "object": "document", "deleted": True})
