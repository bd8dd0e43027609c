"""When a document expires: ``ttl`` / ``expire_time`` at upload and in PATCH, the server's
default TTL, and how times are shown.

``ttl`` is seconds from now; ``expire_time`` is a Unix time in seconds or an RFC 3339
string (``2026-12-01T15:00:00Z``). Giving both is an error; giving neither at upload
applies the server's default TTL (None: the document never expires). A PATCH with
``expire_time: null`` makes a document permanent again.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any

from pydantic import Field

from ragserve.server.errors import bad_request
from ragserve.server.protocol import _Strict

# NOTE: far enough for any real cache lifetime, small enough for every date library.
MAX_TTL_S = 100 * 365 * 24 * 3600.0


class DocumentPatch(_Strict):
    """``PATCH /v1/documents/{id}``: each field given is changed, the others are kept."""

    ttl: float | int | None = None
    expire_time: float | int | str | None = None
    metadata: dict[str, Any] | None = Field(default=None)


def expire_time_from(
    ttl: float | None, expire_time: float | str | None, now: float, default_ttl: float | None = None
) -> float | None:
    """The Unix time a document expires at (None: never). Raises a 400 APIError for a
    negative, non-finite or too distant time, a time in the past, or both fields given."""
    if ttl is not None and expire_time is not None:
        raise bad_request("give ttl or expire_time, not both", "ttl", "invalid_expiry")
    if ttl is not None:
        if not (isinstance(ttl, int | float) and _finite(ttl) and 0 < ttl <= MAX_TTL_S):
            raise bad_request(
                f"ttl must be seconds in (0, {MAX_TTL_S:.0f}], got {str(ttl)[:40]}",
                "ttl",
                "invalid_expiry",
            )
        return now + float(ttl)
    if expire_time is not None:
        when = _parse_time(expire_time)
        if when <= now:
            raise bad_request("expire_time is in the past", "expire_time", "invalid_expiry")
        if when - now > MAX_TTL_S:
            raise bad_request(
                "expire_time is too far in the future", "expire_time", "invalid_expiry"
            )
        return when
    return now + default_ttl if default_ttl is not None else None


def rfc3339(when: float | None) -> str | None:
    """``2026-12-01T15:00:00.250Z`` for a Unix time; None stays None."""
    if when is None:
        return None
    text = datetime.fromtimestamp(when, timezone.utc).isoformat(timespec="milliseconds")
    return text.replace("+00:00", "Z")


def _parse_time(value: float | str) -> float:
    if isinstance(value, int | float):
        if not _finite(value):
            raise bad_request("expire_time must be finite", "expire_time", "invalid_expiry")
        return float(value)
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise bad_request(
            f"expire_time {value[:40]!r} is not an RFC 3339 time or Unix seconds",
            "expire_time",
            "invalid_expiry",
        ) from None
    if parsed.tzinfo is None:
        raise bad_request(
            "expire_time needs a time zone (e.g. a trailing Z)", "expire_time", "invalid_expiry"
        )
    return parsed.timestamp()


def _finite(value: float) -> bool:
    """``math.isfinite``, False for an integer too large for a float (JSON allows any)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False
