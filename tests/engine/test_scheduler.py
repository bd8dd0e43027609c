"""The scheduler on the CPU without a model: a fake step advances the sequences it schedules.

Fairness: waiting queues served tenant by tenant, the prefill budget split max-min fairly,
preemption from the tenant holding the most blocks. And with a single tenant, plain FIFO
continuous batching, decodes first.
"""

from __future__ import annotations

import itertools

import pytest

from kvstore.block_pool import BlockPool
from kvstore.hashing import make_salt
from kvstore.kv_cache_manager import KVAllocation, KVCacheManager
from ragserve.engine.fair_share import TenantQueue, TenantUsage, fair_shares
from ragserve.engine.scheduler import ScheduledBatch, Scheduler
from ragserve.engine.sequence import Sequence, SequenceStatus
from ragserve.sampling_params import SamplingParams

BLOCK = 4
_ids = itertools.count()


class Harness:
    """A scheduler over a small block pool, and a step that stands in for the model."""

    def __init__(
        self,
        num_blocks: int = 256,
        budget: int = 64,
        max_num_seqs: int = 8,
        prefix_caching: bool = False,
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.kv = KVCacheManager(self.pool, BLOCK, prefix_caching)
        self.scheduler = Scheduler(self.kv, budget, max_num_seqs)
        self.finished: list[Sequence] = []
        self.steps = 0

    def add(
        self, tenant: str, prompt_len: int, max_tokens: int = 4, first_token: int = 0
    ) -> Sequence:
        seq_id = next(_ids)
        prompt = (
            [first_token + i % 50 for i in range(prompt_len)]
            if first_token
            else [(seq_id * 131 + i) % 997 for i in range(prompt_len)]
        )
        seq = Sequence(
            seq_id=seq_id,
            request_id=f"{tenant}-{seq_id}",
            index=0,
            token_ids=prompt,
            num_prompt_tokens=prompt_len,
            params=SamplingParams(max_tokens=max_tokens),
            kv=KVAllocation(salt=make_salt("test-model", BLOCK, "float32", tenant)),
            detokenizer=None,
            tenant=tenant,
        )
        self.kv.update_hashes(seq.kv, seq.token_ids)
        self.scheduler.add(seq)
        return seq

    def step(self) -> ScheduledBatch:
        """Schedule, then do what the engine does with the batch: compute, sample, finish."""
        batch = self.scheduler.schedule()
        assert batch.total_tokens <= self.scheduler.max_num_batched_tokens
        assert len(self.scheduler.running) <= self.scheduler.max_num_seqs
        assert len(set(batch.seqs)) == len(batch.seqs), "a sequence appears once per step"
        self.steps += 1
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            assert seq.status is SequenceStatus.RUNNING and num_new > 0
            seq.num_computed_tokens += num_new
            self.kv.commit(seq.kv, seq.token_ids, seq.num_computed_tokens)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(7)
                self.kv.update_hashes(seq.kv, seq.token_ids)
                if seq.num_output_tokens >= (seq.params.max_tokens or 1):
                    self.scheduler.finish(seq)
                    self.finished.append(seq)
        return batch

    def run(self, max_steps: int = 10_000) -> None:
        while self.scheduler.running or self.scheduler.waiting:
            assert self.steps < max_steps, "the scheduler made no progress"
            self.step()
        self.pool.check_invariants()
        assert self.pool.num_used == 0


# -- the pieces ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("demands", "budget", "expected"),
    [
        ({"a": 1000}, 64, {"a": 64}),
        ({"a": 1000, "b": 1000}, 64, {"a": 32, "b": 32}),
        ({"a": 1000, "b": 10}, 64, {"a": 54, "b": 10}),  # b takes what it needs, a the rest
        ({"a": 5, "b": 7}, 64, {"a": 5, "b": 7}),  # room for everything
        ({"a": 100, "b": 100, "c": 100}, 64, {"a": 22, "b": 21, "c": 21}),  # remainder: first
        ({"a": 0, "b": 100}, 10, {"a": 0, "b": 10}),
        ({}, 10, {}),
    ],
)
def test_fair_shares(demands: dict[str, int], budget: int, expected: dict[str, int]) -> None:
    shares = fair_shares(demands, budget)
    assert shares == expected
    assert sum(shares.values()) == min(budget, sum(demands.values()))


@pytest.mark.parametrize(
    ("demands", "levels", "expected"),
    [
        ({"a": 1000, "b": 1000}, {"a": 128.0}, {"a": 0, "b": 64}),  # b is far below a
        ({"a": 1000, "b": 1000}, {"a": 20.0}, {"a": 22, "b": 42}),  # b catches up, then halves
        ({"a": 1000, "b": 48}, {"a": 200.0}, {"a": 16, "b": 48}),  # b's demand is met first
        ({"a": 1000, "b": 1000}, {"a": 7.5, "b": 7.5}, {"a": 32, "b": 32}),
    ],
)
def test_fair_shares_from_levels(
    demands: dict[str, int], levels: dict[str, float], expected: dict[str, int]
) -> None:
    assert fair_shares(demands, 64, levels) == expected


