"""Prometheus metrics on a private registry (one per app, so tests can build several apps).

Request metrics are updated by the server as requests finish; snapshot-store counters, queue
depth and RSS are read at scrape time by a collector, so they are never stale.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import psutil
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# TTFT on a board spans 50 ms (RAM hit, small model) to minutes (8K cold prefill)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500)
# store.stats() keys exported as counters (monotonic) vs gauges (current state)
_COUNTER_WORDS = ("saves", "saved", "loads", "loaded", "restores", "rejections", "rejected",
                  "evictions", "evicted", "skipped", "failures", "errors", "written", "read", "hits",
                  "misses", "quarantined", "vanished")
# edge_llm_prefetches_total{outcome}: what became of the start-up prefetch (edge_llm/server/prefetch.py)
PREFETCH_OUTCOMES = ("started", "loaded", "joined", "preempted", "failed", "used")
_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """Counters and histograms of the HTTP API plus a scrape-time collector."""

    content_type = _CONTENT_TYPE

    def __init__(self, state: Callable[[], dict[str, Any]] | None = None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("edge_llm_requests", "HTTP API requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("edge_llm_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.prefill = Histogram("edge_llm_prefill_seconds", "Tail prefill time",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.decode = Histogram("edge_llm_decode_seconds", "Decode time per request",
                                buckets=LATENCY_BUCKETS, registry=r)
        self.restore = Histogram("edge_llm_restore_seconds", "Disk snapshot restore time",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("edge_llm_prompt_tokens", "Prompt tokens", registry=r)
        self.completion_tokens = Counter("edge_llm_completion_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter("edge_llm_cached_tokens", "Prompt tokens reused instead of prefilled",
                                     ["source"], registry=r)
        self.prefilled_tokens = Counter("edge_llm_prefilled_tokens", "Prompt tokens computed", registry=r)
        self.cancelled = Counter("edge_llm_cancelled_requests", "Generations cancelled (client gone "
                                 "or shutdown)", registry=r)
        self.rejected_queue_full = Counter("edge_llm_queue_rejections", "Requests refused with 503 "
                                           "because the queue was full", registry=r)
        self.prefetches = Counter("edge_llm_prefetches", "Start-up prefetches (disk_kv_prefetch) by outcome: "
                                  "started, loaded, joined (a request arrived during the read and waited "
                                  "for it), preempted, failed, used (a request reused the rows)",
                                  ["outcome"], registry=r)
        for source in ("ram", "disk"):
            self.cached_tokens.labels(source=source)
        for outcome in PREFETCH_OUTCOMES:
            self.prefetches.labels(outcome=outcome)
        r.register(_StateCollector(state or (lambda: {})))

    def observe_generation(self, timings: Any, usage: Any, finish_reason: str | None) -> None:
        """Record one finished generation (engine Timings and Usage)."""
        self.ttft.observe(timings.ttft_ms / 1e3)
        self.prefill.observe(timings.prefill_ms / 1e3)
        self.decode.observe(timings.decode_ms / 1e3)
        if timings.cache_source == "disk":
            self.restore.observe(timings.restore_ms / 1e3)
        if timings.cache_source == "disk-prefetch":
            self.prefetches.labels(outcome="used").inc()
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.completion_tokens.inc(usage.completion_tokens)
        self.prefilled_tokens.inc(timings.prefill_tokens)
        self.cached_tokens.labels(source="ram").inc(timings.ram_cached_tokens)
        self.cached_tokens.labels(source="disk").inc(timings.disk_cached_tokens)
        if finish_reason == "cancelled":
            self.cancelled.inc()

    def prefetch_outcome(self, outcome: str) -> None:
        """Count a start-up prefetch's outcome (edge_llm/server/prefetch.py, OUTCOMES)."""
        self.prefetches.labels(outcome=outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector(Collector):
    """Queue depth, RSS and the snapshot store's counters, read when scraped."""

    def __init__(self, state: Callable[[], dict[str, Any]]):
        self.state = state
        self.proc = psutil.Process()

    def collect(self):
        try:
            st = self.state()
        except Exception as e:  # a scrape must never fail because a component is mid-change
            log.debug("metrics state unavailable: %s", e)
            st = {}
        g = GaugeMetricFamily("edge_llm_queue_depth", "Requests waiting for the worker")
        g.add_metric([], st.get("queue_depth", 0))
        yield g
        g = GaugeMetricFamily("edge_llm_busy", "1 while a generation is running")
        g.add_metric([], 1 if st.get("busy") else 0)
        yield g
        g = GaugeMetricFamily("edge_llm_ready", "1 once the model is loaded and the index scanned")
        g.add_metric([], 1 if st.get("ready") else 0)
        yield g
        g = GaugeMetricFamily("edge_llm_rss_bytes", "Resident set size of the server process")
        g.add_metric([], self.proc.memory_info().rss)
        yield g
        yield from _store_metrics(st.get("store"))


def _store_metrics(stats: Any):
    """Export the numeric fields of `SnapshotStore.stats()` as edge_llm_snapshot_* metrics."""
    if stats is None:
        return
    if dataclasses.is_dataclass(stats):
        stats = dataclasses.asdict(stats)
    if not isinstance(stats, dict):
        return
    for key, value in sorted(stats.items()):
        if isinstance(value, dict):  # e.g. rejections by reason
            fam = CounterMetricFamily(f"edge_llm_snapshot_{key}", f"snapshot store: {key}", labels=["reason"])
            for label, v in value.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    fam.add_metric([str(label)], v)
            yield fam
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if any(w in key for w in _COUNTER_WORDS):
            fam = CounterMetricFamily(f"edge_llm_snapshot_{key.removesuffix('_total')}",
                                      f"snapshot store: {key}")
        else:
            fam = GaugeMetricFamily(f"edge_llm_snapshot_{key}", f"snapshot store: {key}")
        fam.add_metric([], value)
        yield fam


_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class StatusCountMiddleware:
    """ASGI middleware: count every HTTP response by endpoint and status (unknown paths: other)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in _ENDPOINTS else "other"

        async def counting_send(msg) -> None:
            if msg["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint=endpoint, status=str(msg["status"])).inc()
            await send(msg)

        await self.app(scope, receive, counting_send)
