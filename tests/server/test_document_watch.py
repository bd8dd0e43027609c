"""The registry watch calls its sync again and again, and a failed round does not end it."""

from __future__ import annotations

import asyncio

from ragserve.server.document_watch import RegistryWatch


def test_the_watch_goes_on_after_a_failed_round() -> None:
    async def scenario() -> int:
        rounds = 0

        async def sync() -> int:
            nonlocal rounds
            rounds += 1
            if rounds == 1:
                raise OSError("the registry is busy")
            return 0

        watch = RegistryWatch(sync, interval=0.01)
        watch.start()
        await asyncio.sleep(0.2)
        await watch.stop()
        return rounds

    assert asyncio.run(scenario()) >= 3
