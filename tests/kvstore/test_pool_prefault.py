"""The CPU pool's pages are mapped before the steps write them, and nothing else changes."""

from __future__ import annotations

import ctypes
import gc
import mmap
import sys
import threading
import time

import pytest
import torch

from kvstore.device_cache import KVCacheSpec
from kvstore.pool_prefault import PoolPrefaulter
from ragserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")

# 4 layers x K/V x 16 slots x 2 kv heads x 128 floats: 128 KiB a block, 32 pages
SPEC = KVCacheSpec(num_layers=4, num_kv_heads=2, row_width=128, block_size=16, dtype=torch.float32)


def fresh_pool(num_blocks: int) -> torch.Tensor:
    """A pool in memory fresh from the OS, as the engine's large pools are (a small
    allocation may reuse pages the process's heap already holds)."""
    memory = mmap.mmap(-1, num_blocks * SPEC.bytes_per_block)
    raw = torch.frombuffer(memory, dtype=torch.uint8)
    return raw.view(SPEC.dtype).view(num_blocks, *SPEC.block_shape)


def resident(pool: torch.Tensor, block: int) -> tuple[int, int]:
    """(mapped, all) of the whole pages inside ``block`` (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    block_bytes = pool[0].numel() * pool.element_size()
    start = pool.data_ptr() + block * block_bytes
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    pages = (start + block_bytes - first) // mmap.PAGESIZE
    flags = ctypes.create_string_buffer(pages)
    assert libc.mincore(first, pages * mmap.PAGESIZE, flags) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in flags.raw), pages


def mapped(pool: torch.Tensor, block: int) -> bool:
    done, pages = resident(pool, block)
    return done == pages


def untouched(pool: torch.Tensor, block: int) -> bool:
    return resident(pool, block)[0] == 0


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_blocks_are_mapped_through_the_high_water_mark_and_keep_their_contents() -> None:
    pool = fresh_pool(512)
    pool[2, 0, 0, 0, 0, :5] = torch.arange(5.0)  # a block the steps already wrote
    prefaulter = PoolPrefaulter(pool, ahead_bytes=0)
    try:
        assert untouched(pool, 3), "a fresh pool is mapped lazily"
        prefaulter.map_through(4)
        assert prefaulter.mapped_blocks == 4
        assert all(mapped(pool, block) for block in range(4))
        assert untouched(pool, 4) and untouched(pool, 5), "nothing past the mark"
        assert torch.equal(pool[2, 0, 0, 0, 0, :5], torch.arange(5.0))
        assert int(pool.count_nonzero()) == 4, "mapping writes nothing"
        prefaulter.map_through(2)  # below the mark: nothing to do
        assert prefaulter.mapped_blocks == 4
    finally:
        prefaulter.close()


def test_the_idle_thread_maps_ahead_of_the_mark_and_no_further() -> None:
    pool = fresh_pool(512)
    before = set(threading.enumerate())
    prefaulter = PoolPrefaulter(pool, ahead_bytes=8 * SPEC.bytes_per_block)
    (thread,) = set(threading.enumerate()) - before
    try:
        prefaulter.keep_ahead_of(4)
        assert wait_for(lambda: prefaulter.mapped_blocks == 12)
        assert all(mapped(pool, block) for block in range(12))
        assert untouched(pool, 12) and untouched(pool, 13)
        prefaulter.keep_ahead_of(508)  # capped by the pool's end
        assert wait_for(lambda: prefaulter.mapped_blocks == 512)
        assert all(mapped(pool, block) for block in range(512))
    finally:
        prefaulter.close()
    assert not thread.is_alive()


def test_a_pool_dropped_without_close_ends_its_thread() -> None:
    pool = fresh_pool(8)
    before = set(threading.enumerate())
    PoolPrefaulter(pool, ahead_bytes=0)
    (thread,) = set(threading.enumerate()) - before
    del pool
    gc.collect()
    assert wait_for(lambda: not thread.is_alive(), timeout=5.0)


def test_the_cpu_engine_maps_the_blocks_its_steps_use() -> None:
    llm = LLM(dtype="float32", kv_cache_gib=0.25)
    engine = llm.engine
    try:
        llm.generate(
            [{"prompt_token_ids": list(range(1000, 1040))}],
            SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
            use_tqdm=False,
        )
        high_water = engine.block_pool.high_water
        assert high_water >= 3  # 43 tokens' K/V in blocks of 16
        assert engine.prefaulter is not None
        assert engine.prefaulter.mapped_blocks >= high_water
        assert all(mapped(engine.kv_cache, block) for block in range(high_water))
    finally:
        engine.shutdown()
