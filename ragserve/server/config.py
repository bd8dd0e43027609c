"""Server settings: one frozen object, validated once when the server is built."""

from __future__ import annotations

from dataclasses import dataclass

from ragserve.config_flags import option
from ragserve.server.document_watch import INTERVAL_S as WATCH_INTERVAL_S


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
    metrics_key: str | None = option(
        None,
        help="the one key that opens /metrics (for a scraper: its counts are every "
        "tenant's); it opens nothing else. Without it, with --api-key set, any API key does",
    )
    registry_dir: str | None = option(
        None,
        help="folder of the document registry (default: the disk tier's; without either, "
        "documents last as long as the server); servers and cluster replicas on one machine "
        "that share it share their documents (with --kv-remote-url they share them through "
        "the store, on any machine, whatever their folders)",
    )
    # How a dead server's ingestion is taken over: ragserve.server.ingest_leases (the
    # store), ragserve.server.registry_ingestions (a shared registry directory).
    ingest_lease_seconds: float = option(
        10.0,
        help="how long an ingestion's lease in the shared registry (the store of "
        "--kv-remote-url, else the registry folder) lasts unless its server renews it "
        "(every 2 s); a server that learned a document whose uploading server died "
        "mid-ingestion runs the ingestion itself once the lease lapsed",
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
    document_ttl: float | None = option(
        None,
        help="seconds a document lives when its upload gives no ttl or expire_time "
        "(default: documents never expire)",
    )
    shutdown_timeout: float = option(
        10.0, help="seconds running requests get to finish on SIGTERM/SIGINT"
    )
    retry_after_seconds: int = option(1, help="Retry-After of a 503", cli=False)
    engine_stall_seconds: float = option(
        120.0,
        help="/health turns unhealthy when the engine has been inside one step this long "
        "while requests wait (a step is at most one prefill chunk: seconds, not minutes)",
    )
    # Connections (ragserve.server.connections). NOTE: aiohttp's keep-alive timer also runs
    # while a request's head is still arriving, so one setting bounds idle and slow heads.
    # A client holds a connection for at most that long without sending a request, so it
    # must open max_connections / keepalive_timeout (68 a second) to fill the cap.
    keepalive_timeout: float = option(
        15.0,
        help="seconds a connection may sit idle, or take to send a request's head, before it "
        "is closed",
    )
    body_timeout: float = option(
        60.0, help="seconds a request's body may take to arrive in full (408 past it)"
    )
    write_timeout: float = option(
        30.0,
        help="seconds a response may wait on a client that stopped reading; then the "
        "connection is cut and its requests are aborted",
    )
    max_connections: int = option(
        1024, help="open connections at most; a connection beyond it gets 503 and is closed"
    )
    # NOTE: asyncio's own high-water mark. The kernel's send buffer is capped to it too
    # (doubled by the kernel), so a stalled reader is noticed once about 3 x 64 KiB wait:
    # 40 streamed events with 20 top logprobs, a thousand without; one connection's
    # throughput is then bounded by 128 KiB per round trip (1.3 MB/s at 100 ms).
    write_buffer_bytes: int = option(
        64 * 2**10,
        help="output buffered per connection before its writer waits for the client to read",
    )
    # Text size checked before tokenizing (ragserve.server.text_limits). NOTE: 4 MiB is 8 times
    # a full 128k-token context of English text (4 bytes a token); SmolLM2's tokenizer takes
    # about 6 s for it on two shared cores, on the large-input thread.
    max_text_bytes: int = option(
        4 * 2**20,
        help="largest text of one prompt (a chat's messages together, one completion prompt, "
        "a document, each text to summarize), in UTF-8 bytes; text that cannot fit the model's context is refused "
        "before tokenizing anyway",
    )

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
        if not self.engine_stall_seconds > 0:
            raise ValueError(f"engine_stall_seconds must be > 0, got {self.engine_stall_seconds}")
        if not self.ingest_lease_seconds > WATCH_INTERVAL_S:  # NOTE: also refuses NaN
            raise ValueError(
                f"ingest_lease_seconds must be longer than a watch round ({WATCH_INTERVAL_S} s) "
                f"or live ingestions are taken over, got {self.ingest_lease_seconds}"
            )
        if self.document_ttl is not None and not self.document_ttl > 0:
            raise ValueError(f"document_ttl must be > 0 seconds, got {self.document_ttl}")
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
        if self.metrics_key is not None and (
            not self.metrics_key or any(c.isspace() for c in self.metrics_key)
        ):
            raise ValueError("the metrics key must be non-empty and contain no whitespace")
        if self.metrics_key is not None and self.metrics_key in self.api_keys:
            raise ValueError("the metrics key must differ from every API key")
        if len(set(self.api_keys)) != len(self.api_keys):
            raise ValueError("the same API key was given twice")
        for name in ("keepalive_timeout", "body_timeout", "write_timeout"):
            value = getattr(self, name)
            if not value > 0:  # NOTE: also refuses NaN
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.write_buffer_bytes < 1024:
            raise ValueError(f"write_buffer_bytes must be >= 1024, got {self.write_buffer_bytes}")
        if self.max_text_bytes < 1:
            raise ValueError(f"max_text_bytes must be >= 1, got {self.max_text_bytes}")
