"""A DELETE's purge waits for the requests that read the document until their engine
requests are queued, or they end; never for longer."""

from __future__ import annotations

import asyncio

from ragserve.server.document_readers import DocumentReaders

DOC, OTHER = "a" * 32, "b" * 32


def test_settled_waits_for_queued_or_ended_readers() -> None:
    async def scenario() -> None:
        readers = DocumentReaders()
        tokenized, may_end = asyncio.Event(), asyncio.Event()

        async def request(num_prompts: int, queue: bool) -> None:
            readers.open("t", [DOC])
            await tokenized.wait()  # tokenizing its question
            reading = readers.current()
            assert reading is not None
            reading.expect(num_prompts)
            if queue:
                for _ in range(num_prompts):
                    reading.note_queued()
            await may_end.wait()

        queuing = asyncio.create_task(request(2, queue=True))
        failing = asyncio.create_task(request(1, queue=False))
        await asyncio.sleep(0)  # both have read the document
        settled = asyncio.create_task(readers.settled("t", DOC))
        await readers.settled("t", OTHER)  # nobody reads this one
        await asyncio.sleep(0)
        assert not settled.done()
        tokenized.set()
        await asyncio.sleep(0.01)
        assert not settled.done()  # one has queued both prompts, the other is still open
        may_end.set()
        await asyncio.wait_for(settled, 5)  # the other ended without queuing
        await asyncio.gather(queuing, failing)
        assert readers.current() is None
        await asyncio.wait_for(readers.settled("t", DOC), 0.5)  # nothing left to wait for

    asyncio.run(scenario())
