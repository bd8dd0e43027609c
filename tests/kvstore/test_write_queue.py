"""The write queue's wait for the writes queued so far: it ends when those are over, not
when the queue runs empty (under a steady stream of writes it never does), and keeps its
time limit. The test drains the queue itself, as a tier's writer thread would."""

from __future__ import annotations

import threading

import pytest
import torch

from kvstore.write_queue import WriteQueue
from tests.kvstore.tier_blocks import SHAPE, make_meta, random_block


class InstantQueue(WriteQueue[int]):
    """A queue whose tier holds nothing yet and refuses nothing."""

    def _holds(self, key: int) -> bool:
        return False

    def _refusing(self) -> bool:
        return False


def put(writes: InstantQueue, index: int) -> None:
    assert writes.put(index, make_meta(index), random_block(torch.float32, index), True)


def write_next(writes: InstantQueue) -> int:
    """Take the oldest queued write and finish it, as a writer thread does."""
    item = writes._queue.get_nowait()
    assert item is not None
    writes._finished([item.key])
    return item.key


def test_the_wait_ends_with_the_writes_queued_before_it() -> None:
    writes = InstantQueue(SHAPE, torch.float32, max_pending_writes=8)
    put(writes, 0)
    put(writes, 1)
    outcome: list[bool] = []
    waiter = threading.Thread(target=lambda: outcome.append(writes.wait_for_queued(10.0)))
    waiter.start()
    put(writes, 2)  # NOTE: queued after the wait began: not waited for
    assert write_next(writes) == 0
    waiter.join(0.2)
    assert waiter.is_alive()  # write 1 is still queued
    assert write_next(writes) == 1
    waiter.join(10.0)
    assert outcome == [True]
    assert writes._queue.qsize() == 1  # write 2 still queued when the wait ended


def test_the_wait_keeps_its_time_limit_and_an_empty_queue_has_nothing_to_wait_for() -> None:
    writes = InstantQueue(SHAPE, torch.float32, max_pending_writes=8)
    assert writes.wait_for_queued(0.0)
    put(writes, 5)
    assert not writes.wait_for_queued(0.05)
    write_next(writes)
    assert writes.wait_for_queued(0.0)


def test_a_put_whose_copy_fails_leaves_nothing_pending() -> None:
    writes = InstantQueue(SHAPE, torch.float32, max_pending_writes=8)
    unfit = torch.zeros(3, 5)  # NOTE: no block's shape: the copy raises, as a failing one does
    with pytest.raises(RuntimeError):
        writes.put(7, make_meta(7), unfit, True)
    assert writes.wait_for_queued(0.0)  # nothing left to wait for
    put(writes, 7)  # queued again, not skipped as pending
    assert write_next(writes) == 7
