"""Reading request bodies: content type, size (aiohttp's ``client_max_size``), JSON, schema."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel

from ragserve.server.errors import APIError, bad_request

ModelT = TypeVar("ModelT", bound=BaseModel)


def require_content_type(request: web.Request, *allowed: str) -> str:
    if request.content_type not in allowed:
        raise APIError(
            415,
            f"expected Content-Type {' or '.join(allowed)}, got {request.content_type!r}",
            code="unsupported_media_type",
        )
    return request.content_type


def parse_json_object(raw: bytes | str) -> dict[str, Any]:
    """A JSON object, or a 400 that says what is wrong with the bytes."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise bad_request(
            f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise bad_request(
            f"the request body must be a JSON object, got {type(data).__name__}",
            code="invalid_json",
        )
    try:
        # NOTE: JSON may escape lone UTF-16 surrogates ("\ud800"), which no tokenizer can take.
        json.dumps(data, ensure_ascii=False).encode()
    except (UnicodeEncodeError, RecursionError):
        raise bad_request(
            "the request body contains an unpaired UTF-16 surrogate", code="invalid_json"
        ) from None
    return data


async def read_json(request: web.Request) -> dict[str, Any]:
    require_content_type(request, "application/json")
    # NOTE: read() enforces client_max_size and raises 413 with both sizes.
    return parse_json_object(await request.read())


async def parse_request(request: web.Request, model: type[ModelT]) -> ModelT:
    """Validate the body against ``model``; pydantic's errors become 400s (error middleware)."""
    return model.model_validate(await read_json(request))
