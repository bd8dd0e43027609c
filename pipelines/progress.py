"""Driving the engine for a batch job: bounded in-flight requests, progress, clean abort."""

from __future__ import annotations

import heapq
import itertools
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from tqdm.auto import tqdm

from ragserve.document_reuse import DocumentReuse
from ragserve.outputs import RequestOutput
from ragserve.sampling_params import SamplingParams

Tag = TypeVar("Tag")


@dataclass
class Finished(Generic[Tag]):
    """A request that left the engine: its output, or why it never ran (``error``)."""

    tag: Tag
    output: RequestOutput | None = None
    error: str | None = None


@dataclass(order=True)
class _Queued(Generic[Tag]):
    priority: int
    order: int
    tag: Tag = field(compare=False)
    prompt: list[int] = field(compare=False)
    params: SamplingParams = field(compare=False)
    reuse: DocumentReuse | None = field(default=None, compare=False)


class RequestPump(Generic[Tag]):
    """Keeps at most ``concurrency`` requests in the engine; the rest wait here.

    Waiting requests enter lowest ``priority`` first, then in submission order, so a job
    can let work that finishes a document (its reduce steps, its other questions) overtake
    the start of later documents. The engine batches whatever is in flight continuously.

    Use it as a context manager: leaving it for any reason (an error, Ctrl-C, a consumer
    that stops iterating) aborts every request still in the engine, so no KV block leaks.
    """

    def __init__(self, engine: Any, concurrency: int, namespace: str = "") -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.engine = engine
        self.concurrency = concurrency
        self.namespace = namespace
        self._prefix = f"batch-{uuid.uuid4().hex[:8]}"
        self._ids = itertools.count()
        self._queue: list[_Queued[Tag]] = []
        self._in_flight: dict[str, Tag] = {}
        self._refused: list[Finished[Tag]] = []
        self.num_submitted = 0
        self.num_finished = 0
        self.generated_tokens = 0
        self._started = time.perf_counter()
        self._prompt_tokens_at_start = int(engine.snapshot().prompt_tokens_computed)

    def submit(
        self,
        tag: Tag,
        prompt: list[int],
        params: SamplingParams,
        priority: int = 0,
        reuse: DocumentReuse | None = None,
    ) -> None:
        """Queue a request; it enters the engine at once when fewer than ``concurrency`` run.

        ``reuse``: where the prompt's documents lie, and how their KV may be reused."""
        heapq.heappush(self._queue, _Queued(priority, next(self._ids), tag, prompt, params, reuse))
        self.num_submitted += 1
        self._fill()

    @property
    def busy(self) -> bool:
        return bool(self._queue or self._in_flight or self._refused)

    def poll(self) -> list[Finished[Tag]]:
        """Run one engine step; return what finished, and what the engine refused, if anything."""
        self._fill()
        done, self._refused = self._refused, []
        if not self._in_flight:
            return done
        if not self.engine.has_unfinished_requests():
            raise RuntimeError(
                f"{len(self._in_flight)} requests vanished from the engine (aborted elsewhere?)"
            )
        for output in self.engine.step():
            if not output.finished:
                continue
            tag = self._in_flight.pop(output.request_id, None)
            if tag is None:
                continue  # someone else's request
            self.num_finished += 1
            self.generated_tokens += sum(len(c.token_ids) for c in output.outputs)
            # NOTE: a request the engine failed (a fault in its step, or no room to run it)
            # finishes too, its text partial or empty: it is an error, not a result.
            done.append(Finished(tag, output, output.error))
        return done

    def _fill(self) -> None:
        while self._queue and len(self._in_flight) < self.concurrency:
            item = heapq.heappop(self._queue)
            request_id = f"{self._prefix}-{item.order}"
            try:
                if item.reuse is None:
                    self.engine.add_request(
                        request_id, item.prompt, item.params, namespace=self.namespace
                    )
                else:
                    self.engine.add_request(
                        request_id,
                        item.prompt,
                        item.params,
                        namespace=self.namespace,
                        documents=item.reuse.documents,
                        kv_reuse=item.reuse.kv_reuse,
                        recompute_ratio=item.reuse.recompute_ratio,
                    )
            except ValueError as exc:
                self.num_finished += 1
                self._refused.append(Finished(item.tag, error=str(exc)))
                continue
            self._in_flight[request_id] = item.tag

    def drop(self, belongs: Callable[[Tag], bool]) -> int:
        """Drop the waiting requests whose tag ``belongs``, abort those in the engine, and
        count them as finished; returns how many went (a failed document's other calls)."""
        kept = [item for item in self._queue if not belongs(item.tag)]
        dropped = len(self._queue) - len(kept)
        if dropped:
            self._queue = kept
            heapq.heapify(self._queue)
        for request_id, tag in list(self._in_flight.items()):
            if belongs(tag):
                self.engine.abort_request(request_id)
                del self._in_flight[request_id]
                dropped += 1
        self.num_finished += dropped
        return dropped

    def abort_all(self) -> None:
        """Drop the waiting requests and abort those in the engine."""
        self._queue.clear()
        self._refused.clear()
        for request_id in list(self._in_flight):
            self.engine.abort_request(request_id)
            del self._in_flight[request_id]

    @property
    def prompt_tokens_computed(self) -> int:
        """Prompt tokens the engine ran through the model since this pump started."""
        return int(self.engine.snapshot().prompt_tokens_computed) - self._prompt_tokens_at_start

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._started

    def __enter__(self) -> RequestPump[Tag]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort_all()


REDRAW_S = 0.5


class BatchProgress:
    """One tqdm bar over documents (or questions), with requests done and token rates."""

    def __init__(self, total: int, unit: str, enabled: bool) -> None:
        self._bar = tqdm(
            total=total, unit=unit, desc=f"{unit}s", disable=not enabled, dynamic_ncols=True
        )
        self._drawn = -math.inf

    def advance(self, count: int = 1) -> None:
        self._bar.update(count)

    def show(self, pump: RequestPump[Any], requests_total: int | None = None) -> None:
        seconds = max(pump.elapsed, 1e-6)
        done = f"{pump.num_finished}/{requests_total if requests_total is not None else pump.num_submitted}"
        self._bar.set_postfix(
            requests=done,
            prefill_tok_s=f"{pump.prompt_tokens_computed / seconds:.0f}",
            gen_tok_s=f"{pump.generated_tokens / seconds:.1f}",
            refresh=self._due(),
        )

    def _due(self) -> bool:
        """Whether to draw now: the bar moves once per document, which can take minutes,
        so the request counts and rates are drawn on their own, twice a second at most."""
        now = time.monotonic()
        if now - self._drawn < REDRAW_S:
            return False
        self._drawn = now
        return True

    def close(self) -> None:
        self._bar.close()
