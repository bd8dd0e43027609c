"""Copies whole cache blocks between the device cache and a host or device buffer.

A block of the block-major cache ``[num_blocks, ...]`` is one contiguous span holding
every layer, so moving ``n`` blocks between tiers is ``n`` span copies. Between devices
(device <-> host), consecutive block ids are merged into runs and each run is one
``copy_`` (one DMA transfer); within one device a single ``index_select`` /
``index_copy_`` kernel moves them all.

Copies are issued on the current stream (``torch.cuda.stream(...)`` picks another) and
are asynchronous when the host side is pinned memory: the caller records an event and
waits on it before reading ``out`` or reusing ``src``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(buffer_index, first_block, length)`` of each run of consecutive block ids."""
    runs: list[tuple[int, int, int]] = []
    for index, block in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            start, first, length = runs[-1]
            runs[-1] = (start, first, length + 1)
        else:
            runs.append((index, block, 1))
    return runs


def _check(cache: torch.Tensor, buffer: torch.Tensor, block_ids: Sequence[int], what: str) -> None:
    if not cache.is_contiguous():
        raise ValueError("the KV cache must be contiguous (block-major) for block copies")
    if buffer.dtype != cache.dtype or tuple(buffer.shape[1:]) != tuple(cache.shape[1:]):
        raise ValueError(
            f"{what} {tuple(buffer.shape)} {buffer.dtype} does not hold blocks of "
            f"{tuple(cache.shape[1:])} {cache.dtype}"
        )
    if buffer.shape[0] < len(block_ids):
        raise ValueError(f"{what} holds {buffer.shape[0]} blocks, {len(block_ids)} requested")
    bad = [b for b in block_ids if not 0 <= b < cache.shape[0]]
    if bad:
        raise ValueError(f"block ids {bad[:8]} out of range [0, {cache.shape[0]})")


def _device_index(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    index = torch.tensor(block_ids, dtype=torch.long)
    if device.type == "cuda":
        # NOTE: pinned + non_blocking, so building the index never waits for the stream.
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device)


def gather_blocks(
    cache: torch.Tensor, block_ids: Sequence[int], out: torch.Tensor, non_blocking: bool = True
) -> None:
    """``out[i] = cache[block_ids[i]]`` for every ``i`` (``out`` on any device)."""
    _check(cache, out, block_ids, "out")
    if not block_ids:
        return
    if out.device == cache.device:
        index = _device_index(block_ids, cache.device)
        torch.index_select(cache, 0, index, out=out[: len(block_ids)])
        return
    for start, first, length in block_runs(block_ids):
        out[start : start + length].copy_(cache[first : first + length], non_blocking=non_blocking)


def scatter_blocks(
    src: torch.Tensor, cache: torch.Tensor, block_ids: Sequence[int], non_blocking: bool = True
) -> None:
    """``cache[block_ids[i]] = src[i]`` for every ``i`` (``src`` on any device; ids distinct)."""
    _check(cache, src, block_ids, "src")
    if not block_ids:
        return
    if src.device == cache.device:
        index = _device_index(block_ids, cache.device)
        cache.index_copy_(0, index, src[: len(block_ids)])
        return
    for start, first, length in block_runs(block_ids):
        cache[first : first + length].copy_(src[start : start + length], non_blocking=non_blocking)
