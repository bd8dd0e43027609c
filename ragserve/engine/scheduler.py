"""Step-level continuous batching with chunked prefill and preemption by recompute.

Each step builds one batch under a token budget: running sequences first (decodes and
unfinished prefill chunks, oldest first), then new sequences while slots and blocks last.
When blocks run out, the newest running sequence is preempted: its blocks are released
(full ones stay cached) and it is recomputed later, usually from its own cached prefix.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvstore.kv_cache_manager import KVCacheManager
from ragserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """The sequences of one step and how many new tokens each computes."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(
        self, kv_manager: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int
    ) -> None:
        self.kv = kv_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        self.kv.begin_step()
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        scheduled_running: list[Sequence] = []
        queue = list(self.running)
        while queue and budget > 0:
            seq = queue.pop(0)
            num_new = self._plan(seq, budget)
            if num_new == 0:
                scheduled_running.append(seq)  # waits this step (another computes its prefix)
                continue
            while not self.kv.allocate(seq.kv, seq.num_computed_tokens + num_new):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                batch.num_preempted += 1
                if victim is seq:
                    break
            else:
                scheduled_running.append(seq)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
        # Sequences the budget did not reach stay running, unscheduled this step.
        scheduled_running += queue
        self.running = scheduled_running

        if batch.num_preempted:
            return batch  # blocks are short: admit nothing new this step
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            seq.num_computed_tokens = self.kv.match_prefix(seq.kv, seq.token_ids, 0)
            num_new = self._plan(seq, budget)
            if num_new and not self.kv.allocate(seq.kv, seq.num_computed_tokens + num_new):
                self.kv.free(seq.kv)
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if num_new:  # else it joins a prefix another sequence is computing now
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
        return batch

    def _plan(self, seq: Sequence, budget: int) -> int:
        """How many new tokens ``seq`` computes this step (0: it waits for a shared prefix)."""
        if seq.num_uncomputed_tokens > 1:
            # A prefill: first take blocks other sequences finished since the last step.
            seq.num_computed_tokens = self.kv.match_prefix(
                seq.kv, seq.token_ids, seq.num_computed_tokens
            )
            if self.kv.waits_for_other(seq.kv, seq.num_computed_tokens) or self.kv.has_more_to_load(
                seq.kv, seq.token_ids, seq.num_computed_tokens
            ):
                return 0
        return min(seq.num_uncomputed_tokens, budget)

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq.kv)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence's blocks and forget it."""
        seq.status = SequenceStatus.FINISHED
        self.kv.free(seq.kv)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
