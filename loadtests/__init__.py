"""Load tests for ``ragserve``: locust users, a headless runner and its report.

Every load test here targets a server on this machine only: :func:`require_loopback`
refuses any other address before a single request is sent.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

LOOPBACK_NAMES = ("localhost",)


def require_loopback(url: str) -> str:
    """``url`` without a trailing slash, if it names a loopback host; ValueError otherwise.

    Accepts ``localhost``, 127.0.0.0/8 and ``[::1]`` with an http(s) scheme. Host names
    other than ``localhost`` are refused rather than resolved: a name may point anywhere.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"the target must be an http(s) URL like http://127.0.0.1:8000, got {url!r}"
        )
    host = parts.hostname
    if host.lower() not in LOOPBACK_NAMES:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError(
                f"refusing to load-test {host!r}: only loopback targets (127.0.0.0/8, "
                "localhost, [::1]) are allowed"
            )
    return url.rstrip("/")
