"""The multipart form of ``POST /v1/documents``: a UTF-8 text file and the same optional
fields a JSON upload takes (``metadata``, ``ttl``, ``expire_time``), each a form field.

Form fields are text, so ``ttl`` must read as a number and ``expire_time`` is Unix seconds
when it reads as a number, else an RFC 3339 string; the values are then checked by the same
rules as a JSON upload (:mod:`ragserve.server.document_lifecycle`). Every bad field is a 400
naming it in ``param``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from aiohttp import BodyPartReader, web

from ragserve.server.body import parse_json_object
from ragserve.server.errors import APIError, bad_request

TEXT_SUFFIXES = (".txt", ".md", ".markdown")
TEXT_TYPES = ("text/plain", "text/markdown", "text/x-markdown")
_CHUNK = 64 * 1024
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_FIELD_LIMIT = 64  # characters of a ttl / expire_time field; longer is no time


@dataclass
class UploadForm:
    """What a multipart upload asked for, parsed but not yet checked against the rules."""

    text: str
    metadata: dict[str, Any] = field(default_factory=dict)
    ttl: float | None = None
    expire_time: float | str | None = None


async def read_upload_form(request: web.Request, limit: int) -> UploadForm:
    """Fields ``file`` (required: a UTF-8 .txt or .md file), ``metadata`` (a JSON object),
    ``ttl`` and ``expire_time``; other fields are ignored. 413 past ``limit`` bytes."""
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit, request.content_length)
    raw_file: bytes | None = None
    filename: str | None = None
    fields: dict[str, bytes] = {}
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
            elif part.name in ("metadata", "ttl", "expire_time"):
                fields[part.name] = bytes(data)
    except (ValueError, RuntimeError) as exc:
        raise bad_request(f"malformed multipart body: {exc}", "file") from None
    if raw_file is None:
        raise bad_request("the multipart body needs a 'file' field", "file")
    form = UploadForm(_file_text(raw_file))
    if "metadata" in fields:
        form.metadata = _metadata(fields["metadata"])
    if filename:
        form.metadata = {"filename": filename, **form.metadata}
    if "ttl" in fields:
        form.ttl = _number(_field_text(fields["ttl"], "ttl"), "ttl")
    if "expire_time" in fields:
        form.expire_time = _time(_field_text(fields["expire_time"], "expire_time"))
    return form


def _file_text(raw: bytes) -> str:
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the file is not UTF-8 text: {exc}", "file") from None
    if not text:
        raise bad_request("the file is empty", "file")
    return text


def _metadata(raw: bytes) -> dict[str, Any]:
    try:
        return parse_json_object(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise bad_request("the metadata field is not UTF-8", "metadata") from None
    except APIError as exc:  # NOTE: the body parser's message, this field's name
        raise bad_request(f"metadata: {exc.message}", "metadata", exc.code) from None


def _field_text(raw: bytes, name: str) -> str:
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise bad_request(f"the {name} field is not UTF-8", name, "invalid_expiry") from None
    if not text or len(text) > _FIELD_LIMIT:
        raise bad_request(f"the {name} field is empty or too long", name, "invalid_expiry")
    return text


def _number(text: str, name: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise bad_request(
            f"{name} must be a number of seconds, got {text!r}", name, "invalid_expiry"
        ) from None
    if not math.isfinite(value):
        raise bad_request(f"{name} must be finite, got {text!r}", name, "invalid_expiry")
    return value


def _time(text: str) -> float | str:
    """Unix seconds when the text is a number, else the text (an RFC 3339 time)."""
    try:
        return _number(text, "expire_time")
    except APIError:
        return text


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
