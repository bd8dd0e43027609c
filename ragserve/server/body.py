"""Reading request bodies: content type, size (aiohttp's ``client_max_size``), a deadline
(``ServerConfig.body_timeout``), JSON, schema."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from pydantic import BaseModel

from ragserve.server.errors import APIError, bad_request
from ragserve.server.state import CONFIG
from ragserve.timeouts import within

ModelT = TypeVar("ModelT", bound=BaseModel)
T = TypeVar("T")

# A UTF-16 surrogate encoded as UTF-8 (json.loads decodes bytes with "surrogatepass").
_UTF8_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


def require_content_type(request: web.Request, *allowed: str) -> str:
    if request.content_type not in allowed:
        raise APIError(
            415,
            f"expected Content-Type {' or '.join(allowed)}, got {request.content_type!r}",
            code="unsupported_media_type",
        )
    return request.content_type


async def within_body_timeout(request: web.Request, reading: Awaitable[T]) -> T:
    """``reading`` (which reads the body) within ``body_timeout`` seconds: 408 past it; a
    body whose framing is broken (chunk sizes, a multipart header) is a 400."""
    timeout = request.app[CONFIG].body_timeout
    try:
        return await within(reading, timeout)
    except asyncio.TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within {timeout:g} s",
            code="request_timeout",
        ) from None
    except HttpProcessingError as exc:
        message = str(exc.message).replace("\x00", "\\x00")[:300]
        raise bad_request(
            f"malformed request body: {message}", code="invalid_http_request"
        ) from None


async def read_body(request: web.Request) -> bytes:
    """The whole body (413 past ``client_max_size``; see :func:`within_body_timeout`)."""
    return await within_body_timeout(request, request.read())


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
    if isinstance(raw, str) or _may_hold_surrogate(raw):
        try:
            # NOTE: JSON may escape lone UTF-16 surrogates ("\ud800"), which no tokenizer can take.
            json.dumps(data, ensure_ascii=False).encode()
        except (UnicodeEncodeError, RecursionError):
            raise bad_request(
                "the request body contains an unpaired UTF-16 surrogate", code="invalid_json"
            ) from None
    return data


def _may_hold_surrogate(raw: bytes) -> bool:
    """Whether ``raw`` may hold a UTF-16 surrogate: only then is the full check run.

    NOTE: the full check re-serializes the body (about 0.1 s for 20 MB) and one regex over
    all escapes is slower still when a client escapes all non-ASCII text; substring tests
    cost milliseconds."""
    if b"\\ud" in raw or b"\\uD" in raw:
        return True
    return b"\xed" in raw and _UTF8_SURROGATE.search(raw) is not None


async def read_json(request: web.Request) -> dict[str, Any]:
    require_content_type(request, "application/json")
    # NOTE: read() enforces client_max_size and raises 413 with both sizes.
    return parse_json_object(await read_body(request))


async def parse_request(request: web.Request, model: type[ModelT]) -> ModelT:
    """Validate the body against ``model``; pydantic's errors become 400s (error middleware)."""
    return model.model_validate(await read_json(request))
