"""What a document's purge removes: its own prefix and the prompts it followed others in.

A prompt naming documents ``d1 ... dk`` starts ``head + d1 + ... + dk`` (see
:mod:`ragserve.server.prompts`), and ``document_prefix(d1 + ... + dk)`` is exactly that
start, so every joined prefix here is built from the documents' token lists.

For document B the plan purges, in one engine call:

* ``head + B``: B's own blocks and every prompt naming B first (what follows them);
* ``head + A + B`` for every other live document A of the tenant: prompts naming B second,
  across restarts too, since it needs no record;
* ``head + A... + B`` for each recorded tuple of two or more documents that preceded B
  (:mod:`ragserve.server.document_orders`) whose documents all still live. A tuple with a
  deleted document needs nothing: that document's own purge removed what followed it.

The same plan serves every model whose KV a DELETE purges (each model with this tokenizer,
one engine call each): token ids, and so the prefixes, are the same under each.

Cost: every other document's tokens are hashed twice (pair and keep) on the engine
thread, about 0.035 ms per 1k tokens: some 0.3 s for 1,000 documents of 4k tokens.

It keeps every other live document's prefix and the joined prefix of each tuple, so the
blocks of ``head + A`` (and ``head + A + C``) stay cached for A's questions; only the block
where A's tokens meet B's, and what follows it, go.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class PurgePlan:
    """``purge``: token sequences whose blocks (and descendants) go; ``keep``: sequences
    whose blocks stay (arguments of ``AsyncEngine.purge_prefixes``)."""

    purge: list[list[int]] = field(default_factory=list)
    keep: list[list[int]] = field(default_factory=list)


def purge_plan(
    own: list[int],
    others: dict[str, list[int]],
    preceding: Sequence[tuple[str, ...]],
    prefix: Callable[[list[int]], list[int]],
) -> PurgePlan:
    """``own``: the document's tokens (in its wrapper); ``others``: every other live
    document of the tenant, id to tokens; ``preceding``: its recorded tuples;
    ``prefix``: ``PromptBuilder.document_prefix``."""
    plan = PurgePlan(purge=[prefix(own)], keep=[prefix(tokens) for tokens in others.values()])
    plan.purge += [prefix(tokens + own) for tokens in others.values()]
    for ids in preceding:
        if not all(doc_id in others for doc_id in ids):
            continue
        before = [token for doc_id in ids for token in others[doc_id]]
        plan.purge.append(prefix(before + own))
        plan.keep.append(prefix(before))
    return plan
