"""Server settings: one frozen object, validated once when the server is built."""

from __future__ import annotations

from dataclasses import dataclass

from ragserve.config_flags import option


@dataclass(frozen=True)
class ServerConfig:
    """HTTP-side settings; the engine has its own :class:`ragserve.config.EngineConfig`.
    Fields are ``ragserve serve`` flags unless marked ``cli=False``.

    ``api_keys`` empty means no authentication (one anonymous tenant). Each key is its own
    tenant: its cached blocks and documents are invisible to every other key.
    """

    host: str = option("127.0.0.1", help="address to bind (default: loopback only)")
    port: int = option(8000, help="0 picks a free port (it is logged)")
    api_keys: tuple[str, ...] = option(
        (),
        help="require 'Authorization: Bearer KEY' on /v1; repeat for more tenants",
        flag="--api-key",
    )
    served_model_name: str | None = option(
        None, help="the model name clients use (default: the engine's)"
    )
    max_waiting_requests: int = option(
        1024, help="requests in flight before new ones get 503 with Retry-After"
    )
    # How the expected time is estimated: ragserve.server.admission.
    max_queue_seconds: float = option(
        20.0,
        help="503 with Retry-After when a new request's expected time to finish (queued "
        "tokens over the measured token rate) exceeds this; 0 turns it off",
    )
    # Per-tenant limits (ragserve.server.tenant_limits): each API key is a tenant; without
    # keys, every caller is the one anonymous tenant.
    max_requests_per_tenant: int = option(
        64,
        help="completion and chat requests one API key may have in flight (each prompt "
        "counts); more get 429 with Retry-After",
    )
    max_documents_per_tenant: int = option(
        256, help="documents one API key may keep; more uploads get 429 with Retry-After"
    )
    max_document_tokens_per_tenant: int = option(
        2_000_000,
        help="tokens of all the documents one API key keeps; uploads past it get 429 with "
        "Retry-After",
    )
    tenant_pin_share: float = option(
        0.25,
        help="share of the pin budget (half the device KV blocks) that one API key's "
        "documents may pin; documents past it stay cached, but evictable",
    )
    max_document_metadata_bytes: int = option(
        16 * 1024, help="largest metadata of one document (as JSON), in bytes; larger gets 400"
    )
    max_queued_jobs_per_tenant: int = option(
        16,
        help="summarization jobs one API key may have waiting to run; more get 429 with "
        "Retry-After",
    )
    max_kept_jobs_per_tenant: int = option(
        100,
        help="summarization jobs kept per API key, its oldest finished one dropped to make "
        "room; when all are unfinished, new jobs get 429 with Retry-After",
    )
    max_request_bytes: int = option(32 * 2**20, help="largest request body, in bytes")
    max_n: int = option(16, help="largest n (choices per request)", cli=False)
    max_documents_per_request: int = option(
        16, help="most documents one request may name", cli=False
    )
    completion_default_max_tokens: int = option(
        16, help="/v1/completions' max_tokens when not given (OpenAI's default)", cli=False
    )
    shutdown_timeout: float = option(
        10.0, help="seconds running requests get to finish on SIGTERM/SIGINT"
    )
    retry_after_seconds: int = option(1, help="Retry-After of a 503", cli=False)

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
        per_tenant = {
            "max_requests_per_tenant": self.max_requests_per_tenant,
            "max_documents_per_tenant": self.max_documents_per_tenant,
            "max_document_tokens_per_tenant": self.max_document_tokens_per_tenant,
            "max_document_metadata_bytes": self.max_document_metadata_bytes,
            "max_queued_jobs_per_tenant": self.max_queued_jobs_per_tenant,
            "max_kept_jobs_per_tenant": self.max_kept_jobs_per_tenant,
        }
        for name, value in per_tenant.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 < self.tenant_pin_share <= 1:  # NOTE: also refuses NaN
            raise ValueError(f"tenant_pin_share must be in (0, 1], got {self.tenant_pin_share}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        for key in self.api_keys:
            if not key or any(c.isspace() for c in key):
                raise ValueError("API keys must be non-empty and contain no whitespace")
        if len(set(self.api_keys)) != len(self.api_keys):
            raise ValueError("the same API key was given twice")
