"""A warning logged once per topic: a failing disk must not flood the log on every block."""

from __future__ import annotations

import logging
import threading


class WarnOnce:
    """Logs at WARNING the first time a topic comes up, at DEBUG after that. Thread-safe."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._lock = threading.Lock()
        self._seen: set[str] = set()

    def __call__(self, topic: str, message: str, *args: object) -> None:
        with self._lock:
            first = topic not in self._seen
            self._seen.add(topic)
        self._logger.log(logging.WARNING if first else logging.DEBUG, message, *args)
