"""One connection pool to a Redis-protocol store (Redis, Valkey, their managed services),
behind a circuit breaker, with every failure counted.

``call(fn)`` runs ``fn(client)`` when the breaker allows it. Connection failures and
time-outs (the store is down, restarting, slow or unreachable) count as failures of the
breaker and raise ``StoreUnavailable``; so does a refused call while it is open. The
client retries nothing itself: the breaker decides when to try again, and redis-py
reconnects on the next call that goes out. Other errors of the store (a command it
refuses, e.g. out of memory under ``noeviction``) are counted and raised as they are:
the store is up, so they do not trip the breaker.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.retry import Retry

from kvstore.circuit_breaker import CircuitBreaker

logger = logging.getLogger(__name__)
T = TypeVar("T")

_DOWN = (redis.ConnectionError, redis.TimeoutError, OSError)


class StoreUnavailable(Exception):
    """The store could not be reached (or the breaker is open): treat it as a miss."""


def redact_url(url: str) -> str:
    """``url`` with its password (in the user part or a ``password=`` query argument,
    both of which redis-py reads) replaced by ``***``, for logs and metrics."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        # NOTE: the host part is kept as written (an IPv6 host keeps its brackets).
        _, _, host = netloc.rpartition("@")
        netloc = f"{parts.username or ''}:***@{host}"
    arguments = parse_qsl(parts.query, keep_blank_values=True)
    query = parts.query
    if any(name.lower() == "password" for name, _ in arguments):
        query = urlencode(
            [(n, "***" if n.lower() == "password" else v) for n, v in arguments], safe="*"
        )
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    # NOTE: not urlunsplit, which drops the "//" of an empty host (unix:///path).
    rebuilt = f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
    return rebuilt + (f"#{parts.fragment}" if parts.fragment else "")


def check_store_url(url: str) -> None:
    """ValueError unless ``url`` names a store redis-py can connect to (nothing is sent)."""
    parse_url(url)


class RemoteStore:
    """A client for the store at ``url`` (``redis://[:password@]host:port/db``,
    ``rediss://`` for TLS, ``unix://path``). Thread-safe: each call takes a pooled
    connection. Nothing is sent before the first call: an unreachable store never stops
    the constructor. ``on_down`` runs when the breaker opens (the store may come back
    empty); ``errors`` counts failed calls of every kind."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 0.5,
        retry_s: float = 5.0,
        failure_threshold: int = 3,
        on_down: Callable[[], None] | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"the remote store's time-out must be > 0 s, got {timeout_s}")
        self.url = redact_url(url)
        # NOTE: from_url raises ValueError for a URL it cannot use (scheme, port, db).
        self.client: redis.Redis = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
        )
        self.breaker = CircuitBreaker(failure_threshold=failure_threshold, retry_s=retry_s)
        self._on_down = on_down
        self._lock = threading.Lock()
        self._errors = 0
        self._down = False

    @property
    def errors(self) -> int:
        with self._lock:
            return self._errors

    def call(self, fn: Callable[[redis.Redis], T]) -> T:
        """``fn(client)``'s result; ``StoreUnavailable`` when the store cannot be reached
        or the breaker is open."""
        if not self.breaker.allow():
            raise StoreUnavailable(f"{self.url}: not retried yet (circuit open)")
        try:
            result = fn(self.client)
        except _DOWN as exc:
            self._failed(exc)
            raise StoreUnavailable(f"{self.url}: {exc}") from exc
        except redis.RedisError:
            with self._lock:
                self._errors += 1
            self.breaker.success()  # NOTE: it answered, so it is up
            raise
        except BaseException as exc:
            # NOTE: whatever else went wrong, a half-open breaker's probe must not stay
            # in flight forever, or the store would never be called again.
            self._failed(exc)
            raise
        self.breaker.success()
        with self._lock:
            recovered, self._down = self._down, False
        if recovered:
            logger.info("remote KV store %s is reachable again", self.url)
        return result

    def _failed(self, exc: BaseException) -> None:
        with self._lock:
            self._errors += 1
        if self.breaker.failure():
            with self._lock:
                self._down = True
            logger.warning(
                "remote KV store %s is unreachable (%s): its lookups miss and its writes are "
                "dropped; retrying every %g s",
                self.url, exc, self.breaker.retry_s,
            )  # fmt: skip
            if self._on_down is not None:
                self._on_down()

    def close(self) -> None:
        self.client.close()
        self.client.connection_pool.disconnect()
