"""Server settings: one frozen object, validated once when the server is built."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    """HTTP-side settings; the engine has its own :class:`ragserve.config.EngineConfig`.

    ``api_keys`` empty means no authentication (one anonymous tenant). Each key is its own
    tenant: its cached blocks and documents are invisible to every other key.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    served_model_name: str | None = None  # None: the engine's model name
    max_waiting_requests: int = 1024  # engine requests in flight before answering 503
    # 503 when a new request's expected time to finish exceeds this (0: no such check);
    # see ragserve.server.admission.
    max_queue_seconds: float = 20.0
    max_request_bytes: int = 32 * 2**20
    max_n: int = 16
    max_documents_per_request: int = 16
    completion_default_max_tokens: int = 16  # OpenAI's default for /v1/completions
    shutdown_timeout: float = 10.0  # seconds running requests get to finish on shutdown
    retry_after_seconds: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if not self.max_queue_seconds >= 0:  # NOTE: also refuses NaN
            raise ValueError(f"max_queue_seconds must be >= 0, got {self.max_queue_seconds}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.max_n < 1 or self.max_documents_per_request < 1:
            raise ValueError("max_n and max_documents_per_request must be >= 1")
        if self.completion_default_max_tokens < 1:
            raise ValueError(
                f"completion_default_max_tokens must be >= 1, got {self.completion_default_max_tokens}"
            )
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        for key in self.api_keys:
            if not key or any(c.isspace() for c in key):
                raise ValueError("API keys must be non-empty and contain no whitespace")
        if len(set(self.api_keys)) != len(self.api_keys):
            raise ValueError("the same API key was given twice")
