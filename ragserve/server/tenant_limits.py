"""Per-tenant limits: what one API key may hold or have in flight, and the 429 past them.

Each limit is a :class:`~ragserve.server.config.ServerConfig` field (so a flag); a message
over a limit names the limit, its flag and its value. Server-wide capacity (too much work
queued, the server draining) stays a 503: that is the server's state, not the tenant's.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ragserve.server.config import ServerConfig
from ragserve.server.errors import APIError, bad_request

RATE_LIMITED = "rate_limit_exceeded"
# Stored things (documents, kept jobs) free up only when the tenant deletes some or they
# finish: retrying at once cannot help.
QUOTA_RETRY_AFTER_S = 30
# Requests in flight finish in seconds.
IN_FLIGHT_RETRY_AFTER_S = 1


def over_limit(message: str, retry_after_s: int, param: str | None = None) -> APIError:
    """A 429 with ``Retry-After``; ``message`` names the limit and its value."""
    return APIError(
        429,
        message,
        param=param,
        code=RATE_LIMITED,
        headers={"Retry-After": str(retry_after_s)},
    )


@dataclass(frozen=True)
class DocumentLimits:
    """What one tenant's documents may take (the ``ServerConfig`` fields of these names)."""

    max_documents_per_tenant: int
    max_document_tokens_per_tenant: int
    tenant_pin_share: float
    max_document_metadata_bytes: int

    @classmethod
    def from_config(cls, config: ServerConfig) -> DocumentLimits:
        return cls(
            config.max_documents_per_tenant,
            config.max_document_tokens_per_tenant,
            config.tenant_pin_share,
            config.max_document_metadata_bytes,
        )


@dataclass(frozen=True)
class JobLimits:
    """Summarization jobs one tenant may have waiting, and keep (finished or not)."""

    max_queued_jobs_per_tenant: int
    max_kept_jobs_per_tenant: int

    @classmethod
    def from_config(cls, config: ServerConfig) -> JobLimits:
        return cls(config.max_queued_jobs_per_tenant, config.max_kept_jobs_per_tenant)


class RequestsInFlight:
    """Completion and chat requests in flight per tenant, each prompt counting one.

    Event-loop only. ``check`` and ``hold`` must run in the same turn of the event loop
    (no ``await`` between them), so two requests cannot both pass the last free place.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the requests-in-flight limit must be >= 1, got {limit}")
        self.limit = limit
        self._counts: Counter[str] = Counter()

    def count(self, tenant: str) -> int:
        return self._counts[tenant]

    def check(self, tenant: str, requests: int) -> None:
        """429 if ``requests`` more would take the tenant past the limit; 400 if they
        alone exceed it (no retry could pass)."""
        if requests > self.limit:
            raise bad_request(
                f"this request holds {requests} prompts; the limit is {self.limit} requests "
                "in flight per API key (--max-requests-per-tenant): send fewer at a time",
                "prompt",
                "too_many_prompts",
            )
        held = self._counts[tenant]
        if held + requests > self.limit:
            raise over_limit(
                f"this API key has {held} requests in flight and asked for {requests} more; "
                f"the limit is {self.limit} per API key (--max-requests-per-tenant); retry "
                "when some have finished",
                IN_FLIGHT_RETRY_AFTER_S,
            )

    @contextmanager
    def hold(self, tenant: str, requests: int) -> Iterator[None]:
        """Count ``requests`` as in flight for the block's duration."""
        self._counts[tenant] += requests
        try:
            yield
        finally:
            self._counts[tenant] -= requests
            if self._counts[tenant] <= 0:
                del self._counts[tenant]


# NOTE: JSON decodes deeper than it encodes (the encoder runs further down the stack, and a
# listing wraps metadata in two more levels): metadata near the decoder's limit would be
# stored, then fail every listing of its tenant.
MAX_METADATA_DEPTH = 32


def check_metadata(limits: DocumentLimits, metadata: dict[str, Any]) -> None:
    """400 for a document's metadata larger than the limit, or nested deeper than
    ``MAX_METADATA_DEPTH``.

    NOTE: a 400, not a 429: it is the request's own size, and retrying cannot help.
    """
    if _nested_deeper(metadata, MAX_METADATA_DEPTH):
        raise bad_request(
            f"the document's metadata nests objects or arrays more than {MAX_METADATA_DEPTH} "
            "levels deep",
            "metadata",
            "metadata_too_deep",
        )
    size = len(json.dumps(metadata, ensure_ascii=False, separators=(",", ":")).encode())
    limit = limits.max_document_metadata_bytes
    if size > limit:
        raise bad_request(
            f"the document's metadata takes {size} bytes as JSON; the limit is {limit} "
            "(--max-document-metadata-bytes)",
            "metadata",
            "metadata_too_large",
        )


def check_documents(
    limits: DocumentLimits, documents: int, tokens: int, new_tokens: int | None = None
) -> None:
    """429 when a tenant holding ``documents`` documents of ``tokens`` tokens in all cannot
    add one more (of ``new_tokens`` tokens; None: not counted yet)."""
    if documents + 1 > limits.max_documents_per_tenant:
        raise over_limit(
            f"this API key keeps {documents} documents; the limit is "
            f"{limits.max_documents_per_tenant} per API key (--max-documents-per-tenant); "
            "delete some to make room",
            QUOTA_RETRY_AFTER_S,
        )
    if new_tokens is not None and tokens + new_tokens > limits.max_document_tokens_per_tenant:
        raise over_limit(
            f"this API key's documents hold {tokens} tokens and this one {new_tokens}; the "
            f"limit is {limits.max_document_tokens_per_tenant} tokens per API key "
            "(--max-document-tokens-per-tenant); delete some to make room",
            QUOTA_RETRY_AFTER_S,
        )


def _nested_deeper(value: Any, limit: int) -> bool:
    """Whether ``value`` nests dicts and lists more than ``limit`` levels deep; walks
    without recursion, so no depth makes it fail."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        if depth > limit:
            return True
        stack += [(child, depth + 1) for child in children if isinstance(child, dict | list)]
    return False
