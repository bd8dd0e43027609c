"""The registry's record of document orders, and the purge plan built from it."""

from __future__ import annotations

from typing import Any

from ragserve.server.document_orders import DocumentOrders
from ragserve.server.prompts import PromptBuilder
from ragserve.server.purge_plan import purge_plan


def test_orders_keep_tuples_of_two_or_more_preceding_documents() -> None:
    orders = DocumentOrders()
    orders.note("t", ["a", "b", "c", "d"])
    assert orders.preceding("t", "b") == []  # one preceding document: the pairs cover it
    assert orders.preceding("t", "c") == [("a", "b")]
    assert orders.preceding("t", "d") == [("a", "b", "c")]
    assert orders.preceding("other", "c") == []
    orders.note("t", ["a", "c", "a"])  # after itself: its own purge covers what follows it
    assert orders.preceding("t", "a") == []
    orders.forget("t", "c")
    assert orders.preceding("t", "c") == []


def test_orders_are_bounded_per_document_newest_kept() -> None:
    orders = DocumentOrders(max_orders=2)
    for first in ("x", "y", "z"):
        orders.note("t", [first, "m", "b"])
    orders.note("t", ["y", "m", "b"])  # used again: now the newest
    orders.note("t", ["w", "m", "b"])
    assert orders.preceding("t", "b") == [("y", "m"), ("w", "m")]


def test_plan_purges_every_order_and_keeps_the_live_prefixes(smollm_tokenizer: Any) -> None:
    prefix = PromptBuilder(smollm_tokenizer).document_prefix
    a, b, c = [1, 2, 3], [4, 5], [6, 7, 8]
    others = {"a": a, "c": c}
    plan = purge_plan(b, others, [("a", "c"), ("a", "gone")], prefix)
    assert plan.purge == [prefix(b), prefix(a + b), prefix(c + b), prefix(a + c + b)]
    assert plan.keep == [prefix(a), prefix(c), prefix(a + c)]
    head = len(prefix([]))
    assert all(seq[head:][-len(b) :] == b for seq in plan.purge)
    assert not any(set(b) & set(seq[head:]) for seq in plan.keep)
