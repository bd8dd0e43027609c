"""A circuit breaker: after repeated failures, stop calling a remote service for a while.

States: *closed* (calls go through), *open* (calls are refused at once, for
``retry_s`` seconds after the failure that opened it), then *half-open*: one caller is
let through as a probe; its success closes the breaker, its failure opens it again for
another ``retry_s``. ``failure_threshold`` consecutive failures open a closed breaker.

Invariant: while open, ``allow`` costs no I/O and never blocks, so a dead store costs the
step loop nothing but a clock read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class CircuitBreaker:
    """Thread-safe. ``openings`` counts transitions into the open state."""

    def __init__(
        self,
        *,
        failure_threshold: int = 3,
        retry_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1 or retry_s < 0:
            raise ValueError(
                f"failure_threshold must be >= 1 and retry_s >= 0, got {failure_threshold}, "
                f"{retry_s}"
            )
        self.failure_threshold = failure_threshold
        self.retry_s = retry_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._open_until: float | None = None  # None: closed
        self._probing = False
        self.openings = 0

    @property
    def is_open(self) -> bool:
        """True while calls are refused (open, or half-open with a probe in flight)."""
        with self._lock:
            if self._open_until is None:
                return False
            return self._probing or self._clock() < self._open_until

    def allow(self) -> bool:
        """May a call go out now? In the half-open state only the first caller gets True
        (the probe) and must report ``success`` or ``failure``."""
        with self._lock:
            if self._open_until is None:
                return True
            if self._probing or self._clock() < self._open_until:
                return False
            self._probing = True
            return True

    def success(self) -> None:
        """The call went through: close (a probe's success ends the outage)."""
        with self._lock:
            self._failures = 0
            self._open_until = None
            self._probing = False

    def failure(self) -> bool:
        """The call failed; True if this failure opened the breaker."""
        with self._lock:
            self._failures += 1
            reopening = self._open_until is not None  # a failed probe
            if not reopening and self._failures < self.failure_threshold:
                return False
            self._open_until = self._clock() + self.retry_s
            self._probing = False
            if reopening:
                return False
            self.openings += 1
            return True
