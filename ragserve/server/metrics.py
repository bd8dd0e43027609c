"""Prometheus metrics: one registry per application, no process-wide state.

HTTP-side metrics are updated as requests run; engine-side values (KV blocks, cache hit
rate, prompt tokens computed) are read from the engine thread at scrape time and exposed
by a collector holding that snapshot.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ragserve.engine.engine_info import EngineSnapshot, KVBlockUsage, TierMetrics
from ragserve.outputs import RequestOutput
from ragserve.server.admission import WorkAdmission

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.25, 0.5, 1.0, 2.5)


class _EngineCollector(Collector):
    """The engine-side values of one scrape.

    ``snapshot`` is None when the engine did not answer: it reads as not alive, its
    counters as 0 and its labelled families as empty.
    """

    def __init__(self) -> None:
        self.snapshot: EngineSnapshot | None = None
        self.active_requests = 0
        self.documents: Mapping[str, int] = {}
        self.shared_registry: Mapping[str, int] | None = None
        self.directory_registry: Mapping[str, int] | None = None

    def collect(self) -> Iterator[Metric]:
        alive = self.snapshot is not None
        snap = self.snapshot or _NO_ENGINE
        yield _gauge("ragserve_engine_alive", "1 while the engine thread runs", alive)
        yield _gauge(
            "ragserve_num_requests_running", "Sequences in the running batch", snap.running
        )
        yield _gauge(
            "ragserve_num_requests_waiting", "Sequences waiting to be scheduled", snap.waiting
        )
        yield _gauge(
            "ragserve_num_requests_active",
            "Engine requests in flight (admission limit)",
            self.active_requests,
        )
        blocks = GaugeMetricFamily(
            "ragserve_kv_blocks", "Device KV blocks by state", labels=["state"]
        )
        for state, count in sorted(snap.kv_blocks.by_state().items() if alive else ()):
            blocks.add_metric([state], count)
        yield blocks
        yield _gauge(
            "ragserve_prefix_cache_hit_rate",
            "Prompt tokens served from cache / queried",
            snap.hit_rate,
        )
        yield _counter(
            "ragserve_prefix_cache_queried_tokens", "Prompt tokens looked up", snap.queried_tokens
        )
        yield _counter(
            "ragserve_prefix_cache_hit_tokens", "Prompt tokens found cached", snap.hit_tokens
        )
        yield _counter(
            "ragserve_prompt_tokens_computed",
            "Prompt tokens run through the model (cache misses)",
            snap.prompt_tokens_computed,
        )
        yield _counter("ragserve_generation_tokens", "Tokens generated", snap.generated_tokens)
        yield _counter("ragserve_engine_steps", "Engine steps run", snap.steps)
        yield _counter(
            "ragserve_engine_steps_ahead",
            "Engine steps launched before the previous step's tokens were read",
            snap.steps_ahead,
        )
        yield _counter(
            "ragserve_preemptions", "Sequences preempted for lack of blocks", snap.preemptions
        )
        docs = GaugeMetricFamily("ragserve_documents", "Documents by status", labels=["status"])
        for status, count in sorted(self.documents.items()):
            docs.add_metric([status], count)
        yield docs
        yield from _tier_families(snap.tier_metrics)
        if self.shared_registry is not None:
            yield from _shared_registry_families(self.shared_registry)
        if self.directory_registry is not None:
            for name, doc in _DIRECTORY_REGISTRY:
                yield _counter(
                    f"ragserve_registry_directory_{name}", doc, self.directory_registry.get(name, 0)
                )


_NO_ENGINE = EngineSnapshot(
    running=0,
    waiting=0,
    requests_in_flight=0,
    kv_blocks=KVBlockUsage(total=0, used=0, pinned=0, cached=0, free=0),
    queried_tokens=0,
    hit_tokens=0,
    prompt_tokens_computed=0,
    generated_tokens=0,
    steps=0,
    steps_ahead=0,
    preemptions=0,
    kv_utilisation=0.0,
    tier_metrics={},
    tier_traffic=None,
)


# (metric suffix, TierMetrics field, help, is_counter) for the CPU, disk and remote KV tiers.
_TIER_FIELDS = (
    ("capacity_bytes", "capacity_bytes", "Tier capacity", False),
    ("used_bytes", "used_bytes", "Bytes stored in the tier", False),
    ("blocks", "num_blocks", "Blocks stored in the tier", False),
    ("hits", "hits", "Blocks loaded from the tier", True),
    ("misses", "misses", "Lookups the tier could not serve", True),
    ("read_bytes", "bytes_read", "Bytes read from the tier", True),
    ("written_bytes", "bytes_written", "Bytes written to the tier", True),
    ("load_seconds", "load_seconds_total", "Time spent loading blocks", True),
    (
        "load_copies",
        "load_copies",
        "Copies issued by loads (a run of adjacent blocks is one)",
        True,
    ),
    ("store_seconds", "store_seconds_total", "Time spent storing blocks", True),
    ("dropped_demotions", "dropped_demotions", "Demotions dropped (queue full, disk full)", True),
    ("corrupt_records", "corrupt_records", "Damaged records found and removed", True),
    ("foreign_records", "foreign_records", "Records of another model or format removed", True),
    ("disk_full_events", "disk_full_events", "Times the disk filled up", True),
    ("mismatched_records", "mismatched_records", "Records of another block removed", True),
    ("errors", "errors", "Failed calls to a remote store (time-outs, connections)", True),
    ("breaker_openings", "breaker_openings", "Outages that opened the circuit breaker", True),
    ("breaker_open", "breaker_open", "1 while calls to the store are suspended", False),
)


def _tier_families(tiers: Mapping[str, TierMetrics]) -> Iterator[Metric]:
    for suffix, attribute, doc, is_counter in _TIER_FIELDS:
        family_type = CounterMetricFamily if is_counter else GaugeMetricFamily
        family = family_type(f"ragserve_kv_tier_{suffix}", doc, labels=["tier"])
        for name, metrics in sorted(tiers.items()):
            family.add_metric([name], float(getattr(metrics, attribute)))
        yield family


# The registry shared through the store (ragserve.server.store_registry): count name, help.
_SHARED_REGISTRY = (
    ("published", "Rows and tombstones this server wrote to the store"),
    ("adopted", "Documents learned from rows another server published to the store"),
    ("refreshed", "Newer rows of known documents (a PATCH elsewhere) taken from the store"),
    ("taken_over", "Ingestions taken over from a server that died before it ended them"),
    ("publish_failures", "Writes to the store that failed (each is retried)"),
    ("rejected", "Store values that did not verify (damaged, foreign, wrong key): ignored"),
)


# The registry's directory (ragserve.server.registry_ingestions): count name, help.
_DIRECTORY_REGISTRY = (
    (
        "taken_over",
        "Ingestions taken over from a server on the registry directory that died before it "
        "ended them",
    ),
)


def _shared_registry_families(counts: Mapping[str, int]) -> Iterator[Metric]:
    for name, doc in _SHARED_REGISTRY:
        yield _counter(f"ragserve_registry_store_{name}", doc, counts.get(name, 0))
    yield _gauge(
        "ragserve_registry_store_pending",
        "Writes to the store waiting for their retry",
        counts.get("pending", 0),
    )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value))


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=float(value))


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "ragserve_http_requests",
            "HTTP requests by route and status (499: the client went away)",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "ragserve_time_to_first_token_seconds",
            "From request arrival to the first generated token",
            ["endpoint"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "ragserve_inter_token_latency_seconds",
            "Between consecutive generated tokens of one sequence",
            ["endpoint"],
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "ragserve_request_prompt_tokens",
            "Prompt tokens of finished requests",
            ["endpoint"],
            registry=self.registry,
        )
        self.cached_tokens = Counter(
            "ragserve_request_cached_tokens",
            "Prompt tokens of finished requests served from the cache",
            ["endpoint"],
            registry=self.registry,
        )
        self.blended_tokens = Counter(
            "ragserve_request_blended_tokens",
            "Prompt tokens of finished requests whose KV was reused from a document segment "
            "at a new position (not counted as cached)",
            ["endpoint"],
            registry=self.registry,
        )
        self.recomputed_tokens = Counter(
            "ragserve_request_recomputed_tokens",
            "Prompt tokens of blended documents computed instead of reused",
            ["endpoint"],
            registry=self.registry,
        )
        self.completion_tokens = Counter(
            "ragserve_request_completion_tokens",
            "Generated tokens of finished requests",
            ["endpoint"],
            registry=self.registry,
        )
        self.pipeline_jobs = Counter(
            "ragserve_pipeline_jobs",
            "Pipeline jobs that ended, by pipeline and final status",
            ["pipeline", "status"],
            registry=self.registry,
        )
        self.pipeline_jobs_active = Gauge(
            "ragserve_pipeline_jobs_active",
            "Pipeline jobs queued or running",
            ["pipeline", "status"],
            registry=self.registry,
        )
        self.queued_work = Gauge(
            "ragserve_admission_outstanding_tokens",
            "Estimated tokens of admitted work not done yet, by kind",
            ["kind"],
            registry=self.registry,
        )
        self.token_cost = Gauge(
            "ragserve_admission_token_seconds",
            "Measured engine seconds per prompt token computed / answer token generated "
            "(0: not measured yet)",
            ["kind"],
            registry=self.registry,
        )
        self.answering = Gauge(
            "ragserve_admission_answering_sequences",
            "Admitted sequences past their prompt, generating their answer",
            registry=self.registry,
        )
        self.queue_seconds = Gauge(
            "ragserve_admission_expected_seconds",
            "Expected seconds to finish the outstanding work alone (0: not measured yet)",
            registry=self.registry,
        )
        self._engine = _EngineCollector()
        self.registry.register(self._engine)

    def record_admission(self, admission: WorkAdmission) -> None:
        self.queued_work.labels("prompt").set(admission.prompt_outstanding)
        self.queued_work.labels("answer").set(admission.answer_outstanding)
        costs = admission.costs()
        self.token_cost.labels("prompt").set(costs.prompt_s if costs else 0.0)
        self.token_cost.labels("answer").set(costs.answer_s if costs else 0.0)
        self.answering.set(admission.sequences_answering)
        self.queue_seconds.set(admission.drain_seconds() or 0.0)

    def record_finished(self, endpoint: str, output: RequestOutput) -> None:
        self.prompt_tokens.labels(endpoint).inc(len(output.prompt_token_ids))
        self.cached_tokens.labels(endpoint).inc(output.num_cached_tokens)
        self.blended_tokens.labels(endpoint).inc(output.num_blended_tokens)
        self.recomputed_tokens.labels(endpoint).inc(output.num_recomputed_tokens)
        self.completion_tokens.labels(endpoint).inc(sum(len(c.token_ids) for c in output.outputs))

    def render(
        self,
        snapshot: EngineSnapshot | None,
        active_requests: int,
        documents: Mapping[str, int],
        shared_registry: Mapping[str, int] | None = None,
        directory_registry: Mapping[str, int] | None = None,
    ) -> bytes:
        """The Prometheus text of every metric. ``snapshot``: the engine's, None when it did
        not answer; ``active_requests``: engine requests in flight; ``documents``: by status;
        ``shared_registry``: the store registry's counts, ``directory_registry``: the
        registry directory's (None: the server has none)."""
        self._engine.snapshot = snapshot
        self._engine.active_requests = active_requests
        self._engine.documents = documents
        self._engine.shared_registry = shared_registry
        self._engine.directory_registry = directory_registry
        return generate_latest(self.registry)


def endpoint_label(request: web.Request) -> str:
    """The route's template (never the raw path, which would explode label cardinality)."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def make_metrics_middleware(metrics: ServerMetrics) -> Any:
    @web.middleware
    async def metrics_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        status = 500
        try:
            response: web.StreamResponse = await handler(request)
            status = response.status
            return response
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            metrics.requests.labels(endpoint_label(request), str(status)).inc()

    return metrics_middleware
