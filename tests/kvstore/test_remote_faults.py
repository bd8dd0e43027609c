"""The remote tier when its store fails: down at start-up, killed (kill -9) and restarted,
frozen (time-outs); the circuit breaker. Everything is a miss or a dropped write, never an
exception or a stall of the caller beyond one time-out."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from kvstore.circuit_breaker import CircuitBreaker
from kvstore.remote_tier import RemoteTier
from tests.kvstore.tier_blocks import SHAPE, bit_equal, make_meta, random_block
from tests.valkey_server import ValkeyServer, free_port

ROUNDS = 100  # bounded retries while a store comes back (0.05 s apart)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_failures_then_probes_once() -> None:
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=2, retry_s=5.0, clock=clock)
    assert breaker.allow() and not breaker.failure()
    assert breaker.failure()  # the second one in a row opens it
    assert breaker.is_open and not breaker.allow() and breaker.openings == 1
    clock.now = 5.0
    assert breaker.allow()  # the probe
    assert not breaker.allow()  # and only one
    breaker.failure()  # a failed probe opens it again, no new outage counted
    assert breaker.is_open and breaker.openings == 1
    clock.now = 10.0
    assert breaker.allow()
    breaker.success()
    assert not breaker.is_open and breaker.allow() and breaker.allow()
    breaker.failure()
    breaker.success()  # a success in between resets the count
    assert not breaker.failure() and not breaker.is_open


def test_a_store_down_at_start_up_is_no_error() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    with RemoteTier(SHAPE, torch.float32, url, retry_s=60.0) as tier:
        assert tier.capacity_bytes == 0
        for index in range(3):
            assert not tier.contains(make_meta(index))
            assert not tier.load_into(make_meta(index), torch.empty(SHAPE))
        assert not tier.put(make_meta(0), random_block(torch.float32, 0))  # circuit open
        tier.flush()
        stats = tier.metrics()
    assert stats.errors == 3 and stats.breaker_openings == 1 and stats.breaker_open
    assert stats.misses == 3 and stats.hits == 0 and stats.dropped_demotions == 1


def wait_for_hit(tier: RemoteTier, index: int) -> torch.Tensor:
    """Write block ``index`` and read it back until the tier serves it again."""
    dest = torch.empty(SHAPE)
    for _ in range(ROUNDS):
        tier.put(make_meta(index), random_block(torch.float32, index))
        tier.flush()
        if tier.load_into(make_meta(index), dest):
            return dest
        time.sleep(0.05)
    pytest.fail("the remote tier never served a block again")


def test_kill_9_then_restart_on_the_same_port(valkey: ValkeyServer) -> None:
    with RemoteTier(SHAPE, torch.float32, valkey.url, retry_s=0.1) as tier:
        for index in range(4):
            assert tier.put(make_meta(index), random_block(torch.float32, index))
        tier.flush()
        valkey.kill()
        dest = torch.empty((4, *SHAPE))
        for _ in range(3):  # refused connections: misses, no exception
            assert tier.load_many_into([make_meta(i) for i in range(4)], dest) == [False] * 4
        tier.put(make_meta(9), random_block(torch.float32, 9))
        tier.flush()
        down = tier.metrics()
        assert down.errors >= 3 and down.breaker_openings == 1 and down.misses == 12
        valkey.start()  # same port, empty: nothing was persisted
        assert bit_equal(wait_for_hit(tier, 5), random_block(torch.float32, 5))
        # The restarted store lost the old values: misses, not errors.
        assert not tier.load_into(make_meta(0), torch.empty(SHAPE))
        up = tier.metrics()
        assert not up.breaker_open and up.breaker_openings == 1
        assert up.corrupt_records == up.foreign_records == 0


@contextmanager
def frozen(server: ValkeyServer) -> Iterator[None]:
    """SIGSTOP the store: connections stay open, nothing answers (a hung or slow store)."""
    assert server.process is not None
    server.process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        server.process.send_signal(signal.SIGCONT)


def test_time_outs_become_misses_and_writes_never_wait(valkey: ValkeyServer) -> None:
    with RemoteTier(
        SHAPE, torch.float32, valkey.url, timeout_s=0.2, retry_s=0.1, max_pending_writes=2
    ) as tier:
        for index in range(3):
            assert tier.put(make_meta(index), random_block(torch.float32, index), blocking=True)
        tier.flush()
        with frozen(valkey):
            dest = torch.empty(SHAPE)
            assert not tier.load_into(make_meta(0), dest)  # timed out: a miss
            taken = [tier.put(make_meta(10 + i), random_block(torch.float32, i)) for i in range(50)]
            assert not all(taken)  # the queue of 2 filled up behind a hung write: drops
            tier.flush()
            stats = tier.metrics()
            assert stats.errors >= 2 and stats.dropped_demotions >= 48 - 2
        for _ in range(ROUNDS):  # back: the breaker's probe goes through
            if tier.load_into(make_meta(1), dest):
                break
            time.sleep(0.05)
        assert bit_equal(dest, random_block(torch.float32, 1))
        assert not tier.metrics().breaker_open