def test_tenant_usage_decays_and_forgets() -> None:
    usage = TenantUsage(decay=0.5)
    usage.record({"a": 64, "b": 0})
    assert usage.level("a") == 64 and usage.level("b") == 0
    usage.record({"a": 64})
    assert usage.level("a") == 96
    for _ in range(8):
        usage.record({})
    assert usage.level("a") == 0 and not usage._levels


def test_tenant_queue_serves_tenants_in_turn() -> None:
    h = Harness()
    queue = TenantQueue()
    a = [h.add("a", 4) for _ in range(3)]
    b = [h.add("b", 4) for _ in range(2)]
    for seq in a + b:
        queue.append(seq)
    served = []
    while queue:
        head = queue.peek()
        assert head is not None
        queue.pop(head)
        served.append(head)
    assert served == [a[0], b[0], a[1], b[1], a[2]]
    assert len(queue) == 0 and queue.peek() is None
    # A preempted sequence goes first in its tenant's queue; the tenant keeps its turn.
    queue.append(a[1])
    queue.append(b[1])
    queue.push_front(a[0])
    assert queue.tenants() == ["a", "b"] and list(queue) == [a[0], a[1], b[1]]
    assert queue.peek(skip={"a"}) is b[1]
    assert queue.remove(a[0]) and queue.remove(a[1]) and not queue.remove(a[1])
    assert queue.tenants() == ["b"] and len(queue) == 1


# -- fairness ------------------------------------------------------------------------------
def test_a_flood_does_not_delay_another_tenant() -> None:
    """A queues 50 sequences; B queues 2 a few steps later. B's are admitted in the first
    rounds after they arrive (one of A's, then one of B's, in turn), long before A's queue
    drains."""
    h = Harness(budget=64, max_num_seqs=8)
    flood = [h.add("a", 24, max_tokens=8) for _ in range(50)]
    for _ in range(3):
        h.step()
    b = [h.add("b", 24, max_tokens=8) for _ in range(2)]
    arrived = h.steps
    admitted: list[Sequence] = []  # in admission order, from B's arrival on
    while any(seq not in h.finished for seq in b):
        h.step()
        admitted += [seq for seq in h.scheduler.running if seq not in admitted]
    admitted = [seq for seq in admitted if seq.seq_id > flood[7].seq_id]  # not running before
    assert b[0] in admitted[:2] and b[1] in admitted[:4], [seq.tenant for seq in admitted]
    assert sum(seq.status is SequenceStatus.WAITING for seq in flood) >= 30
    assert h.steps - arrived <= 25, "B waited for slots to free, not for A's queue"
    h.run()
    assert len(h.finished) == 52


def test_without_other_tenants_the_queue_is_fifo() -> None:
    h = Harness(budget=64, max_num_seqs=4)
    seqs = [h.add("a", 24, max_tokens=3) for _ in range(12)]
    order: list[Sequence] = []
    while h.scheduler.running or h.scheduler.waiting:
        h.step()
        order += [seq for seq in h.scheduler.running if seq not in order]
    assert order == seqs
    h.pool.check_invariants()


def test_decodes_go_first_then_prefill_chunks() -> None:
    """B's sequence, admitted after A's long prefill, decodes before A's next chunk."""
    h = Harness(budget=32, max_num_seqs=8)
    long = h.add("a", 400, max_tokens=2)
    h.step()
    short = h.add("b", 8, max_tokens=4)
    batch = h.step()
    assert dict(zip(batch.seqs, batch.num_new_tokens, strict=True)) == {long: 24, short: 8}
    batch = h.step()
    assert batch.seqs == [short, long] and batch.num_new_tokens == [1, 31]
    h.run()


def test_the_prefill_budget_is_shared_among_tenants() -> None:
    """A's long prefill is running; B's short prompt is computed whole in the next step
    beside a smaller chunk of A's, not after A's prefill. Two tenants that keep asking
    get equal shares in the long run."""
    h = Harness(num_blocks=2048, budget=64, max_num_seqs=8)
    long = h.add("a", 2000, max_tokens=2)
    h.step()
    short = h.add("b", 20, max_tokens=2)
    batch = h.step()
    assert dict(zip(batch.seqs, batch.num_new_tokens, strict=True)) == {long: 44, short: 20}
    h.step()  # short's last decode
    other = h.add("b", 2000, max_tokens=2)
    served = {long: 0, other: 0}
    for _ in range(20):
        batch = h.step()
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            served[seq] += num_new
    assert served[long] + served[other] == 20 * 64
    assert abs(served[long] - served[other]) <= 64, served
    h.run()


def test_a_quiet_tenant_goes_ahead_of_a_busy_one() -> None:
    """B, served nothing lately, gets its whole 56-token prompt in one step, though an
    equal split of the step would give it 32."""
    h = Harness(budget=64, max_num_seqs=8)
    flood = [h.add("a", 500, max_tokens=2) for _ in range(3)]
    for _ in range(4):
        h.step()
    quiet = h.add("b", 56, max_tokens=2)
    batch = h.step()
    planned = dict(zip(batch.seqs, batch.num_new_tokens, strict=True))
    assert planned[quiet] == 56 and sum(planned[seq] for seq in flood if seq in planned) == 8
    h.run()


