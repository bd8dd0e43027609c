"""Installing segments' KV into blended sequences' own blocks, before each step.

For an install (see :mod:`ragserve.engine.blend_plan`) the segment's blocks are held on the
device (shared, or loaded from a tier), their K/V rows gathered, the keys rotated from the
segment's positions to the prompt's, and the rows written into the sequence's slots. All of
it is indexing and element-wise work on the device: no document leaves it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from kernels.rerotate import rerotate_copy
from kvstore.kv_cache_manager import KVCacheManager
from kvstore.segments import Segment, hold_segment, release_segment
from ragserve.engine.blend_plan import Install
from ragserve.engine.sequence import Sequence

# Steps an install waits for a segment whose request is queued but not running before the
# document is computed in place: the slots or blocks that request waits for may be held by
# the very sequences that wait for it.
MAX_QUEUED_WAIT_STEPS = 8


class BlendInstaller:
    """``in_flight(segment)``: a sequence computing that segment is queued (False) or
    running (True), else None. An install that misses the segment waits for a running one,
    and for a queued one ``MAX_QUEUED_WAIT_STEPS`` steps, instead of computing the document
    itself."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        inv_freq: torch.Tensor,
        kv_manager: KVCacheManager,
        in_flight: Callable[[Segment], bool | None],
    ) -> None:
        self.kv_cache = kv_cache  # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
        self.inv_freq = inv_freq.to(kv_cache.device)
        self.kv = kv_manager
        self.block_size = kv_cache.shape[3]
        self.in_flight = in_flight

    def install_ready(self, seqs: Iterable[Sequence]) -> None:
        """Install every segment run that a sequence of ``seqs`` has reached."""
        for seq in seqs:
            plan = seq.blend
            while plan is not None:
                install = plan.install_at(seq.num_computed_tokens)
                if install is None or not self._install(seq, install):
                    break

    def _install(self, seq: Sequence, install: Install) -> bool:
        """True when the sequence moved on (installed, or left to compute what is missing)."""
        assert seq.blend is not None
        hold = hold_segment(self.kv, install.segment)
        try:
            available = hold.tokens - install.source
            if available < install.length:
                if hold.waiting or self._worth_waiting(install):
                    return False
                seq.blend.shrink(install, available)  # NOTE: evicted for good: compute the rest
                if install not in seq.blend.installs:
                    return True
            if self.kv.allocate(seq.kv, install.end):
                self._copy(
                    hold.slots(install.source, install.source + install.length),
                    install.start,
                    install.end,
                    seq.kv.block_table,
                    install.start - install.source,
                )
                seq.num_computed_tokens = install.end
                install.installed = True
                return True
        finally:
            release_segment(self.kv, hold)
        # NOTE: the segment and its copy do not fit together. If the document fits without
        # the segment, compute it in place: waiting for room another sequence frees may
        # wait for good (none may be running).
        if not self.kv.allocate(seq.kv, install.end):
            return False  # NOTE: other sequences hold the room: tried again next step
        seq.blend.shrink(install, 0)
        return True

    def _worth_waiting(self, install: Install) -> bool:
        running = self.in_flight(install.segment)
        if running is None:
            return False
        install.waited_steps += 1
        return running or install.waited_steps <= MAX_QUEUED_WAIT_STEPS

    def _copy(
        self, source_slots: list[int], start: int, end: int, table: list[int], shift: int
    ) -> None:
        device, size = self.kv_cache.device, self.block_size
        positions = torch.arange(start, end, dtype=torch.int64)
        blocks = torch.tensor(table, dtype=torch.int64)[positions // size]
        target = (blocks * size + positions % size).to(device, non_blocking=True)
        source = torch.tensor(source_slots, dtype=torch.int64).to(device, non_blocking=True)
        placed = positions.to(device, non_blocking=True)
        rerotate_copy(self.kv_cache, source, target, self.inv_freq, placed - shift, placed)
