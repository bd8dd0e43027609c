"""Blend plans: which prompt tokens come from segments, and how positions advance."""

from __future__ import annotations

import pytest

from ragserve.engine.blend_plan import check_documents, plan_blend

SALT = b"s" * 16
BLOCK = 4


def prompt() -> tuple[list[int], list[tuple[int, int]]]:
    """Template 6, documents of 10, 13 and 9 tokens, question 3."""
    tokens = list(range(6 + 10 + 13 + 9 + 3))
    return tokens, [(6, 16), (16, 29), (29, 38)]


def test_later_documents_install_their_segments_full_blocks_after_a_leading_run() -> None:
    tokens, docs = prompt()
    plan = plan_blend(SALT, tokens, docs, 0.25, BLOCK)
    assert plan is not None
    plan.admitted(0)
    # doc 2: segment = 6 + 13 = 19 tokens -> 16 stored = 10 document tokens; recompute 4.
    # doc 3: segment = 6 + 9 = 15 -> 12 stored = 6 document tokens; recompute 3.
    assert [(i.start, i.end, i.source) for i in plan.installs] == [(20, 26, 10), (32, 35, 9)]
    assert plan.compute_room(0, len(tokens)) == 20
    assert plan.install_at(20) is plan.installs[0]
    plan.installs[0].installed = True
    assert plan.compute_room(26, len(tokens)) == 6
    plan.installs[1].installed = True
    assert plan.compute_room(35, len(tokens)) == len(tokens) - 35
    assert plan.blended_tokens == 9
    assert plan.recomputed_tokens == (13 - 6) + (9 - 3)
    assert plan.first_install == 20


def test_nothing_to_blend_with_full_recompute_or_one_document() -> None:
    tokens, docs = prompt()
    assert plan_blend(SALT, tokens, docs, 1.0, BLOCK) is None
    assert plan_blend(SALT, tokens, docs[:1], 0.0, BLOCK) is None


def test_an_exact_prefix_reaching_into_an_install_drops_it_and_restarts_clean() -> None:
    tokens, docs = prompt()
    plan = plan_blend(SALT, tokens, docs, 0.0, BLOCK)
    assert plan is not None
    plan.admitted(0)
    plan.installs[0].installed = True
    plan.admitted(20)  # e.g. re-admitted after preemption with more cached
    assert [i.start for i in plan.installs] == [29]
    assert plan.blended_tokens == 0
    plan.admitted(16)
    assert [i.start for i in plan.installs] == [16, 29]


@pytest.mark.parametrize(
    "docs", [[(3, 3)], [(5, 9), (8, 12)], [(4, 9), (2, 3)], [(0, 41)], [(0, 42)]]
)
def test_bad_document_spans_are_refused(docs: list[tuple[int, int]]) -> None:
    with pytest.raises(ValueError):
        check_documents(docs, 41)


def test_blend_is_accepted_on_an_fp8_cache() -> None:
    """Re-rotation dequantizes, rotates and re-quantizes FP8 keys (``kernels/rerotate.py``)."""
    from ragserve.config import EngineConfig
    from ragserve.engine.blend_requests import BlendRequest

    EngineConfig(kv_reuse="blend", kv_cache_dtype="fp8")
    config = EngineConfig(kv_cache_dtype="fp8")
    docs = [(4, 36), (36, 68)]
    assert BlendRequest.make(config, b"salt", list(range(80)), docs, "blend", None) is not None
