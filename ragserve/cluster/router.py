"""Which replica serves a request: document affinity with a load-aware fallback, or round
robin (the baseline the cluster benchmark compares against).

A request's *key* names what it reads (see :mod:`ragserve.cluster.affinity_key`): its first
document, or the hash of its prompt's leading text. With ``affinity``, the first request of
a key goes to the least loaded replica (ties taken in turn) and the key is bound there;
later requests of that key go to the same replica (an *affinity hit*) unless it is down, or
busy (``busy_threshold`` requests in flight) while another replica has fewer: then they go to
the least loaded other replica (a *fallback*; the key stays bound, so it comes back once the
replica is free). A replica as busy as its peers keeps its keys: moving a request there
would only add the cost of loading the document's KV.
Requests without a key go to the least loaded replica.

Not thread-safe: the ingress calls it from its event loop only.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ragserve.cluster.settings import Policy

# NOTE: bounded, so a stream of one-off prompts cannot grow the ingress without limit;
# a forgotten key is bound again at its next request (least loaded first).
MAX_KEYS = 100_000

DECISIONS = ("affinity", "new", "fallback", "unkeyed", "round_robin")


@dataclass
class RouterStats:
    """Counts since start: decisions by kind and requests by replica."""

    decisions: Counter[str] = field(default_factory=Counter)
    by_replica: Counter[int] = field(default_factory=Counter)

    def as_json(self) -> dict[str, object]:
        hits, fallbacks = self.decisions["affinity"], self.decisions["fallback"]
        keyed = hits + fallbacks
        return {
            "decisions": {name: self.decisions[name] for name in DECISIONS},
            "by_replica": {str(i): n for i, n in sorted(self.by_replica.items())},
            "affinity_hit_rate": hits / keyed if keyed else None,
        }


class Router:
    """``choose`` a replica for a key given each replica's load (requests in flight)
    and which replicas are up; ``bind`` a key to the replica that computed it."""

    def __init__(self, num_replicas: int, policy: Policy, busy_threshold: int) -> None:
        self.num_replicas = num_replicas
        self.policy = policy
        self.busy_threshold = busy_threshold
        self.stats = RouterStats()
        self._owner: OrderedDict[str, int] = OrderedDict()
        self._turn = itertools.count()

    def choose(self, key: str | None, loads: Sequence[int], up: Sequence[bool]) -> int:
        """The replica for this request; counts the decision. With no replica up, the
        least loaded of all (the forwarding then fails cleanly)."""
        candidates = [i for i in range(self.num_replicas) if up[i]] or list(
            range(self.num_replicas)
        )
        if self.policy == "round_robin":
            index = candidates[next(self._turn) % len(candidates)]
            return self._count("round_robin", index)
        # NOTE: ties broken in turn, so documents uploaded one by one spread out.
        turn = next(self._turn)
        least = min(candidates, key=lambda i: (loads[i], (i - turn) % self.num_replicas))
        if key is None:
            return self._count("unkeyed", least)
        owner = self._owner.get(key)
        if owner is None:
            self.bind(key, least)
            return self._count("new", least)
        self._owner.move_to_end(key)
        others = [i for i in candidates if i != owner]
        other = min(others, key=lambda i: (loads[i], i)) if others else owner
        if up[owner] and (loads[owner] < self.busy_threshold or loads[other] >= loads[owner]):
            return self._count("affinity", owner)
        return self._count("fallback", other)

    def bind(self, key: str, replica: int) -> None:
        """Make ``replica`` the home of ``key`` (e.g. the one a document was uploaded to)."""
        self._owner[key] = replica
        self._owner.move_to_end(key)
        while len(self._owner) > MAX_KEYS:
            self._owner.popitem(last=False)

    def owner(self, key: str) -> int | None:
        return self._owner.get(key)

    def _count(self, decision: str, index: int) -> int:
        self.stats.decisions[decision] += 1
        self.stats.by_replica[index] += 1
        return index
