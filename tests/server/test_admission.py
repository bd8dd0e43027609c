"""Admission by expected work: the accounting on a fake clock, then a real server where a
request that would wait too long gets a quick 503 and ordinary load gets 200s."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import pytest
import requests

from ragserve.server.admission import (
    LEAST_PROMPT_COST,
    MAX_RETRY_AFTER_S,
    Costs,
    WorkAdmission,
    fit_costs,
)
from tests.server.server_fixtures import ServerProcess, assert_error, module_server, wait_for

BUDGET_S = 3.0
server = module_server("--max-queue-seconds", str(BUDGET_S))
C = "/v1/completions"
KINDS = ("prompt", "answer")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_costs_are_fitted_over_busy_time_only() -> None:
    clock = Clock()
    admission = WorkAdmission(10.0, window_s=1.0, min_windows=2, clock=clock)
    assert admission.costs() is None and admission.check(10**6, 10**6) is None  # unmeasured
    ticket = admission.admit(100, 20)
    assert (admission.prompt_outstanding, admission.answer_outstanding) == (100, 20)
    # Window 1: 40 prompt tokens computed (60 were cached) and 10 generated in 1 s.
    clock.now += 1.0
    admission.progress(ticket, prompt=100, computed=40, generated=10)
    assert admission.outstanding == 10 and admission.costs() is None
    admission.release(ticket)  # it stopped early: the rest of its estimate is dropped
    assert admission.outstanding == 0
    clock.now += 1000.0  # idle: not busy time
    # Window 2: 0 prompt tokens and 20 generated in 2 s.
    other = admission.admit(0, 50)
    clock.now += 2.0
    admission.progress(other, generated=20)
    costs = admission.costs()
    # T = aP + bD gives a = 0 (1 = 40a + 10b, 2 = 20b): answer tokens alone explain the
    # time, and a prompt token costs the least a prompt token plausibly does.
    assert costs is not None
    assert costs.answer_s == pytest.approx(0.1)
    assert costs.prompt_s == pytest.approx(0.1 * LEAST_PROMPT_COST)
    assert admission.busy_s == pytest.approx(3.0)
    admission.release(other)
    assert admission.outstanding == 0


def test_prefill_and_decode_costs_are_told_apart() -> None:
    clock = Clock()
    admission = WorkAdmission(10.0, window_s=1.0, min_windows=3, clock=clock)
    ticket = admission.admit(10**6, 10**6)
    # The true costs: 1 ms per prompt token, 50 ms per answer token; three different mixes.
    for prompt, answer in ((800, 4), (300, 14), (0, 20)):
        clock.now += prompt * 0.001 + answer * 0.05
        admission.progress(ticket, prompt=prompt, computed=prompt, generated=answer)
    costs = admission.costs()
    assert costs is not None
    assert costs.prompt_s == pytest.approx(0.001) and costs.answer_s == pytest.approx(0.05)
    admission.release(ticket)


def test_a_kind_the_windows_cannot_measure_never_costs_zero_or_an_answers_price() -> None:
    # Lone decodes at 70 ms a token, with a few prompt tokens lost in their noise: the
    # unconstrained fit makes a prompt token cost less than nothing.
    decode_bound = [(1.4, 20, 20), (0.7, 60, 10), (2.1, 1, 30)]
    costs = fit_costs(decode_bound)
    assert costs is not None and costs.answer_s == pytest.approx(0.07, rel=0.01)
    assert costs.prompt_s == pytest.approx(costs.answer_s * LEAST_PROMPT_COST)
    # Prefill-bound windows whose few answer tokens measure nothing: an answer token costs
    # at least what a prompt token does.
    prefill_bound = [(1.0, 1000, 1), (2.0, 2000, 1), (0.5, 500, 1)]
    prompt = fit_costs(prefill_bound)
    assert prompt is not None and prompt.prompt_s == prompt.answer_s
    assert prompt.prompt_s == pytest.approx(0.001, rel=0.01)
    # The same mix every time: the time per token of either kind.
    assert fit_costs([(1.0, 10, 10), (2.0, 20, 20)]) == Costs(0.05, 0.05)


def test_a_long_answer_does_not_queue_in_front_of_a_short_request() -> None:
    """One sequence generating 1,200 tokens, its cost measured alone: a one-token request
    of the same tenant shares its steps, and is admitted; a second long one is not."""
    clock = Clock()
    admission = WorkAdmission(20.0, window_s=1.0, min_windows=1, clock=clock)
    long = admission.admit(0, 1200)
    clock.now += 1.0
    admission.progress(long, generated=33)  # 30 ms per token, alone
    costs = admission.costs()
    assert costs is not None and costs.answer_s == pytest.approx(1 / 33)
    assert admission.check(5, 1) is None
    assert admission.expected_seconds(5, 1) == pytest.approx(5 * costs.prompt_s + 2 / 33)
    assert admission.check(5, 1200) is not None  # 1,200 steps of a batch of two: 73 s
    admission.release(long)


def test_check_refuses_past_the_budget_with_retry_after() -> None:
    clock = Clock()
    admission = WorkAdmission(10.0, window_s=1.0, min_windows=1, clock=clock)
    first = admission.admit(0, 100)
    assert admission.sequences_answering == 1  # no prompt to compute: answering at once
    clock.now += 1.0
    admission.progress(first, generated=50)  # 20 ms per token, either kind
    assert admission.answer_outstanding == 50
    # Its own steps, each with one more sequence than answer now: 250 * 2 * 0.02 = 10 s.
    assert admission.check(0, 250) is None
    verdict = admission.check(100, 300)  # 100 * 0.02 + 300 * 2 * 0.02 = 14 s
    assert verdict is not None
    assert verdict.expected_s == pytest.approx(14.0) and verdict.retry_after_s == 4
    assert admission.expected_seconds(0, 100, sequences=3) == pytest.approx(100 * 4 * 0.02)
    huge = admission.check(10**9, 0)
    assert huge is not None and huge.retry_after_s == MAX_RETRY_AFTER_S
    admission.progress(first, generated=50)  # its answer is complete: no longer answering
    assert admission.sequences_answering == 0 and admission.outstanding == 0
    admission.release(first)
    admission.release(first)  # idempotent
    assert admission.check(10**9, 10**9) is None  # nothing queued: even a huge one starts
    assert WorkAdmission(0.0, clock=clock).check(10**9, 0) is None  # 0 turns the check off
    second = admission.admit(10, 10, sequences=2)
    assert admission.sequences_answering == 0  # still waiting for its prompt
    admission.progress(second, prompt=10, computed=4, generated=1)
    assert admission.sequences_answering == 2
    admission.release(second)  # ended early: its sequences stop counting too
    assert admission.sequences_answering == 0 and admission.outstanding == 0


# -- a real server -------------------------------------------------------------------------
def post(server: ServerProcess, body: dict[str, Any], timeout: float = 60) -> requests.Response:
    return requests.post(f"{server.url}{C}", json=body, timeout=timeout)


def long_stream(server: ServerProcess, max_tokens: int) -> requests.Response:
    body: dict[str, Any] = {
        "prompt": "Count: one, two,",
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    response = requests.post(f"{server.url}{C}", json=body, stream=True, timeout=60)
    assert response.status_code == 200
    return response


def idle(server: ServerProcess) -> bool:
    metrics = server.metrics()
    queued = sum(metrics[f'ragserve_admission_outstanding_tokens{{kind="{k}"}}'] for k in KINDS)
    return metrics["ragserve_num_requests_active"] == 0 and queued == 0


@pytest.mark.e2e
def test_a_request_that_would_wait_too_long_gets_503_quickly(server: ServerProcess) -> None:
    # Measure the costs: streams until they have filled the few 2 s windows of busy time
    # the estimate needs (a faster machine needs more tokens for them).
    deadline = time.monotonic() + 120
    per_token = 0.0
    while per_token == 0 and time.monotonic() < deadline:
        with long_stream(server, 200) as warm:
            for _ in warm.iter_lines():
                pass
        assert wait_for(lambda: idle(server), 30)
        per_token = server.metrics()['ragserve_admission_token_seconds{kind="answer"}']
    assert per_token > 0

    # A stream far beyond the budget is admitted on an idle server (nothing queued)...
    big = int(BUDGET_S * 4 / per_token) + 50
    stream = long_stream(server, big)
    try:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith(b"data: {"))
        # ...but a second one would wait for it: refused at once.
        started = time.monotonic()
        response = post(server, {"prompt": "x", "max_tokens": big})
        assert time.monotonic() - started < 2.0
        error = assert_error(response, 503, "overloaded")
        assert "budget" in error["message"]
        assert 1 <= int(response.headers["Retry-After"]) <= MAX_RETRY_AFTER_S
        long_summary: dict[str, Any] = {
            "text": "A text to summarize. " * 40,
            "max_summary_tokens": big,
        }
        answer = requests.post(
            f"{server.url}/v1/pipelines/summarize", json=long_summary, timeout=60
        )
        assert_error(answer, 503, "overloaded")
    finally:
        stream.close()
    assert wait_for(lambda: idle(server), 30), server.metrics()
    assert post(server, {"prompt": "x", "max_tokens": big}).status_code == 200


@pytest.mark.e2e
def test_ordinary_load_is_admitted(server: ServerProcess) -> None:
    assert wait_for(lambda: idle(server), 30)
    bodies = [{"prompt": f"Say {n}:", "max_tokens": 4} for n in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        statuses = [r.status_code for r in pool.map(lambda b: post(server, b), bodies)]
    assert statuses == [200] * 4
    for _ in range(3):  # one after another, as a single client would
        assert post(server, {"prompt": "Hello", "max_tokens": 4}).status_code == 200
    assert wait_for(lambda: idle(server), 30)