def test_a_budget_left_by_a_cache_hit_goes_to_others() -> None:
    """B's waiting prompt is mostly cached, so B uses less than its share: A's running
    prefill gets the rest of the step."""
    h = Harness(budget=64, max_num_seqs=8, prefix_caching=True)
    first = h.add("b", 40, max_tokens=1, first_token=500)
    h.run()
    assert first in h.finished
    long = h.add("a", 1000, max_tokens=1)
    h.step()
    again = h.add("b", 40, max_tokens=1, first_token=500)  # same prompt: 36 tokens cached
    batch = h.step()
    planned = dict(zip(batch.seqs, batch.num_new_tokens, strict=True))
    assert planned[again] == 4 and planned[long] == 60
    h.run()


def test_preemption_takes_from_the_tenant_holding_the_most() -> None:
    """Blocks run out while B decodes: A's newest running sequence goes, not B's."""
    h = Harness(num_blocks=24, budget=256, max_num_seqs=8)
    b = h.add("b", 8, max_tokens=40)
    a = [h.add("a", 24, max_tokens=40) for _ in range(3)]
    h.step()  # all admitted: B holds 2 blocks, A 18; each grows a block per 4 tokens
    assert not h.scheduler.waiting
    while not h.scheduler.waiting:
        h.step()
    assert b.status is SequenceStatus.RUNNING and b.num_preemptions == 0
    assert a[2].status is SequenceStatus.WAITING and a[2].num_preemptions == 1
    h.run()
    assert len(h.finished) == 4


def test_one_tenant_preempts_its_newest() -> None:
    h = Harness(num_blocks=12, budget=256, max_num_seqs=8)
    seqs = [h.add("a", 16, max_tokens=30) for _ in range(3)]
    h.step()  # the pool is full
    while not h.scheduler.waiting:
        h.step()
    assert [seq.num_preemptions for seq in seqs] == [0, 0, 1]
    h.run()
    assert len(h.finished) == 3


def test_aborting_waiting_and_running_sequences_frees_everything() -> None:
    h = Harness(budget=32, max_num_seqs=2)
    seqs = [h.add(tenant, 30, max_tokens=5) for tenant in "abab"]
    h.step()
    for seq in seqs:
        h.scheduler.finish(seq)
    assert not h.scheduler.running and not h.scheduler.waiting
    h.pool.check_invariants()
    assert h.pool.num_used == 0


def test_a_flooding_tenants_decodes_wait_for_its_share() -> None:
    """A's 40 decodes would fill the step; B's 24-token prompt goes first (B was quiet),
    and A decodes 8 of its sequences in that step."""
    h = Harness(budget=32, max_num_seqs=64)
    flood = [h.add("a", 4, max_tokens=50) for _ in range(40)]
    for _ in range(4):
        h.step()
    quiet = h.add("b", 24, max_tokens=2)
    batch = h.step()
    planned = dict(zip(batch.seqs, batch.num_new_tokens, strict=True))
    assert planned[quiet] == 24
    assert sum(seq in planned for seq in flood) == 8
    h.run()


def test_a_waiting_tenant_may_take_blocks_from_a_heavier_one() -> None:
    """A's sequences hold every block; B's first chunk gets blocks by preempting A's newest
    sequence left out of the step. A never preempts B back for its own admissions."""
    h = Harness(num_blocks=32, budget=200, max_num_seqs=16)
    flood = [h.add("a", 28, max_tokens=4) for _ in range(4)]
    h.step()
    h.step()
    assert h.pool.num_free == 0
    h.scheduler.max_num_batched_tokens = 8  # A's decodes and B's prompt cannot all run
    quiet = h.add("b", 16, max_tokens=2)
    batch = h.step()
    assert quiet.status is SequenceStatus.RUNNING and quiet in batch.seqs
    assert [seq.num_preemptions for seq in flood] == [0, 0, 0, 1]
    h.run()
    assert quiet.num_preemptions == 0 and len(h.finished) == 5


def test_a_waiting_tenant_may_take_a_slot_from_a_heavier_one() -> None:
    """A's sequences take every slot; B's is admitted at once in place of A's newest
    sequence left out of the step, and A never takes the slot back from B."""
    h = Harness(budget=16, max_num_seqs=4)
    flood = [h.add("a", 4, max_tokens=20) for _ in range(6)]
    for _ in range(3):
        h.step()
    assert len(h.scheduler.running) == 4
    h.scheduler.max_num_batched_tokens = 4  # A's decodes alone fill a step
    quiet = h.add("b", 4, max_tokens=3)
    batch = h.step()
    assert quiet in batch.seqs and len(h.scheduler.running) == 4
    assert sum(seq.num_preemptions for seq in flood) == 1
    h.run()
    assert quiet.num_preemptions == 0 and len(h.finished) == 7
