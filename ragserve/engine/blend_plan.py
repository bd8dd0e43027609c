"""Where a blended prompt's KV comes from, token by token, as positions advance.

A prompt names documents at token spans: ``template + doc_1 + ... + doc_n + question``
(anything between or after documents is computed). The first document sits where its
segment was computed (right after the template), so it is computed, or served exactly by
prefix caching. Every later document ``d`` at position ``p_d`` is split in three runs:

1. its first ``ceil(r * len(d))`` tokens are *recomputed*: an ordinary prefill chunk, with
   full attention over everything before them;
2. the rest of what its segment stores is *installed*: the segment's KV copied into the
   sequence's own blocks, keys rotated from the segment's positions to ``p_d``'s;
3. its last tokens that fill no whole segment block are computed.

So the sequence's ``num_computed_tokens`` keeps growing: a compute run is scheduled
like any prefill chunk and stops at the next install; an install advances it at once.
NOTE: with ``r = 1`` nothing is installed and the request is an ordinary prefill.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.segments import Segment, make_segment


@dataclass
class Install:
    """Prompt tokens ``start..end-1`` come from ``segment``'s tokens ``source..``."""

    start: int
    end: int
    segment: Segment
    source: int  # the segment position of prompt token ``start``
    doc_start: int  # where the document begins in the prompt
    doc_end: int
    installed: bool = False

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class BlendPlan:
    """The installs of one sequence, in prompt order; see the module docstring."""

    planned: list[Install]  # as built; ``installs`` is what is left of them after admission
    installs: list[Install] = field(default_factory=list)

    @property
    def first_install(self) -> int:
        """The first prompt position that may hold blended KV (past the prompt: none)."""
        return self.installs[0].start if self.installs else 1 << 62

    def admitted(self, exact_prefix: int) -> None:
        """The sequence starts (again) with ``exact_prefix`` tokens served by prefix caching.

        NOTE: an install that the exact prefix reaches into is dropped, and the rest of its
        document computed, as prefix caching would: in cached order, blend and prefix
        caching are identical.
        """
        self.installs = []
        for planned in self.planned:
            planned.installed = False
            if planned.doc_start >= exact_prefix:  # NOTE: not only its install's start
                self.installs.append(
                    Install(
                        planned.start,
                        planned.end,
                        planned.segment,
                        planned.source,
                        planned.doc_start,
                        planned.doc_end,
                    )
                )

    def install_at(self, position: int) -> Install | None:
        """The install that starts at ``position`` and is not done yet."""
        for install in self.installs:
            if install.start == position and not install.installed:
                return install
        return None

    def compute_room(self, num_computed: int, num_tokens: int) -> int:
        """Tokens that may be computed from ``num_computed`` on before the next install."""
        for install in self.installs:
            if not install.installed and install.start >= num_computed:
                return install.start - num_computed
        return num_tokens - num_computed

    def shrink(self, install: Install, available: int) -> None:
        """Only ``available`` tokens of ``install`` can be installed (its segment is cut
        short, e.g. evicted for good): the rest is computed."""
        install.end = install.start + max(0, available)
        if install.end <= install.start:
            self.installs.remove(install)

    @property
    def blended_tokens(self) -> int:
        """Prompt tokens whose KV was installed from a segment at a new position."""
        return sum(install.length for install in self.installs if install.installed)

    @property
    def recomputed_tokens(self) -> int:
        """Tokens of blended documents that were computed instead (selected or left over)."""
        docs: dict[int, tuple[int, int]] = {}
        for install in self.installs:
            if install.installed:
                total = docs.get(install.doc_start, (install.doc_end - install.doc_start, 0))
                docs[install.doc_start] = (total[0], total[1] + install.length)
        return sum(length - installed for length, installed in docs.values())


def plan_blend(
    salt: bytes,
    token_ids: Sequence[int],
    documents: Sequence[tuple[int, int]],
    ratio: float,
    block_size: int,
) -> BlendPlan | None:
    """The plan for a prompt with ``documents`` (``(start, end)`` token spans, ascending,
    disjoint), recomputing the leading ``ratio`` of each document after the first; None
    when nothing would be installed.

    Segments are ``template + document`` with ``template = token_ids[:first start]``.
    """
    check_documents(documents, len(token_ids))
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"the blend recompute ratio must be in [0, 1], got {ratio}")
    if len(documents) < 2:
        return None
    template = token_ids[: documents[0][0]]
    planned = []
    for start, end in documents[1:]:
        segment = make_segment(salt, template, token_ids[start:end], block_size)
        recompute = math.ceil(ratio * (end - start))
        stored = segment.stored_document_tokens
        if recompute >= stored:
            continue
        planned.append(
            Install(
                start + recompute, start + stored, segment, len(template) + recompute, start, end
            )
        )
    return BlendPlan(planned) if planned else None


def check_documents(documents: Sequence[tuple[int, int]], num_tokens: int) -> None:
    """ValueError unless the spans are non-empty, ascending, disjoint and inside the prompt,
    with at least one token after the last one (the question is always computed)."""
    previous = 0
    for start, end in documents:
        if not previous <= start < end:
            raise ValueError(
                f"document spans must be non-empty, ascending and disjoint: {documents}"
            )
        previous = end
    if documents and previous >= num_tokens:
        raise ValueError("a prompt with documents needs at least one token after the last one")
