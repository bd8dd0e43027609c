"""``within``: a time limit on an await that never loses the caller's cancellation."""

from __future__ import annotations

import asyncio

import pytest

from ragserve.timeouts import within


def test_the_result_arrives_within_the_limit() -> None:
    async def main() -> int:
        return await within(asyncio.sleep(0.01, result=7), 5.0)

    assert asyncio.run(main()) == 7


def test_past_the_limit_the_work_is_cancelled() -> None:
    async def main() -> asyncio.Task[None]:
        work = asyncio.ensure_future(asyncio.sleep(10))
        with pytest.raises(asyncio.TimeoutError):
            await within(work, 0.01)
        return work

    assert asyncio.run(main()).cancelled()


def test_errors_of_the_work_reach_the_caller() -> None:
    async def fail() -> None:
        raise ValueError("broken")

    async def main() -> None:
        await within(fail(), None)

    with pytest.raises(ValueError, match="broken"):
        asyncio.run(main())


def test_a_cancelled_caller_cancels_the_work() -> None:
    async def main() -> tuple[asyncio.Task[None], asyncio.Task[None]]:
        work = asyncio.ensure_future(asyncio.sleep(10))
        caller = asyncio.ensure_future(within(work, None))
        await asyncio.sleep(0)
        caller.cancel()
        await asyncio.gather(caller, return_exceptions=True)
        return caller, work

    caller, work = asyncio.run(main())
    assert caller.cancelled() and work.cancelled()


def test_a_cancel_in_the_turn_the_work_completes_still_cancels_the_caller() -> None:
    """The race ``asyncio.wait_for`` loses before Python 3.12: it returns the result and
    the caller runs on as if never cancelled."""

    async def main() -> asyncio.Task[int]:
        loop = asyncio.get_running_loop()
        work: asyncio.Future[int] = loop.create_future()
        caller = asyncio.ensure_future(within(work, 5.0))
        await asyncio.sleep(0)  # the caller now waits for the work
        work.set_result(3)
        caller.cancel()  # same turn: the caller has not seen the result yet
        await asyncio.gather(caller, return_exceptions=True)
        return caller

    assert asyncio.run(main()).cancelled()
