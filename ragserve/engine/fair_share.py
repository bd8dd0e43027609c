"""Sharing the scheduler's capacity among tenants: waiting queues served in turn, each
tenant's recent service, and a split of a step's prefill tokens that serves the tenant
served least lately first (max-min fair among equals).

A tenant is the namespace a request was added under (the server's API key). Neither piece
knows about blocks or the model: they order and divide, the scheduler allocates.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Mapping

from ragserve.engine.sequence import Sequence


class TenantQueue:
    """Waiting sequences: one FIFO queue per tenant, the tenants served round-robin.

    ``peek`` shows the head of the tenant whose turn it is; ``pop`` takes a sequence and
    passes the turn to the next tenant. So a tenant that queued 50 sequences and one that
    queued 2 later alternate, and the second waits for at most one of the first's per turn.

    Invariant: a tenant is in the rotation exactly when its queue is not empty.
    """

    def __init__(self) -> None:
        self._queues: dict[str, deque[Sequence]] = {}
        self._turns: deque[str] = deque()  # tenants with waiting sequences, next turn first

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    def __bool__(self) -> bool:
        return bool(self._turns)

    def __iter__(self) -> Iterator[Sequence]:
        """Every waiting sequence, tenant by tenant in turn order (not the serving order)."""
        for tenant in self._turns:
            yield from self._queues[tenant]

    def tenants(self) -> list[str]:
        """Tenants with waiting sequences, the one whose turn it is first."""
        return list(self._turns)

    def queue_of(self, tenant: str) -> deque[Sequence]:
        """The tenant's waiting sequences, oldest first (read-only by contract)."""
        return self._queues.get(tenant, deque())

    def append(self, seq: Sequence) -> None:
        """A new arrival: last in its tenant's queue; a tenant new to the rotation goes last."""
        self._queue(seq.tenant).append(seq)

    def push_front(self, seq: Sequence) -> None:
        """A preempted sequence: first in its tenant's queue, the tenant's turn unchanged
        (last, if it had no waiting sequence)."""
        self._queue(seq.tenant).appendleft(seq)

    def peek(self, skip: frozenset[str] | set[str] = frozenset()) -> Sequence | None:
        """The head of the first tenant in turn order not in ``skip``; None if there is none."""
        for tenant in self._turns:
            if tenant not in skip:
                return self._queues[tenant][0]
        return None

    def pop(self, seq: Sequence) -> None:
        """Take ``seq`` (the head of its tenant's queue) and pass the turn: its tenant goes last."""
        queue = self._queues[seq.tenant]
        assert queue[0] is seq, "only the head of a tenant's queue is served"
        queue.popleft()
        self._turns.remove(seq.tenant)
        if queue:
            self._turns.append(seq.tenant)
        else:
            del self._queues[seq.tenant]

    def remove(self, seq: Sequence) -> bool:
        """Drop ``seq`` wherever it waits (an abort); the turns are otherwise unchanged."""
        queue = self._queues.get(seq.tenant)
        if queue is None or seq not in queue:
            return False
        queue.remove(seq)
        if not queue:
            del self._queues[seq.tenant]
            self._turns.remove(seq.tenant)
        return True

    def _queue(self, tenant: str) -> deque[Sequence]:
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = deque()
            self._turns.append(tenant)
        return queue


class TenantUsage:
    """How much each tenant was served lately: tokens computed for it, the past halved at
    every step (``decay``). A tenant served nothing lately has level 0; one that took the
    whole budget ``B`` at every step settles at ``B / (1 - decay)``.

    Bounded: a tenant whose level decays below one token is forgotten.
    """

    def __init__(self, decay: float = 0.5) -> None:
        assert 0.0 <= decay < 1.0
        self.decay = decay
        self._levels: dict[str, float] = {}

    def level(self, tenant: str) -> float:
        return self._levels.get(tenant, 0.0)

    def record(self, served: Mapping[str, int]) -> None:
        """End of a step: decay every level, then add the tokens each tenant was served."""
        for tenant in list(self._levels):
            self._levels[tenant] *= self.decay
            if self._levels[tenant] < 1.0:
                del self._levels[tenant]
        for tenant, tokens in served.items():
            if tokens > 0:
                self._levels[tenant] = self._levels.get(tenant, 0.0) + tokens


def fair_shares(
    demands: Mapping[str, int], budget: int, levels: Mapping[str, float] | None = None
) -> dict[str, int]:
    """Split ``budget`` tokens over the tenants' ``demands`` by water-filling from their
    ``levels`` (recent service; absent: 0).

    Picture each tenant as a column filled to its level: tokens are poured where the
    column is lowest, and a column stops rising at its level plus its demand. So the
    tenant served least lately goes first, and tenants at equal levels split max-min
    fairly: one asking for less than an equal share gets all it asks, the others split
    the rest equally. Shares never exceed demands and sum to ``min(budget, sum(demands))``;
    the remainder of an uneven split goes one token at a time to the lowest columns,
    ties in ``demands``' order (the caller passes them in turn order).
    """
    assert budget >= 0 and all(demand >= 0 for demand in demands.values())
    if sum(demands.values()) <= budget:
        return dict(demands)
    levels = levels or {}
    wanting = [tenant for tenant, demand in demands.items() if demand > 0]
    start = {tenant: levels.get(tenant, 0.0) for tenant in wanting}
    end = {tenant: start[tenant] + demands[tenant] for tenant in wanting}
    # The water line: the level at which the columns below it hold exactly ``budget``.
    points = sorted({*start.values(), *end.values()})
    line, filled = points[-1], 0.0
    for low, high in itertools.pairwise(points):
        rising = sum(start[t] <= low < end[t] for t in wanting)
        if rising and filled + rising * (high - low) >= budget:
            line = low + (budget - filled) / rising
            break
        filled += rising * (high - low)
    shares = dict.fromkeys(demands, 0)
    for tenant in wanting:
        shares[tenant] = int(min(demands[tenant], max(0.0, line - start[tenant])))
    left = budget - sum(shares.values())
    order = {tenant: index for index, tenant in enumerate(demands)}
    while left > 0:
        open_ = [t for t in wanting if shares[t] < demands[t]]
        for tenant in sorted(open_, key=lambda t: (start[t] + shares[t], order[t]))[:left]:
            shares[tenant] += 1
            left -= 1
    return shares
