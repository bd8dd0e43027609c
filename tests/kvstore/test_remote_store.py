"""What the store client shows of its URL: never a password, wherever redis-py reads one."""

from __future__ import annotations

import pytest

from kvstore.remote_store import RemoteStore, redact_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://h:6379/0", "redis://h:6379/0"),
        ("redis://:s3cret@h:6379/0", "redis://:***@h:6379/0"),
        ("rediss://user:s3cret@h/0?socket_timeout=2", "rediss://user:***@h/0?socket_timeout=2"),
        ("redis://user:s3cret@[::1]:6379/0", "redis://user:***@[::1]:6379/0"),
        ("redis://h:6379/0?password=s3cret", "redis://h:6379/0?password=***"),
        (
            "unix:///run/valkey.sock?db=1&password=s3cret",
            "unix:///run/valkey.sock?db=1&password=***",
        ),
    ],
)
def test_the_password_is_hidden_wherever_the_url_holds_it(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_the_client_keeps_only_the_redacted_url() -> None:
    store = RemoteStore("redis://user:one@127.0.0.1:1/0?password=two")
    try:
        assert "one" not in store.url and "two" not in store.url
    finally:
        store.close()
