"""Which documents came before a document in the prompts that named it.

A prompt naming documents A and B in that order is ``head + A + B + tail``; block hashes
are chained, so B's tokens there sit in blocks that follow A's chain, not B's own. Purging
B's own prefix does not reach them, so the registry keeps, per document, the tuples of
documents that preceded it, and a purge of B also purges ``head + A... + B`` for each.

Only tuples of two or more documents are kept: the purge covers a single preceding
document by pairing B with every other live document of its tenant, which also holds
across restarts (these records live in memory only). A document keeps its most recent
``MAX_ORDERS`` tuples: an older tuple forgotten, or one lost with a restart, leaves the
KV of that three-or-more-document prompt until eviction or until one of its earlier
documents is deleted (whose purge removes everything that follows it).
"""

from __future__ import annotations

from collections import OrderedDict

# NOTE: bounds memory per document; a client rotating through more orders than this
# loses coverage of the oldest ones only.
MAX_ORDERS = 64
Key = tuple[str, str]  # (tenant namespace, document id)


class DocumentOrders:
    """Per document, the tuples (two or more ids) that preceded it in a prompt, newest last."""

    def __init__(self, max_orders: int = MAX_ORDERS) -> None:
        self.max_orders = max_orders
        self._before: dict[Key, OrderedDict[tuple[str, ...], None]] = {}

    def note(self, namespace: str, doc_ids: list[str]) -> None:
        """A prompt names ``doc_ids`` in this order."""
        for index in range(2, len(doc_ids)):
            doc_id, preceding = doc_ids[index], tuple(doc_ids[:index])
            if doc_id in preceding:  # NOTE: its own purge already removes what follows it
                continue
            orders = self._before.setdefault((namespace, doc_id), OrderedDict())
            orders[preceding] = None
            orders.move_to_end(preceding)
            if len(orders) > self.max_orders:
                orders.popitem(last=False)

    def preceding(self, namespace: str, doc_id: str) -> list[tuple[str, ...]]:
        return list(self._before.get((namespace, doc_id), ()))

    def forget(self, namespace: str, doc_id: str) -> None:
        self._before.pop((namespace, doc_id), None)
