"""Connection limits under the application: how long a client may take, how many it may
hold open, how much output may wait for it, and OpenAI-shaped errors from the HTTP parser.

aiohttp gives each connection a ``RequestHandler`` made by a ``web.Server``; the runner
below builds ours instead:

- **Heads and idle connections**: aiohttp's keep-alive timer runs from the moment a
  connection opens or its last response ends until a complete request head has arrived,
  so ``keepalive_timeout`` closes both idle connections and heads that trickle in.
- **Bodies**: read with a deadline where they are read (:mod:`ragserve.server.body`);
  after the 408, aiohttp reads and drops what the client still sends for up to 10 s (its
  lingering close, so the client sees the answer rather than a reset), then closes.
- **Writes**: the transport's write buffer is capped at ``write_buffer_bytes``; past it a
  writer waits for the client to read. A connection whose writes make no progress for
  ``write_timeout`` seconds is cut: its handler is cancelled, which aborts its engine
  requests and frees their blocks. aiohttp's stream writer waits only every 64 KiB, so a
  streaming response holds at most ``write_buffer_bytes`` + 64 KiB + one event.
- **Count**: a connection beyond ``max_connections`` is answered 503 and closed.
- **Parser errors** (over-long request line or header, too many headers, a bad request
  line or chunk size) are answered with the OpenAI error body instead of plain text.

NOTE: this subclasses aiohttp's connection classes and reads ``Server._kwargs`` and
``RequestHandler._force_close``, so pyproject.toml pins aiohttp to 3.14.x.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import socket
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from ragserve.server.config import ServerConfig
from ragserve.server.errors import error_body

logger = logging.getLogger(__name__)

# A refused connection is read from (and the bytes dropped) this long before it is closed,
# so the client reads the 503 instead of a reset caused by its unread request; past
# MAX_LINGERING such connections at once (a flood), they are closed at once.
REFUSED_LINGER_S = 1.0
MAX_LINGERING = 64
# Descriptors the process needs beside its connections: the engine's and tiers' files,
# the registry, listening sockets, pipes.
RESERVED_FILES = 256
_MAX_ERROR_MESSAGE = 300


@dataclass(frozen=True)
class ConnectionLimits:
    keepalive_timeout: float
    write_timeout: float
    max_connections: int
    write_buffer_bytes: int
    retry_after_seconds: int = 1

    @classmethod
    def from_config(cls, config: ServerConfig) -> ConnectionLimits:
        return cls(
            keepalive_timeout=config.keepalive_timeout,
            write_timeout=config.write_timeout,
            max_connections=config.max_connections,
            write_buffer_bytes=config.write_buffer_bytes,
            retry_after_seconds=config.retry_after_seconds,
        )


def json_error(status: int, message: str, code: str | None) -> web.Response:
    """An OpenAI error response that also closes the connection."""
    body = error_body(status, message, None, code)
    response = web.json_response(body, status=status)
    response.force_close()
    return response


def refusal_bytes(retry_after_seconds: int) -> bytes:
    """The whole HTTP response sent to a connection beyond ``max_connections``."""
    body = json.dumps(
        error_body(503, "the server has too many open connections; retry later", None, "overloaded")
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"Retry-After: {retry_after_seconds}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardedRequestHandler(RequestHandler):
    """aiohttp's connection handler with a write-stall timeout, a write-buffer cap,
    refusal of connections over the cap and JSON bodies for the errors it answers itself."""

    def __init__(self, manager: web.Server, *, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._limits = limits
        self._stall_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.transport is None or self._force_close:  # refused
            return
        size = self._limits.write_buffer_bytes
        self.transport.set_write_buffer_limits(high=size)
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            # NOTE: the kernel's send buffer grows to 4 MiB on its own (Linux's tcp_wmem),
            # which would hide a stalled reader for thousands of tokens; capped, it holds
            # twice this (the kernel doubles it).
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)

    def connection_lost(self, exc: BaseException | None) -> None:
        for timer in (self._stall_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        self._stall_timer = self._linger_timer = None
        super().connection_lost(exc)

    # -- writes ------------------------------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        self._stall_timer = self._loop.call_later(self._limits.write_timeout, self._write_stalled)

    def resume_writing(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        super().resume_writing()

    def _write_stalled(self) -> None:
        self._stall_timer = None
        transport = self.transport
        if transport is None:
            return
        peer = transport.get_extra_info("peername")
        logger.info(
            "closing the connection from %s: it read nothing for %.0f s while %d bytes waited",
            peer,
            self._limits.write_timeout,
            transport.get_write_buffer_size(),
        )
        # NOTE: abort, not close: close would wait for the buffer to drain, which is what
        # the client is not doing. connection_lost then cancels the handler.
        transport.abort()

    # -- refusal -----------------------------------------------------------------------------
    def refuse(self, linger_s: float) -> None:
        """Answer 503 before reading a request, then close after ``linger_s`` seconds."""
        transport = self.transport
        if transport is None:
            return
        self._force_close = True  # data_received drops what arrives; start() exits at once
        transport.write(refusal_bytes(self._limits.retry_after_seconds))
        if linger_s <= 0:
            transport.close()
            return
        if transport.can_write_eof():
            transport.write_eof()
        self._linger_timer = self._loop.call_later(linger_s, transport.close)

    # -- errors aiohttp answers itself -----------------------------------------------------------
    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """Parser errors (400), handler timeouts (504) and exceptions no middleware caught
        (500), as OpenAI error bodies. The connection is closed after the response."""
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already sent; the connection is dropped")
        if status >= 500:
            if exc is not None and status == 500:
                self.log_exception("error handling a request from %s", request.remote, exc_info=exc)
            text = "internal server error; see the server log"
            if status == 504:
                text = "the request took too long"
            return json_error(status, text, "internal_error" if status == 500 else "timeout")
        # NOTE: a client's malformed request is not a server fault: no traceback in the log.
        detail = (message or (str(exc) if exc is not None else "") or "bad request").strip()
        logger.info("malformed request from %s: %s", request.remote, detail[:_MAX_ERROR_MESSAGE])
        return json_error(
            status, f"malformed HTTP request: {detail[:_MAX_ERROR_MESSAGE]}", "invalid_http_request"
        )


class GuardedServer(web.Server):
    """A ``web.Server`` that makes :class:`GuardedRequestHandler` connections and refuses
    those beyond ``limits.max_connections``."""

    def __init__(self, handler: Any, *, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self._limits = limits
        self._lingering: set[RequestHandler] = set()
        self.num_refused = 0

    def __call__(self) -> RequestHandler:
        return GuardedRequestHandler(self, loop=self._loop, limits=self._limits, **self._kwargs)

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        if len(self._connections) > self._limits.max_connections:
            self.num_refused += 1
            if self.num_refused == 1 or self.num_refused % 1000 == 0:
                logger.warning(
                    "%d connections are open, the limit is %d: refusing new ones with 503 "
                    "(%d so far)",
                    len(self._connections) - 1,
                    self._limits.max_connections,
                    self.num_refused,
                )
            assert isinstance(handler, GuardedRequestHandler)
            if len(self._lingering) < MAX_LINGERING:
                self._lingering.add(handler)
                handler.refuse(REFUSED_LINGER_S)
            else:
                handler.refuse(0.0)

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        self._lingering.discard(handler)
        super().connection_lost(handler, exc)


class ServingRunner(web.AppRunner):
    """``web.AppRunner`` whose server is a :class:`GuardedServer`.

    ``keepalive_timeout`` and the other handler settings are given as usual (keywords of
    ``web.AppRunner``); ``limits`` adds ours.
    """

    def __init__(self, app: web.Application, *, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(app, keepalive_timeout=limits.keepalive_timeout, **kwargs)
        self._limits = limits

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # starts the application, as aiohttp does
        return GuardedServer(
            plain.request_handler,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            limits=self._limits,
            **plain._kwargs,
        )


def ensure_open_file_limit(max_connections: int) -> None:
    """Raise the soft limit on open files to what ``max_connections`` needs, as far as the
    hard limit allows; warn when it stays short (connections past it fail to be accepted)."""
    needed = max_connections + RESERVED_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            logger.warning("cannot raise the open-file limit to %d: %s", target, exc)
    if soft != resource.RLIM_INFINITY and soft < needed:
        logger.warning(
            "the open-file limit (%d) is below --max-connections %d plus %d for the server's "
            "own files; lower --max-connections or raise 'ulimit -n'",
            soft,
            max_connections,
            RESERVED_FILES,
        )
