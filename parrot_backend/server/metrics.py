"""Prometheus metrics, one CollectorRegistry per app so apps (and tests) never share state."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import anyio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..engine.interface import EngineClient, EngineStats

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _EngineCollector(Collector):
    """Exposes the last engine stats snapshot; refreshed (async) just before each scrape."""

    def __init__(self) -> None:
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator:
        s = self.stats
        if s is None:
            return
        yield GaugeMetricFamily("parrot_engine_queue_depth", "Requests waiting in the engine",
                                value=s.waiting)
        yield GaugeMetricFamily("parrot_engine_running", "Requests the engine is running",
                                value=s.running)
        yield GaugeMetricFamily("parrot_engine_contexts", "Live KV contexts", value=s.contexts)
        yield GaugeMetricFamily("parrot_kv_blocks_total", "KV cache blocks", value=s.blocks_total)
        yield GaugeMetricFamily("parrot_kv_blocks_used", "KV cache blocks in use",
                                value=s.blocks_used)
        usage = s.blocks_used / s.blocks_total if s.blocks_total else 0.0
        yield GaugeMetricFamily("parrot_kv_usage_ratio", "Fraction of KV blocks in use",
                                value=usage)
        yield CounterMetricFamily("parrot_prefix_cache_hit_tokens",
                                  "Prompt tokens served from the prefix cache",
                                  value=s.prefix_cache_hits)
        yield CounterMetricFamily("parrot_prefix_cache_query_tokens",
                                  "Prompt tokens looked up in the prefix cache",
                                  value=s.prefix_cache_queries)
        yield CounterMetricFamily("parrot_engine_preemptions", "Engine preemptions",
                                  value=s.preemptions)


class _ManagerCollector(Collector):
    """The manager's queue and load, read at scrape time (native runs)."""

    GAUGES = {"pending_calls": "Ready calls waiting for an engine",
              "running_calls": "Calls running on engines", "runs": "Runs held in memory",
              "engines": "Engines in service"}
    COUNTERS = {"calls_dispatched": "Calls dispatched to engines",
                "prefix_fills": "Shared prefixes filled", "prefix_forks":
                "Calls forked from a shared prefix"}

    def __init__(self, manager) -> None:
        self.manager = manager

    def collect(self) -> Iterator:
        counts = self.manager.counts()
        for name, doc in self.GAUGES.items():
            yield GaugeMetricFamily(f"parrot_manager_{name}", doc, value=counts[name])
        for name, doc in self.COUNTERS.items():
            yield CounterMetricFamily(f"parrot_manager_{name}", doc, value=counts[name])


class ServerMetrics:
    """The server's own counters plus the engine's state at scrape time."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests_running = Gauge(
            "parrot_requests_running", "Generating requests in the server", registry=r)
        self.requests = Counter(
            "parrot_requests", "Finished generation requests", ["endpoint", "outcome"], registry=r)
        self.rejected = Counter(
            "parrot_requests_rejected", "Requests rejected before running", ["reason"],
            registry=r)
        self.prompt_tokens = Counter(
            "parrot_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.tokens_generated = Counter(
            "parrot_tokens_generated", "Tokens generated and sent to clients", registry=r)
        self.ttft = Histogram(
            "parrot_time_to_first_token_seconds", "Request arrival to first generated token",
            ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.latency = Histogram(
            "parrot_request_latency_seconds", "Request arrival to end of generation",
            ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self._engine = _EngineCollector()
        r.register(self._engine)

    def watch_manager(self, manager) -> None:
        """Export the manager's queue and load (when the app serves native runs)."""
        self.registry.register(_ManagerCollector(manager))

    def reject(self, reason: str) -> None:
        self.rejected.labels(reason=reason).inc()

    async def render(self, engine: EngineClient) -> bytes:
        """Refresh the engine snapshot (bounded wait) and encode everything."""
        try:
            with anyio.fail_after(2):
                self._engine.stats = await engine.stats()
        except Exception as exc:  # a stuck engine must not make /metrics hang or fail
            log.warning("engine stats unavailable for /metrics: %r", exc)
        return generate_latest(self.registry)
