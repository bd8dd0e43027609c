"""Which cached blocks a purge removes: those of one token sequence alone, and what hangs
off them.

A document's blocks form a hash chain. Purging it removes its blocks that no kept sequence
(another live document of the same tenant) also has, plus every block whose chain passes
through a removed one: a question's blocks after the document, or a longer prompt's. Such
descendants hold the document's last tokens (the block that completed its partial tail)
or KV computed from it, so they belong to it too.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass
class PurgeCounts:
    """Blocks removed per place: ``device`` prefix-cache entries, then one count per tier."""

    device: int = 0
    tiers: dict[str, int] = field(default_factory=dict)


def doomed_blocks(
    owned: Iterable[bytes], kept: Iterable[bytes], links: Iterable[tuple[bytes, bytes | None]]
) -> set[bytes]:
    """``owned`` minus ``kept``, closed under children (``links``: (hash, parent) pairs).

    Invariant: a kept block is never returned, since its ancestors are all kept too (a
    kept sequence is a chain from its first block)."""
    kept_set = set(kept)
    doomed = set(owned) - kept_set
    children: dict[bytes, list[bytes]] = defaultdict(list)
    for block_hash, parent in links:
        if parent is not None:
            children[parent].append(block_hash)
    frontier = list(doomed)
    while frontier:
        for child in children.get(frontier.pop(), ()):
            if child not in doomed and child not in kept_set:
                doomed.add(child)
                frontier.append(child)
    return doomed


def first_doomed(chain: Sequence[bytes], doomed: set[bytes]) -> int | None:
    """Index of the first block of ``chain`` in ``doomed``; every later block descends from
    it, so it is doomed too. None when the chain holds none."""
    return next((index for index, block_hash in enumerate(chain) if block_hash in doomed), None)
