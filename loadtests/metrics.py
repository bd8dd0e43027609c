"""Client-side metrics of the load test, reported through locust's ``events.request``.

Imported by the locustfile only (it imports locust, which patches the process for gevent).

Rows a run adds to locust's stats, besides one per HTTP request kind:

- ``TTFT <user>``: time to first token of a streamed completion, in ms.
- ``ITL <user>``: a request's mean inter-token latency, ``(t_last - t_first) / (n - 1)``
  over its ``n`` generated tokens (from ``usage``), in ms. Per request rather than per
  chunk: the server may put several tokens in one chunk.
- ``CACHED% <user>``: the percentage of the prompt served from the prefix cache
  (``usage.prompt_tokens_details.cached_tokens / usage.prompt_tokens``), stored in the
  response-time column (locust only has that one), cached tokens as the content size.
- ``READY ingest``: from a document upload to its ``ready`` status, in ms.
- ``JOB summarize``: from a summarization job's submission to its success, in ms; a job
  that failed or was cancelled is a failure in ``JOB summarize [failed]`` instead.

A 503 is the server's documented overload answer: it is reported as a success in a row
of its own, ``<name> [rejected]``, with its latency, never as a failure. Failures carry a
bracketed tag (``[timeout]``, ``[http 500]``, ``[stream]`` ...) that the summary groups by.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import requests
from locust import events
from locust.clients import ResponseContextManager
from locust.env import Environment
from locust.stats import StatsEntry

TTFT = "TTFT"
ITL = "ITL"
CACHED = "CACHED%"
READY = "READY"
JOB = "JOB"
CUSTOM_TYPES = (TTFT, ITL, CACHED, READY, JOB)
REJECTED_SUFFIX = " [rejected]"
ABSENT_SUFFIX = " [absent]"  # a route the server does not have (yet)
FAILED_JOB_SUFFIX = " [failed]"  # a job that ended failed or cancelled: no job time
SUMMARIZE_PATH = "/v1/pipelines/summarize"
MAX_RETRY_AFTER_S = 5.0
_TAG = re.compile(r"\[([a-z]+)[^\]]*\]")

Outcome = Literal["ok", "rejected", "failed"]


@dataclass
class StreamResult:
    """What one server-sent-event stream of chat chunks held. Times are seconds since start."""

    ttft_s: float | None = None
    last_token_s: float | None = None
    text: str = ""
    usage: dict[str, Any] | None = None
    error: str | None = None
    done: bool = False
    bytes_read: int = 0

    @property
    def completion_tokens(self) -> int:
        return int(self.usage.get("completion_tokens", 0)) if self.usage else 0

    def problem(self, want_usage: bool) -> str | None:
        """Why the stream is not a complete answer, or None."""
        if self.error is not None:
            return f"[stream] error event: {self.error}"
        if not self.done:
            return "[stream] ended without [DONE]"
        if want_usage and self.usage is None:
            return "[stream] no usage chunk"
        if self.ttft_s is None:
            return "[stream] no token"
        return None


def read_chat_stream(
    lines: Iterable[bytes], started: float, clock: Callable[[], float] = time.perf_counter
) -> StreamResult:
    """Read chat-completion SSE lines to the end, timing the first and last token chunks."""
    result = StreamResult()
    for raw in lines:
        result.bytes_read += len(raw) + 1
        if not raw.startswith(b"data:"):
            continue
        data = raw[5:].strip()
        if data == b"[DONE]":
            result.done = True
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            error = chunk["error"]
            result.error = (
                str(error.get("code") or error.get("type"))
                if isinstance(error, dict)
                else str(error)
            )
            continue
        if chunk.get("usage"):
            result.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            content = (choice.get("delta") or {}).get("content") or ""
            if content or choice.get("finish_reason") is None:
                now = clock() - started
                if result.ttft_s is None:
                    result.ttft_s = now
                result.last_token_s = now
            result.text += content
    return result


@dataclass
class TokenTotals:
    """Token counts over every complete stream of this process (from ``usage``); output
    tokens also count those of finished summarization jobs (their ``progress``)."""

    streams: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def add(self, usage: dict[str, Any]) -> None:
        self.streams += 1
        self.prompt_tokens += int(usage.get("prompt_tokens", 0))
        self.cached_tokens += int(
            (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        )
        self.completion_tokens += int(usage.get("completion_tokens", 0))

    def add_job(self, generated_tokens: int) -> None:
        self.completion_tokens += generated_tokens


TOTALS = TokenTotals()


def fire(request_type: str, name: str, value: float, length: int = 0) -> None:
    events.request.fire(
        request_type=request_type,
        name=name,
        response_time=value,
        response_length=length,
        exception=None,
        context={},
    )


def fire_timeout(name: str, seconds: float, what: str) -> None:
    """A failure row for a wait that gave up (no single HTTP request timed out)."""
    events.request.fire(
        request_type="GET",
        name=name,
        response_time=seconds * 1000,
        response_length=0,
        exception=TimeoutError(f"[timeout] {what} after {seconds:.0f} s"),
        context={},
    )


def record_job(label: str, job: dict[str, Any], seconds: float) -> None:
    """A ``JOB`` row for a job that succeeded (its tokens counted); a failure row otherwise."""
    status = job.get("status")
    if status == "succeeded":
        fire(JOB, label, seconds * 1000)
        progress = job.get("progress")
        generated = progress.get("generated_tokens") if isinstance(progress, dict) else None
        TOTALS.add_job(generated if isinstance(generated, int) else 0)
        return
    events.request.fire(
        request_type=JOB,
        name=label + FAILED_JOB_SUFFIX,
        response_time=seconds * 1000,
        response_length=0,
        exception=RuntimeError(f"[job {status}] {job.get('error') or ''}".rstrip()),
        context={},
    )


def record_stream(label: str, result: StreamResult) -> None:
    """Fire TTFT, ITL and cached-ratio rows for one complete stream and count its tokens."""
    if result.ttft_s is not None:
        fire(TTFT, label, result.ttft_s * 1000)
    tokens = result.completion_tokens
    if tokens > 1 and result.ttft_s is not None and result.last_token_s is not None:
        fire(ITL, label, (result.last_token_s - result.ttft_s) * 1000 / (tokens - 1))
    if result.usage:
        TOTALS.add(result.usage)
        prompt = int(result.usage.get("prompt_tokens", 0))
        cached = int((result.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        if prompt > 0:
            fire(CACHED, label, 100.0 * cached / prompt, cached)


def meta(response: ResponseContextManager) -> dict[str, Any]:
    """The request's report to locust, editable until the ``with`` block exits."""
    request_meta = response.request_meta
    assert isinstance(request_meta, dict)
    return request_meta


