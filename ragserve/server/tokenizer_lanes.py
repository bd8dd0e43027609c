"""Tokenizer calls off the event loop, on two threads: one for small inputs, one for large.

A large input (a long document, a text to summarize) takes seconds to encode; on its own
thread it never holds up the chats behind it. NOTE: measured on two shared cores with
SmolLM2's tokenizer: encoding 2.2 MB took 3.0 s, during which another Python thread ran
as usual (HF fast tokenizers release the GIL while encoding).

After a large call the thread hands freed heap back to the system (glibc ``malloc_trim``).
NOTE: measured the same way: encoding 1.2 MB of text three times left the process 190 MB
larger; ``malloc_trim(0)`` brought that down to 19 MB.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ragserve.server.heap_release import release_free_memory

T = TypeVar("T")

# Inputs of this many characters (or token ids) or more go to the large lane: about 0.1 s
# of encoding on two shared cores.
LARGE_INPUT = 64 * 1024


class TokenizerLanes:
    """Runs tokenizer calls on a small-input thread or a large-input thread."""

    def __init__(self, large_input: int = LARGE_INPUT) -> None:
        self.large_input = large_input
        self._small = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragserve-tokenizer")
        self._large = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="ragserve-tokenizer-large"
        )

    async def run(self, fn: Callable[..., T], *args: Any, size: int | None = None) -> T:
        """``fn(*args)`` on the lane that ``size`` (default: :func:`input_size` of the
        arguments) picks."""
        loop = asyncio.get_running_loop()
        if (input_size(args) if size is None else size) < self.large_input:
            return await loop.run_in_executor(self._small, fn, *args)
        return await loop.run_in_executor(self._large, functools.partial(_then_trim, fn, *args))

    def close(self) -> None:
        for executor in (self._small, self._large):
            executor.shutdown(wait=False, cancel_futures=True)


def input_size(args: tuple[Any, ...]) -> int:
    """Characters of text and token ids in ``args``, looked for two levels deep: strings,
    lists of strings, ids or messages (dicts of strings), and objects with a ``text``."""
    return sum(_size(arg, depth=2) for arg in args)


def _size(value: Any, depth: int) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, int):
        return 1
    if depth == 0:
        return 0
    if isinstance(value, dict):
        return sum(_size(item, depth - 1) for item in value.values())
    if isinstance(value, (list, tuple)):
        if value and isinstance(value[0], int):
            return len(value)
        return sum(_size(item, depth - 1) for item in value)
    text = getattr(value, "text", None)
    return len(text) if isinstance(text, str) else 0


def _then_trim(fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(*args)
    finally:
        release_free_memory()
