"""``/v1/documents``: upload (JSON or a multipart .txt/.md file), inspect, list, change
(PATCH: expiry, metadata), delete."""

from __future__ import annotations

import re
from typing import Any

from aiohttp import BodyPartReader, web

from ragserve.server.admission_checks import check_admission
from ragserve.server.body import (
    parse_json_object,
    read_body,
    require_content_type,
    within_body_timeout,
)
from ragserve.server.document_lifecycle import DocumentPatch
from ragserve.server.errors import APIError, bad_request
from ragserve.server.protocol import DocumentRequest
from ragserve.server.request_context import tenant
from ragserve.server.state import CONFIG, DOCUMENTS, DRAINING, ENGINE, PROMPTS

TEXT_SUFFIXES = (".txt", ".md", ".markdown")
TEXT_TYPES = ("text/plain", "text/markdown", "text/x-markdown")
_CHUNK = 64 * 1024
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


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
        reading = _read_multipart(request, app[CONFIG].max_request_bytes)
        text, metadata = await within_body_timeout(request, reading)
    app[PROMPTS].text_limit.check([text], "text")
    docs = app[DOCUMENTS]
    namespace = tenant(request)
    if docs.existing(namespace, text) is None:
        check_admission(app[ENGINE], app[CONFIG], 1, app[DRAINING].is_set())
    doc, created = await docs.add(namespace, text, metadata, ttl, expire_time)
    return web.json_response(doc.to_json(docs.block_size), status=202 if created else 200)


async def _read_multipart(request: web.Request, limit: int) -> tuple[str, dict[str, Any]]:
    """Fields ``file`` (required: a UTF-8 .txt or .md file) and ``metadata`` (a JSON object)."""
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit, request.content_length)
    raw_file: bytes | None = None
    filename: str | None = None
    metadata: dict[str, Any] = {}
    received = 0
    try:
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                raise bad_request("nested multipart bodies are not supported", "file")
            data = bytearray()
            while chunk := await part.read_chunk(_CHUNK):
                received += len(chunk)
                if received > limit:
                    raise _too_large(limit, received)
                data += chunk
            if part.name == "file":
                filename = part.filename
                if filename is not None and _CONTROL.search(filename):
                    raise bad_request("the file name holds control characters", "file")
                _check_file_type(filename, part.headers.get("Content-Type", ""))
                raw_file = bytes(data)
            elif part.name == "metadata":
                metadata = parse_json_object(bytes(data))
    except (ValueError, RuntimeError) as exc:
        if isinstance(exc, UnicodeDecodeError):
            raise bad_request("the metadata field is not UTF-8", "metadata") from None
        raise bad_request(f"malformed multipart body: {exc}", "file") from None
    if raw_file is None:
        raise bad_request("the multipart body needs a 'file' field", "file")
    try:
        text = raw_file.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the file is not UTF-8 text: {exc}", "file") from None
    if not text:
        raise bad_request("the file is empty", "file")
    if filename:
        metadata = {"filename": filename, **metadata}
    return text, metadata


def _check_file_type(filename: str | None, content_type: str) -> None:
    media_type = content_type.split(";")[0].strip().lower()
    if filename and filename.lower().endswith(TEXT_SUFFIXES):
        return
    if not filename and media_type in TEXT_TYPES:
        return
    raise APIError(
        415,
        f"only UTF-8 text files ({', '.join(TEXT_SUFFIXES)}) can be uploaded, got "
        f"{(filename or media_type or 'an unnamed file')[:100]!r}",
        param="file",
        code="unsupported_media_type",
    )


def _too_large(limit: int, size: int) -> APIError:
    return APIError(
        413,
        f"Maximum request body size {limit} exceeded, actual body size {size}",
        code="request_too_large",
    )


async def list_documents(request: web.Request) -> web.Response:
    docs = request.app[DOCUMENTS]
    data = [doc.to_json(docs.block_size) for doc in docs.list_for(tenant(request))]
    return web.json_response({"object": "list", "data": data})


async def get_document(request: web.Request) -> web.Response:
    docs = request.app[DOCUMENTS]
    doc = docs.get(tenant(request), request.match_info["id"])
    kv = await request.app[ENGINE].locate_prefix(doc.prefix_ids, doc.namespace)
    return web.json_response(doc.to_json(docs.block_size, kv))


async def patch_document(request: web.Request) -> web.Response:
    """Change ``ttl`` / ``expire_time`` (null: never expires) and/or ``metadata``."""
    require_content_type(request, "application/json")
    patch = DocumentPatch.model_validate(parse_json_object(await read_body(request)))
    docs = request.app[DOCUMENTS]
    doc = await docs.update(tenant(request), request.match_info["id"], patch)
    return web.json_response(doc.to_json(docs.block_size))


async def delete_document(request: web.Request) -> web.Response:
    doc = await request.app[DOCUMENTS].remove(tenant(request), request.match_info["id"])
    return web.json_response({"id": doc.id, "object": "document", "deleted": True})
