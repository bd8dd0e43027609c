"""Installing segments' KV into blended sequences' own blocks, before each step.

For an install (see :mod:`ragserve.engine.blend_plan`) the segment's blocks are held on the
device (shared, or loaded from a tier), their K/V rows gathered, the keys rotated from the
segment's positions to the prompt's, and the rows written into the sequence's slots. All of
it is indexing and element-wise work on the device: no document leaves it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal

import torch

from kernels.rerotate import rerotate_copy
from kvstore.kv_cache_manager import KVCacheManager
from kvstore.segments import Segment, hold_segment, release_segment
from ragserve.engine.blend_plan import Install
from ragserve.engine.sequence import Sequence

# Where the request computing a segment is: running, queued, or none (None).
SegmentWork = Literal["running", "queued"] | None
# What an install did: moved the sequence on, or left it waiting (for a queued segment:
# the one wait that can last for good, see ``install_ready``).
Outcome = Literal["moved", "waits", "waits for a queued segment"]


class BlendInstaller:
    """``segment_work(segment)`` tells where the request computing a segment is. An install
    that misses its segment waits for that request instead of computing the document
    itself, unless nothing else could ever let that request run (see ``install_ready``)."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        inv_freq: torch.Tensor,
        kv_manager: KVCacheManager,
        segment_work: Callable[[Segment], SegmentWork],
    ) -> None:
        self.kv_cache = kv_cache  # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
        self.inv_freq = inv_freq.to(kv_cache.device)
        self.kv = kv_manager
        self.block_size = kv_cache.shape[3]
        self.segment_work = segment_work

    def install_ready(self, running: Iterable[Sequence]) -> None:
        """Install every segment run that a running sequence has reached.

        NOTE: when every running sequence waits for a segment whose request is queued, that
        request waits for a slot or blocks they hold, and nothing would ever move: they
        compute their documents in place instead."""
        seqs = list(running)
        stalled: list[tuple[Sequence, Install]] = []
        for seq in seqs:
            plan = seq.blend
            while plan is not None:
                install = plan.install_at(seq.num_computed_tokens)
                if install is None:
                    break
                outcome = self._install(seq, install)
                if outcome == "waits for a queued segment":
                    stalled.append((seq, install))
                if outcome != "moved":
                    break
        if stalled and len(stalled) == len(seqs):
            for seq, install in stalled:
                assert seq.blend is not None
                seq.blend.shrink(install, 0)

    def _install(self, seq: Sequence, install: Install) -> Outcome:
        assert seq.blend is not None
        hold = hold_segment(self.kv, install.segment)
        try:
            available = hold.tokens - install.source
            if available < install.length:
                if hold.waiting:
                    return "waits"
                work = self.segment_work(install.segment)
                if work == "running":
                    return "waits"
                if work == "queued":
                    return "waits for a queued segment"
                seq.blend.shrink(install, available)  # NOTE: evicted for good: compute the rest
                if install not in seq.blend.installs:
                    return "moved"
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
                return "moved"
        finally:
            release_segment(self.kv, hold)
        # NOTE: the segment and its copy do not fit together. If the document fits without
        # the segment, compute it in place: waiting for room another sequence frees may
        # wait for good (none may be running).
        if not self.kv.allocate(seq.kv, install.end):
            return "waits"  # NOTE: other sequences hold the room: tried again next step
        seq.blend.shrink(install, 0)
        return "moved"

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
