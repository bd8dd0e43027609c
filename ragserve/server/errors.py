"""OpenAI-style error bodies: every failure leaves as ``{"error": {message, type, param, code}}``.

Handlers raise :class:`APIError`; the middleware also maps aiohttp's own HTTP exceptions
(unknown route, wrong method, oversized body), request validation errors, engine
a dead engine. Engine rejections (``ValueError``) are turned into 400s where the engine
is called, so a ``ValueError`` from a bug still reads as a 500. Anything else is a 500 whose body names
the request id but never carries a traceback.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from ragserve.engine.async_engine import (
    EngineDeadError,
    EngineRequestError,
    EngineStepError,
    RequestAbortedError,
    RequestFailedError,
)
from ragserve.server.request_context import REQUEST_ID

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class APIError(Exception):
    """An error the client should see as-is, with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


# Why the engine stopped serving a request, as the client sees it. A request's own fault
# and a step's fault are the server's errors (500), but the message says which it was.
_ENGINE_ERRORS: dict[type[EngineRequestError], tuple[int, str]] = {
    EngineDeadError: (503, "engine_dead"),
    RequestAbortedError: (503, "request_aborted"),
    RequestFailedError: (500, "request_failed"),
    EngineStepError: (500, "engine_step_failed"),
}


def from_engine_error(exc: EngineRequestError) -> APIError:
    status, code = next(
        (value for kind, value in _ENGINE_ERRORS.items() if isinstance(exc, kind)),
        (500, "engine_error"),
    )
    return APIError(status, str(exc), code=code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_body(status: int, message: str, param: str | None, code: str | None) -> dict[str, Any]:
    error_type = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(error: APIError) -> web.Response:
    body = error_body(error.status, error.message, error.param, error.code)
    return web.json_response(body, status=error.status, headers=error.headers)


def from_validation_error(exc: ValidationError) -> APIError:
    """The first problem, named by its field; pydantic's own wording, never the input value."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    first = errors[0]
    loc = [str(part) for part in first["loc"]]
    message = str(first["msg"]).removeprefix("Value error, ")
    if loc:
        message = f"{'.'.join(loc)}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problems)"
    return bad_request(message, param=loc[0] if loc else None)


def from_http_exception(exc: web.HTTPException) -> APIError:
    message = exc.text or exc.reason
    if isinstance(exc, web.HTTPNotFound):
        message = "no such route; see /openapi.json for the API"
    elif isinstance(exc, web.HTTPMethodNotAllowed):
        message = f"method {exc.method} not allowed here; allowed: {', '.join(sorted(exc.allowed_methods))}"
    headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
    code = "request_too_large" if isinstance(exc, web.HTTPRequestEntityTooLarge) else None
    return APIError(exc.status, message.removeprefix(f"{exc.status}: "), code=code, headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except APIError as exc:
        return error_response(exc)
    except ValidationError as exc:
        return error_response(from_validation_error(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise  # redirects and the like pass through
        return error_response(from_http_exception(exc))
    except EngineRequestError as exc:
        return error_response(from_engine_error(exc))
    except Exception:
        request_id = request.get(REQUEST_ID, "?")
        logger.exception("request %s failed", request_id)
        message = f"internal server error (request id {request_id}); see the server log"
        return error_response(APIError(500, message, code="internal_error"))
