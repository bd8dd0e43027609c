"""Map the CPU KV pool's pages before the steps write them.

The CPU pool is zeroed memory that the OS maps page by page on first write
(``device_cache.py``), so a step that writes K/V into fresh blocks takes a page fault for
every 4 KB on its critical path: a 32 x (256 in, 64 out) batch of SmolLM2 writes 236 MB of
fresh pages, 57,600 faults and 0.15 s of the main thread's kernel time, with the other core
waiting at the next barrier. vLLM writes its whole pool at start-up instead (seconds, and
all of it resident from the start).

Here ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+) maps pages a block range at a time:
- before a step, the blocks it was given (one call instead of a fault a page: about half
  the kernel time, measured on 2 cores);
- while a core idles, ahead of the pool's high-water mark, by a thread in the idle
  scheduling class: the steps never wait for it, and what it maps costs them nothing.
The resident size still grows with use (at most ``ahead_bytes`` past the blocks handed out).
Mapping a page never changes its contents, so either may run next to the steps' writes.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import threading
import weakref

import torch

from kvstore.page_advice import libc_madvise

logger = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14+
CHUNK_BYTES = 1 << 20  # mapped per call by the idle thread: bounds how long it holds the mm lock
AHEAD_BYTES = 512 << 20  # mapped past the high-water mark at most


class PoolPrefaulter:
    """Maps the pages of ``pool``'s blocks (a tensor of blocks along dim 0) from block 0 up.

    Call :meth:`map_through` with the pool's high-water mark before a step runs, and
    :meth:`keep_ahead_of` while idle; :meth:`close` when the pool goes away. Where the
    platform or the kernel cannot populate pages, it logs that once and does nothing more:
    pages then fault in on first write, as without it.
    """

    def __init__(self, pool: torch.Tensor, *, ahead_bytes: int = AHEAD_BYTES) -> None:
        self._pool = weakref.ref(pool)
        self._start = pool.data_ptr()
        self._block_bytes = pool[0].numel() * pool.element_size() if len(pool) else 0
        self._num_blocks = len(pool)
        self._ahead_blocks = max(1, ahead_bytes // max(1, self._block_bytes))
        self._chunk_blocks = max(1, CHUNK_BYTES // max(1, self._block_bytes))
        self._wanted = 0  # blocks [0, wanted) should be mapped
        self._mapped = 0  # blocks [0, mapped) are
        self._closed = False
        self._cond = threading.Condition()
        self._madvise = libc_madvise()
        self._thread: threading.Thread | None = None
        if self._madvise is not None and self._block_bytes > 0:
            self._thread = threading.Thread(
                target=self._run, name="ragserve-kv-prefault", daemon=True
            )
            self._thread.start()

    @property
    def mapped_blocks(self) -> int:
        """Blocks from 0 whose pages are mapped (for tests and logs)."""
        return self._mapped

    def map_through(self, high_water: int) -> None:
        """Map blocks below ``high_water`` now, on the calling thread (before a step writes them)."""
        first = self._mapped
        if high_water <= first or self._madvise is None:
            return
        if self._populate(first, min(high_water, self._num_blocks)):
            self._advance(high_water)

    def keep_ahead_of(self, high_water: int) -> None:
        """Have the idle thread map ``ahead_bytes`` past ``high_water``."""
        wanted = min(self._num_blocks, high_water + self._ahead_blocks)
        if wanted <= self._wanted or self._thread is None:
            return
        with self._cond:
            self._wanted = max(self._wanted, wanted)
            self._cond.notify()

    def _advance(self, mapped: int) -> None:
        with self._cond:
            self._mapped = max(self._mapped, min(mapped, self._num_blocks))

    def close(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        _idle_priority()
        while True:
            with self._cond:
                # NOTE: the thread holds the pool weakly and ends once it is gone, so an
                # engine dropped without shutdown() leaves neither pool nor thread behind.
                while not self._closed and self._mapped >= self._wanted:
                    if not self._cond.wait(timeout=1.0) and self._pool() is None:
                        return
                if self._closed:
                    return
                first, end = self._mapped, min(self._wanted, self._mapped + self._chunk_blocks)
            if self._pool() is None or not self._populate(first, end):
                return
            self._advance(end)

    def _populate(self, first: int, end: int) -> bool:
        """Map blocks [first, end); False (and off from now on) where the kernel refuses."""
        madvise = self._madvise
        if madvise is None:
            return False
        begin = self._start + first * self._block_bytes
        begin -= begin % mmap.PAGESIZE  # the kernel takes whole pages from an aligned start
        stop = self._start + end * self._block_bytes
        if madvise(begin, stop - begin, _MADV_POPULATE_WRITE) == 0:
            return True
        if self._madvise is not None:
            self._madvise = None
            logger.info(
                "KV pool pages fault in on first write (madvise(MADV_POPULATE_WRITE) "
                "refused: errno %d)",
                ctypes.get_errno(),
            )
        return False


def _idle_priority() -> None:
    """Run the calling thread only when a core would otherwise idle (SCHED_IDLE), else at
    the lowest nice value; either way the steps' threads come first."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
