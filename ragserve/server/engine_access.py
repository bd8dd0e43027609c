"""Calls onto the engine thread that never hang the event loop when the engine has died."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from ragserve.engine.async_engine import AsyncEngine, EngineDeadError
from ragserve.engine.llm_engine import LLMEngine

T = TypeVar("T")


async def call_engine(
    engine: AsyncEngine, fn: Callable[[LLMEngine], T], timeout: float = 30.0
) -> T:
    """``await engine.call(fn)``, but EngineDeadError if the engine is gone or stops answering.

    NOTE: the engine thread runs commands between steps, so ``timeout`` must exceed the
    longest step (a full prefill chunk on a slow device).
    """
    if not engine.is_alive:
        raise EngineDeadError("the engine is not running")
    try:
        return await asyncio.wait_for(engine.call(fn), timeout)
    except asyncio.TimeoutError:  # NOTE: not the builtin on Python 3.10
        raise EngineDeadError(f"the engine did not answer within {timeout:.0f} s") from None