def settle(response: ResponseContextManager, expected: tuple[int, ...] = (200,)) -> Outcome:
    """Judge a response's status (inside its ``catch_response`` block).

    ``rejected``: a 503, renamed into its ``[rejected]`` row and marked a success (sleep
    :func:`retry_after` before the next request, as a polite client does). ``failed``:
    already marked a failure with its tag. ``ok``: the caller goes on and marks the result.
    """
    status = response.status_code
    if status == 0:
        error = response.error
        kind = "timeout" if isinstance(error, requests.Timeout) else "connection"
        response.failure(f"[{kind}] {type(error).__name__}")
        return "failed"
    if status == 503:
        meta(response)["name"] += REJECTED_SUFFIX
        response.success()
        return "rejected"
    if status not in expected:
        response.failure(f"[http {status}] {_error_code(response)}")
        return "failed"
    return "ok"


def json_object(response: ResponseContextManager) -> dict[str, Any] | None:
    """The body as a JSON object; None (and the response marked failed) otherwise."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        response.failure("[protocol] the answer is not a JSON object")
        return None
    return body


def retry_after(response: requests.Response) -> float:
    """Seconds the server asked us to wait (``Retry-After``), capped; 1 s when absent."""
    try:
        return min(MAX_RETRY_AFTER_S, max(0.0, float(response.headers.get("Retry-After", "1"))))
    except ValueError:
        return 1.0


def _error_code(response: requests.Response) -> str:
    # NOTE: the code, not the message: locust groups failures by text, and messages hold ids.
    try:
        error = response.json().get("error", {})
        return str(error.get("code") or error.get("type") or "error")
    except (ValueError, AttributeError):
        return "non-JSON body"


# -- the client summary, written when locust quits ------------------------------------------
@dataclass
class EntrySummary:
    count: int = 0
    failures: int = 0
    avg: float = 0.0
    p50: float = 0.0
    p95: float = 0.0
    p99: float = 0.0
    max: float = 0.0


@dataclass
class ClientSummary:
    """Exact aggregates over locust's rows, by kind (locust's own "Aggregated" row would mix
    the custom rows into the HTTP latency)."""

    elapsed_s: float
    http: EntrySummary
    rejected: EntrySummary
    ttft_ms: EntrySummary
    itl_ms: EntrySummary
    cached_pct: EntrySummary
    ready_ms: EntrySummary
    job_ms: EntrySummary
    tokens: TokenTotals
    failures_by_kind: dict[str, int] = field(default_factory=dict)
    failure_examples: list[str] = field(default_factory=list)
    user_exceptions: int = 0
    summarize_route: str = "not used"  # "served" or "absent" once a SummarizeUser probed it


def summarize(environment: Environment) -> ClientSummary:
    stats = environment.stats
    entries = list(stats.entries.values())

    def merged(keep: Callable[[StatsEntry], bool]) -> EntrySummary:
        total = StatsEntry(stats, "merged", "")
        for entry in entries:
            if keep(entry):
                total.extend(entry)
        return _describe(total)

    def is_http(entry: StatsEntry) -> bool:
        return entry.method not in CUSTOM_TYPES

    failures: dict[str, int] = {}
    examples: list[str] = []
    for error in stats.errors.values():
        match = _TAG.search(str(error.error))
        kind = match.group(1) if match else "other"
        failures[kind] = failures.get(kind, 0) + error.occurrences
        examples.append(f"{error.method} {error.name}: {error.error} x{error.occurrences}")
    end = stats.last_request_timestamp or stats.start_time
    runner = environment.runner
    return ClientSummary(
        elapsed_s=max(0.0, end - stats.start_time),
        http=merged(lambda e: is_http(e) and not e.name.endswith(REJECTED_SUFFIX)),
        rejected=merged(lambda e: is_http(e) and e.name.endswith(REJECTED_SUFFIX)),
        ttft_ms=merged(lambda e: e.method == TTFT),
        itl_ms=merged(lambda e: e.method == ITL),
        cached_pct=merged(lambda e: e.method == CACHED),
        ready_ms=merged(lambda e: e.method == READY),
        job_ms=merged(lambda e: e.method == JOB and not e.name.endswith(FAILED_JOB_SUFFIX)),
        tokens=TOTALS,
        failures_by_kind=failures,
        failure_examples=examples[:20],
        user_exceptions=sum(row["count"] for row in runner.exceptions.values()) if runner else 0,
        summarize_route=_summarize_route(entries),
    )


def _summarize_route(entries: list[StatsEntry]) -> str:
    names = [e.name for e in entries if SUMMARIZE_PATH in e.name and e.method not in CUSTOM_TYPES]
    if any(not name.endswith(ABSENT_SUFFIX) for name in names):
        return "served"
    return "absent" if names else "not used"


def _describe(entry: StatsEntry) -> EntrySummary:
    if not entry.num_requests:
        return EntrySummary()
    return EntrySummary(
        count=entry.num_requests,
        failures=entry.num_failures,
        avg=round(entry.avg_response_time, 2),
        p50=entry.get_response_time_percentile(0.50),
        p95=entry.get_response_time_percentile(0.95),
        p99=entry.get_response_time_percentile(0.99),
        max=round(entry.max_response_time, 2),
    )


def write_client_summary(environment: Environment, path: Path) -> None:
    path.write_text(json.dumps(asdict(summarize(environment)), indent=2))


def iter_lines(response: requests.Response) -> Iterator[bytes]:
    """The body's lines as they arrive (SSE events are separated by blank lines)."""
    for line in response.iter_lines():
        yield line if isinstance(line, bytes) else line.encode()
