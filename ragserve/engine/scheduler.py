"""Step-level continuous batching with chunked prefill, fair across tenants, and
preemption by recompute.

Each step builds one batch under a token budget:

1. The budget is split among tenants by :func:`fair_shares`: water-filled from each
   tenant's recent service (:class:`TenantUsage`), so the tenant served least lately goes
   first and tenants at equal levels split max-min fairly. A tenant's demand is its
   running sequences' next tokens plus the waiting sequences the free slots could admit.
2. Within its share, each tenant's decodes go first, then its prefill chunks, oldest
   first; then waiting sequences are admitted tenant by tenant in turn
   (:class:`TenantQueue`) while slots, blocks and shares last.
3. Budget the shares left unused (a demand overestimated, e.g. by a cache hit) goes to
   running prefills, oldest first, then to more admissions in turn.

So one tenant's flood lengthens its own queue and stretches its own steps: another
tenant's sequence is admitted at its next turn, and a tenant that was quiet gets its
tokens computed ahead of the flood's (up to the flood's recent level), while tenants that
keep asking get equal shares in the long run. With a single tenant its share is the whole
budget: plain FIFO continuous batching, decodes first.

When blocks run out for a running sequence, one not yet scheduled in this step is
preempted: the newest one of the tenant whose running sequences hold the most blocks (the
sequence that needs the blocks goes itself only when no other is left), and nothing new
is admitted in that step. A waiting sequence that finds no free slot or not enough free
blocks may preempt, among the running sequences left out of this step, those of a tenant
that would still hold at least as many slots (blocks) as its own. A preempted sequence's blocks are released (full ones
stay cached) and it is recomputed later, usually from its own cached prefix.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvstore.kv_cache_manager import KVCacheManager
from ragserve.engine.fair_share import TenantQueue, TenantUsage, fair_shares
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

    def add(self, seq: Sequence, num_new: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new)

    def tokens_by_tenant(self) -> Counter[str]:
        tokens: Counter[str] = Counter()
        for seq, num_new in zip(self.seqs, self.num_new_tokens, strict=True):
            tokens[seq.tenant] += num_new
        return tokens

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(
        self, kv_manager: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int
    ) -> None:
        self.kv = kv_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting = TenantQueue()
        self.running: list[Sequence] = []  # oldest first
        self.usage = TenantUsage()
        self.num_preemptions = 0
        # The sequence whose blocks did not fit in the last schedule (one waiting, or one
        # running that had to give its own up), None if none: the one to fail when nothing
        # runs (see ``LLMEngine._reject_unschedulable``).
        self.short_of_blocks: Sequence | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        self.kv.begin_step()
        self.short_of_blocks = None
        batch = ScheduledBatch()
        budget, shares = self._schedule_running(batch)
        if not batch.num_preempted:  # else blocks are short: admit nothing new this step
            budget, blocked = self._admit(batch, budget, shares)
            if budget > 0 and not blocked:
                budget = self._fill(batch, budget)
                self._admit(batch, budget, None)
        self.usage.record(batch.tokens_by_tenant())
        return batch

    # -- running sequences ---------------------------------------------------------------------
    def _schedule_running(self, batch: ScheduledBatch) -> tuple[int, dict[str, int]]:
        """Decodes, then prefill chunks, each within its tenant's share of the step,
        preempting when blocks run out. Returns the budget and the shares left."""
        budget = self.max_num_batched_tokens
        rank = {seq: index for index, seq in enumerate(self.running)}
        pending = sorted(self.running, key=_is_prefill)  # stable: decodes first, oldest first
        demands = self._demands(pending, budget)
        shares = fair_shares(demands, budget, {t: self.usage.level(t) for t in demands})
        while pending and budget > 0:
            seq = pending.pop(0)
            limit = min(budget, shares.get(seq.tenant, 0))
            num_new = min(self._ready(seq), limit) if limit > 0 else 0
            if num_new == 0:
                continue  # stays running, unscheduled this step
            if not self._allocate(seq, num_new, pending, rank, batch):
                continue  # it was preempted itself
            batch.add(seq, num_new)
            budget -= num_new
            shares[seq.tenant] -= num_new
        self.running = [seq for seq in self.running if seq.status is SequenceStatus.RUNNING]
        return budget, shares

    def _allocate(
        self,
        seq: Sequence,
        num_new: int,
        pending: list[Sequence],
        rank: dict[Sequence, int],
        batch: ScheduledBatch,
    ) -> bool:
        """Blocks for ``seq``'s next ``num_new`` tokens, preempting until they fit; False if
        ``seq`` itself had to go."""
        while not self.kv.allocate(seq.kv, seq.num_computed_tokens + num_new):
            victim = self._victim(seq, pending, rank)
            self._preempt(victim)
            batch.num_preempted += 1
            if victim is seq:
                self.short_of_blocks = seq
                return False
            pending.remove(victim)
        return True

    def _victim(
        self, seq: Sequence, pending: list[Sequence], rank: dict[Sequence, int]
    ) -> Sequence:
        """Of the sequences not scheduled yet (``seq`` itself when there are none): the newest
        of the tenant whose running sequences hold the most blocks (with one tenant, simply
        the newest).

        NOTE: ``seq`` never makes way for a sequence scheduled after it, so the first one
        scheduled in a step always progresses: two sequences too large to run together
        cannot preempt each other in turn forever.
        """
        candidates = pending or [seq]
        held = self._blocks_held()
        heaviest = max({c.tenant for c in candidates}, key=lambda tenant: (held[tenant], tenant))
        return max((c for c in candidates if c.tenant == heaviest), key=rank.__getitem__)

    def _demands(self, running: list[Sequence], budget: int) -> dict[str, int]:
        """Tokens each tenant could use this step, at most ``budget``: its ``running``
        sequences' (one per decode) and the waiting sequences' that the free slots could
        admit in turn (each waiting tenant's first at least).

        NOTE: an estimate from the uncomputed tokens, before any cache lookup; what it
        overestimates is handed out again by ``_fill``.
        """
        demands: dict[str, int] = {}
        for seq in running:
            demands[seq.tenant] = min(
                budget, demands.get(seq.tenant, 0) + seq.num_uncomputed_tokens
            )
        queues = {tenant: iter(self.waiting.queue_of(tenant)) for tenant in self.waiting.tenants()}
        # NOTE: each waiting tenant's head counts even without a free slot: it may take one
        # from a tenant holding more (``_take_from_heavier``).
        slots = max(self.max_num_seqs - len(self.running), len(queues))
        while slots > 0 and queues:
            for tenant in list(queues):
                waiting = next(queues[tenant], None)
                if waiting is None or demands.get(tenant, 0) >= budget:
                    del queues[tenant]
                    continue
                demands[tenant] = min(
                    budget, demands.get(tenant, 0) + waiting.num_uncomputed_tokens
                )
                slots -= 1
                if slots == 0:
                    break
        return demands

    def _fill(self, batch: ScheduledBatch, budget: int) -> int:
        """Hand ``budget`` (what the shares left unused) to running prefills, oldest first:
        longer chunks for those in the batch, a chunk for those left out. No preemption:
        it stops when blocks run out. Returns the budget left."""
        index_of = {seq: index for index, seq in enumerate(batch.seqs)}
        for seq in self.running:
            if budget == 0:
                break
            index = index_of.get(seq)
            if index is None:
                extra = min(self._ready(seq), budget)
                if extra and not self.kv.allocate(seq.kv, seq.num_computed_tokens + extra):
                    break
                if extra:
                    batch.add(seq, extra)
            else:
                planned = batch.num_new_tokens[index]
                extra = min(_room(seq) - planned, budget)
                if extra <= 0:
                    continue
                if not self.kv.allocate(seq.kv, seq.num_computed_tokens + planned + extra):
                    break
                batch.num_new_tokens[index] += extra
            budget -= extra
        return budget

    # -- waiting sequences -----------------------------------------------------------------
    def _admit(
        self, batch: ScheduledBatch, budget: int, shares: dict[str, int] | None
    ) -> tuple[int, bool]:
        """Admit waiting sequences, tenant by tenant in turn, while slots, blocks and the
        tenants' ``shares`` last (None: the budget alone). Returns the budget left and
        whether blocks ran short."""
        spent: set[str] = set()  # tenants that can take no more this step
        while budget > 0:
            seq = self.waiting.peek(spent)
            if seq is None:
                break
            limit = budget if shares is None else min(budget, shares.get(seq.tenant, 0))
            if limit == 0 or (
                len(self.running) >= self.max_num_seqs
                and not self._take_from_heavier(seq, batch, 1)
            ):
                spent.add(seq.tenant)
                continue
            seq.num_computed_tokens = self.kv.match_prefix(seq.kv, seq.token_ids, 0)
            if seq.blend is not None:
                seq.blend.admitted(seq.num_computed_tokens)
                _limit_registration(seq, self.kv.block_size)
            num_new = min(self._ready(seq), limit)
            if num_new and not self._make_room(seq, seq.num_computed_tokens + num_new, batch):
                self.kv.free(seq.kv)
                seq.num_computed_tokens = 0
                self.short_of_blocks = seq
                return budget, True
            self.waiting.pop(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if num_new:  # else it joins a prefix another sequence is computing now
                batch.add(seq, num_new)
                budget -= num_new
                if shares is not None:
                    shares[seq.tenant] -= num_new
        return budget, False

    def _make_room(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Blocks for a waiting ``seq``'s first ``num_tokens``, taken from tenants holding
        more blocks if need be (:meth:`_take_from_heavier`); False if they do not fit."""
        needed = self.kv.blocks_needed(num_tokens) - len(seq.kv.block_table)
        while not self.kv.allocate(seq.kv, num_tokens):
            if not self._take_from_heavier(seq, batch, needed, blocks=True):
                return False
        return True

    def _take_from_heavier(
        self, seq: Sequence, batch: ScheduledBatch, needed: int, blocks: bool = False
    ) -> bool:
        """Preempt, for a waiting ``seq``, one running sequence left out of ``batch``: the
        newest of the tenant holding the most slots (``blocks``: blocks), provided that
        tenant would still hold at least as many as ``seq``'s tenant with ``needed`` more,
        so two tenants never take turns preempting each other. False if there is none."""

        def size(other: Sequence) -> int:
            return len(other.kv.block_table) if blocks else 1

        held: Counter[str] = Counter()
        for other in self.running:
            held[other.tenant] += size(other)
        scheduled = set(batch.seqs)
        candidates = [
            other
            for other in self.running
            if other not in scheduled
            and held[other.tenant] - size(other) >= held[seq.tenant] + needed
        ]
        if not candidates:
            return False
        heaviest = max(held[other.tenant] for other in candidates)
        victim = [other for other in candidates if held[other.tenant] == heaviest][-1]
        self.running.remove(victim)
        self._preempt(victim)
        batch.num_preempted += 1
        return True

    def _blocks_held(self) -> Counter[str]:
        """Blocks in the tables of each tenant's running sequences."""
        held: Counter[str] = Counter()
        for seq in self.running:
            if seq.status is SequenceStatus.RUNNING:
                held[seq.tenant] += len(seq.kv.block_table)
        return held

    def _ready(self, seq: Sequence) -> int:
        """How many tokens ``seq`` could compute now (0: it waits for a shared prefix that
        another sequence computes or a tier loads)."""
        if seq.num_uncomputed_tokens > 1 and (
            seq.blend is None or seq.num_computed_tokens < seq.blend.first_install
        ):
            # A prefill: first take blocks other sequences finished since the last step.
            seq.num_computed_tokens = self.kv.match_prefix(
                seq.kv, seq.token_ids, seq.num_computed_tokens
            )
            if self.kv.waits_for_other(seq.kv, seq.num_computed_tokens) or self.kv.has_more_to_load(
                seq.kv, seq.token_ids, seq.num_computed_tokens
            ):
                return 0
        return _room(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq.kv)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.push_front(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence's blocks and forget it."""
        seq.status = SequenceStatus.FINISHED
        self.kv.free(seq.kv)
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)


def _is_prefill(seq: Sequence) -> bool:
    return seq.num_uncomputed_tokens > 1


def _room(seq: Sequence) -> int:
    """Tokens ``seq`` may compute now: up to the next segment install of a blended prompt
    (see :mod:`ragserve.engine.blend_plan`), else all it has not computed."""
    if seq.blend is None:
        return seq.num_uncomputed_tokens
    return seq.blend.compute_room(seq.num_computed_tokens, seq.num_tokens)


def _limit_registration(seq: Sequence, block_size: int) -> None:
    """Blocks from the first that may hold blended KV on are never indexed as prefix KV.

    NOTE: blended KV is an approximation, and so is what is computed over it: indexing it
    under the prompt's prefix hashes would serve it later as an exact hit."""
    assert seq.blend is not None
    limit = seq.blend.first_install // block_size
    if seq.kv.register_limit is None or limit < seq.kv.register_limit:
        seq.kv.register_limit = limit
