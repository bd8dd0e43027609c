"""Per-document locks: holders of one document take turns, other documents do not wait,
and a lock nobody uses is dropped."""

from __future__ import annotations

import asyncio
import logging

import pytest

from ragserve.server.document_locks import DocumentLocks


def test_one_document_takes_turns_and_unused_locks_go() -> None:
    async def scenario() -> list[str]:
        locks = DocumentLocks()
        order: list[str] = []
        entered = asyncio.Event()

        async def slow(name: str) -> None:
            async with locks.hold("t", "a"):
                entered.set()
                order.append(f"{name} in")
                await asyncio.sleep(0.05)
                order.append(f"{name} out")

        async def fast(name: str, doc_id: str) -> None:
            await entered.wait()
            async with locks.hold("t", doc_id):
                order.append(f"{name} in")
                order.append(f"{name} out")

        await asyncio.gather(slow("delete"), fast("upload", "a"), fast("other", "b"))
        assert len(locks) == 0
        return order

    order = asyncio.run(scenario())
    assert order.index("upload in") > order.index("delete out")  # waited its turn
    assert order.index("other in") < order.index("delete out")  # another document did not


def test_run_finishes_its_work_when_the_caller_is_cancelled() -> None:
    """A DELETE whose client left still deletes, under the lock to its end."""

    async def scenario() -> list[str]:
        locks = DocumentLocks()
        order: list[str] = []
        started, finish = asyncio.Event(), asyncio.Event()

        async def delete() -> str:
            order.append("delete starts")
            started.set()
            await finish.wait()
            order.append("delete ends")
            return "deleted"

        caller = asyncio.ensure_future(locks.run("t", "a", delete))
        await started.wait()
        caller.cancel()  # NOTE: its client disconnected
        await asyncio.gather(caller, return_exceptions=True)
        assert caller.cancelled()
        order.append("caller gone")

        async def upload() -> None:
            async with locks.hold("t", "a"):
                order.append("upload in")

        waiting = asyncio.ensure_future(upload())
        await asyncio.sleep(0.01)
        finish.set()
        await locks.drain()
        await waiting
        assert len(locks) == 0
        return order

    order = asyncio.run(scenario())
    assert order == ["delete starts", "caller gone", "delete ends", "upload in"]


def test_run_hands_the_work_result_and_errors_to_a_caller_still_waiting() -> None:
    async def scenario() -> tuple[str, str]:
        locks = DocumentLocks()

        async def work() -> str:
            return "done"

        async def fail() -> str:
            raise LookupError("document b not found")

        result = await locks.run("t", "a", work)
        try:
            await locks.run("t", "b", fail)
        except LookupError as exc:
            return result, str(exc)
        return result, "no error"

    assert asyncio.run(scenario()) == ("done", "document b not found")


def test_a_change_that_fails_after_its_caller_left_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> None:
        locks = DocumentLocks()
        started, finish = asyncio.Event(), asyncio.Event()

        async def delete() -> None:
            started.set()
            await finish.wait()
            raise OSError("registry unreachable")

        caller = asyncio.ensure_future(locks.run("t", "a", delete))
        await started.wait()
        caller.cancel()
        await asyncio.gather(caller, return_exceptions=True)
        finish.set()
        await locks.drain()

    with caplog.at_level(logging.WARNING, logger="ragserve.server.document_locks"):
        asyncio.run(scenario())
    assert "registry unreachable" in caplog.text
