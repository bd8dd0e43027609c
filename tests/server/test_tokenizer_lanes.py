"""Tokenizer lanes: a large input runs on its own thread, so small ones never wait for it."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from ragserve.server.tokenizer_lanes import LARGE_INPUT, TokenizerLanes, input_size


@dataclass
class Document:
    text: str


def test_input_size_counts_text_and_ids() -> None:
    messages = [{"role": "user", "content": "x" * 100}, {"role": "assistant", "content": "y"}]
    assert input_size(("abc", [1, 2, 3])) == 6
    assert input_size((messages, [[1, 2], [3]])) == len("user") + 100 + len("assistant") + 1 + 3
    assert input_size((Document("z" * 10), object(), 7)) == 11


def test_a_large_call_does_not_hold_up_small_ones() -> None:
    lanes = TokenizerLanes()
    threads: dict[str, str] = {}

    def work(name: str, text: str, seconds: float) -> float:
        threads[name] = threading.current_thread().name
        time.sleep(seconds)
        return time.perf_counter()

    async def main() -> tuple[float, float]:
        large = asyncio.ensure_future(lanes.run(work, "large", "x" * LARGE_INPUT, 1.0))
        await asyncio.sleep(0.05)
        small = await lanes.run(work, "small", "short", 0.0)
        return await large, small

    try:
        large_done, small_done = asyncio.run(main())
    finally:
        lanes.close()
    assert small_done < large_done - 0.5
    assert threads["large"] != threads["small"]
    assert "large" in threads["large"]
