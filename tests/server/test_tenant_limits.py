"""Per-tenant limits, fair job slots and tenant-aware work admission, without a server.

Each limit's 429 against a real server: ``test_tenant_fairness.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from ragserve.server.admission import WorkAdmission
from ragserve.server.config import ServerConfig
from ragserve.server.errors import APIError
from ragserve.server.fair_slots import TenantSlots
from ragserve.server.tenant_limits import (
    MAX_METADATA_DEPTH,
    DocumentLimits,
    RequestsInFlight,
    check_documents,
    check_metadata,
)

LIMITS = DocumentLimits(
    max_documents_per_tenant=3,
    max_document_tokens_per_tenant=1000,
    tenant_pin_share=0.25,
    max_document_metadata_bytes=64,
)


def assert_429(exc: pytest.ExceptionInfo[APIError], *named: str) -> None:
    error = exc.value
    assert error.status == 429 and error.code == "rate_limit_exceeded"
    assert int(error.headers["Retry-After"]) >= 1
    for text in named:
        assert text in error.message, error.message


def test_requests_in_flight_are_limited_per_tenant() -> None:
    in_flight = RequestsInFlight(3)
    with in_flight.hold("a", 2):
        in_flight.check("a", 1)
        with pytest.raises(APIError) as exc:
            in_flight.check("a", 2)
        assert_429(exc, "2 requests in flight", "limit is 3", "--max-requests-per-tenant")
        in_flight.check("b", 3)  # another tenant's places are its own
        with in_flight.hold("a", 1), pytest.raises(APIError):
            in_flight.check("a", 1)
    assert in_flight.count("a") == 0
    in_flight.check("a", 3)
    with pytest.raises(APIError) as exc:  # more prompts than the limit: no retry can pass
        in_flight.check("a", 4)
    assert exc.value.status == 400 and exc.value.code == "too_many_prompts"
    with pytest.raises(ValueError, match=">= 1"):
        RequestsInFlight(0)


def test_document_count_and_token_limits() -> None:
    check_documents(LIMITS, 2, 900)
    check_documents(LIMITS, 2, 900, 100)
    with pytest.raises(APIError) as exc:
        check_documents(LIMITS, 3, 0)
    assert_429(exc, "keeps 3 documents", "limit is 3", "--max-documents-per-tenant")
    with pytest.raises(APIError) as exc:
        check_documents(LIMITS, 1, 900, 101)
    assert_429(exc, "hold 900 tokens", "this one 101", "1000", "--max-document-tokens-per-tenant")


def test_metadata_size_limit() -> None:
    check_metadata(LIMITS, {"title": "x" * 40})
    with pytest.raises(APIError) as exc:
        check_metadata(LIMITS, {"title": "é" * 40})  # 80 bytes of UTF-8
    error = exc.value
    assert error.status == 400 and error.param == "metadata" and error.code == "metadata_too_large"
    assert "limit is 64" in error.message and "--max-document-metadata-bytes" in error.message


def nested(levels: int) -> dict[str, Any]:
    """Metadata of ``levels`` levels: objects and lists in turn."""
    value: Any = {}
    for level in range(levels - 2):
        value = {"a": value} if level % 2 else [value]
    return {"a": value}


def test_metadata_depth_limit() -> None:
    roomy = dataclasses.replace(LIMITS, max_document_metadata_bytes=1 << 20)
    check_metadata(roomy, nested(MAX_METADATA_DEPTH))
    # NOTE: 5,000 levels is deeper than json.dumps can go: the check must not recurse.
    for levels in (MAX_METADATA_DEPTH + 1, 5000):
        with pytest.raises(APIError) as exc:
            check_metadata(roomy, nested(levels))
        assert exc.value.status == 400 and exc.value.code == "metadata_too_deep"


def test_server_config_validates_the_limits() -> None:
    ServerConfig(max_requests_per_tenant=1, tenant_pin_share=1.0)
    with pytest.raises(ValueError, match="max_documents_per_tenant"):
        ServerConfig(max_documents_per_tenant=0)
    for share in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="tenant_pin_share"):
            ServerConfig(tenant_pin_share=share)


def test_tenant_slots_go_to_tenants_in_turn() -> None:
    async def main() -> list[str]:
        slots = TenantSlots(1)
        order: list[str] = []

        async def job(tenant: str, name: str) -> None:
            async with slots.hold(tenant):
                order.append(name)
                await asyncio.sleep(0)

        await slots.acquire("a")
        names = [("a", "a1"), ("a", "a2"), ("a", "gone"), ("a", "a3"), ("b", "b1"), ("b", "b2")]
        tasks = [asyncio.create_task(job(tenant, name)) for tenant, name in names]
        await asyncio.sleep(0)
        assert slots.waiting("a") == 4 and slots.waiting("b") == 2
        tasks[2].cancel()  # a cancelled waiter leaves the queue
        await asyncio.sleep(0)
        assert slots.waiting("a") == 3
        slots.release()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert slots.free == 1 and slots.waiting("a") == slots.waiting("b") == 0
        # A slot handed to a waiter cancelled before it could run goes back.
        await slots.acquire("a")
        late = asyncio.create_task(slots.acquire("b"))
        await asyncio.sleep(0)
        slots.release()
        late.cancel()
        await asyncio.gather(late, return_exceptions=True)
        await asyncio.wait_for(slots.acquire("c"), 1.0)
        return order

    assert asyncio.run(main()) == ["a1", "b1", "a2", "b2", "a3"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def measured(max_queue_seconds: float) -> tuple[WorkAdmission, Clock]:
    """An admission whose costs are 10 ms per token of either kind."""
    clock = Clock()
    admission = WorkAdmission(max_queue_seconds, window_s=1.0, min_windows=1, clock=clock)
    ticket = admission.admit(100, 0)
    clock.now += 1.0
    admission.progress(ticket, prompt=100, computed=100)
    admission.release(ticket)
    costs = admission.costs()
    assert costs is not None and costs.prompt_s == pytest.approx(0.01)
    return admission, clock


def test_one_tenants_queued_work_does_not_refuse_another() -> None:
    """A queued 30 s of work: A's next request is refused, B's small one is admitted, and
    B's estimate counts only as much of A's work as B's own (served in turn)."""
    admission, _ = measured(20.0)
    flood = admission.admit(3000, 0, tenant="a")
    assert admission.check(100, 0, tenant="a") is not None  # 31 s of A's own
    assert admission.check(100, 0, tenant="b") is None
    assert admission.expected_seconds(100, 0, tenant="b") == pytest.approx(2.0)  # 1 s + 1 s of A's
    assert admission.tenant_outstanding("a") == (3000, 0) and admission.active_tenants == 1
    # B's own large request still counts A's work up to its own size.
    verdict = admission.check(1500, 0, tenant="b")
    assert verdict is not None and verdict.expected_s == pytest.approx(30.0)
    # With a single tenant the estimate is all the outstanding work, as before.
    assert admission.expected_seconds(100, 0, tenant="a") == pytest.approx(31.0)
    # A's answer shares steps with B's: it makes each dearer (a batch of two), it does not
    # queue in front of B's request, nor in front of A's own next one.
    answers = admission.admit(0, 5000, tenant="a")
    assert admission.expected_seconds(100, 50, tenant="b") == pytest.approx(2.0 + 50 * 2 * 0.01)
    assert admission.check(100, 50, tenant="b") is None
    assert admission.expected_seconds(0, 0, tenant="a") == pytest.approx(30.0)
    admission.release(flood)
    admission.release(answers)
    assert admission.active_tenants == 0 and admission.outstanding == 0
