"""Per-document locks: holders of one document take turns, other documents do not wait,
and a lock nobody uses is dropped."""

from __future__ import annotations

import asyncio

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
