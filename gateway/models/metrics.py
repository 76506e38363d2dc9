"""Prometheus metrics with the official prometheus-client.

Request, latency and token series are counted in the gateway as requests end; model and
worker series are read from the manager at scrape time. Counters of loads, unloads,
evictions and restarts live in the gateway too, so a worker restarting loses nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from .lifecycle import SlotState
from .token_gaps import ITL_BUCKETS, GapHistogram

if TYPE_CHECKING:
    from ..web.edge import EdgeStats
    from .generation import Generation
    from .manager import ModelManager

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _GapCollector:
    """mlxgw_inter_token_latency_seconds, per model, from the merged GapHistograms."""

    def __init__(self) -> None:
        self.per_model: dict[str, GapHistogram] = {}

    def collect(self):
        family = HistogramMetricFamily(
            "mlxgw_inter_token_latency_seconds", "Time between streamed tokens", labels=["model"]
        )
        for model, hist in list(self.per_model.items()):
            cumulative, buckets = 0, []
            for bound, n in zip((*ITL_BUCKETS, float("inf")), hist.counts):
                cumulative += n
                buckets.append((floatToGoString(bound), cumulative))
            family.add_metric([model], buckets, hist.total)
        yield family


class _ManagerCollector:
    def __init__(self, manager: ModelManager):
        self.manager = manager

    def collect(self):
        m = self.manager
        running = GaugeMetricFamily("mlxgw_requests_running", "Sequences decoding, per model", labels=["model"])
        waiting = GaugeMetricFamily("mlxgw_requests_waiting", "Requests queued in workers, per model", labels=["model"])
        hit_rate = GaugeMetricFamily("mlxgw_prefix_cache_hit_rate", "Prefix-cache lookup hit rate", labels=["model"])
        cache_bytes = GaugeMetricFamily("mlxgw_prefix_cache_bytes", "Prefix-cache size", labels=["model"])
        rss = GaugeMetricFamily("mlxgw_worker_memory_bytes", "Worker process RSS", labels=["model", "worker"])
        mlx = GaugeMetricFamily("mlxgw_worker_mlx_active_bytes", "MLX active memory", labels=["model", "worker"])
        loaded = GaugeMetricFamily("mlxgw_model_loaded", "1 if a worker serves the model", labels=["model"])
        loads = CounterMetricFamily("mlxgw_model_loads", "Worker starts", labels=["model"])
        unloads = CounterMetricFamily("mlxgw_model_unloads", "Workers ended by unload or eviction", labels=["model"])
        restarts = CounterMetricFamily("mlxgw_worker_restarts", "Worker restarts after a crash", labels=["model"])
        evictions = CounterMetricFamily("mlxgw_model_evictions", "Models evicted to make room", labels=[])
        for slot in list(m.slots.values()):
            stats = [c.stats for c in m.conns(slot)]
            running.add_metric([slot.name], sum(s.get("running", 0) for s in stats))
            waiting.add_metric([slot.name], sum(s.get("waiting", 0) for s in stats))
            lookups = sum((s.get("cache") or {}).get("lookups", 0) for s in stats)
            hits = sum((s.get("cache") or {}).get("hits", 0) for s in stats)
            hit_rate.add_metric([slot.name], hits / lookups if lookups else 0.0)
            cache_bytes.add_metric([slot.name], sum((s.get("cache") or {}).get("bytes", 0) for s in stats))
            for c in m.conns(slot):
                rss.add_metric([slot.name, c.worker_id[:12]], c.stats.get("rss_bytes", 0))
                mlx.add_metric([slot.name, c.worker_id[:12]], c.stats.get("mlx_active_bytes", 0))
            loaded.add_metric([slot.name], 1 if slot.state is SlotState.READY else 0)
            loads.add_metric([slot.name], slot.loads)
            unloads.add_metric([slot.name], slot.unloads)
            restarts.add_metric([slot.name], slot.restarts)
        evictions.add_metric([], m.residency.evictions)
        yield from (running, waiting, hit_rate, cache_bytes, rss, mlx, loaded, loads, unloads, restarts, evictions)


class _PoolCollector:
    """Per replica of each model's pool (gateway/link/pool.py): load, prefix-cache hits of
    the requests it finished, how requests were routed to it, its circuit breaker."""

    def __init__(self, manager: ModelManager):
        self.manager = manager

    def collect(self):
        labels = ["model", "replica"]
        load = GaugeMetricFamily("mlxgw_replica_in_flight", "Requests in flight per replica", labels=labels)
        rate = GaugeMetricFamily("mlxgw_replica_cache_hit_rate", "Prompt tokens read from cache", labels=labels)
        routed = CounterMetricFamily("mlxgw_replica_routed", "Requests routed", labels=[*labels, "by"])
        broken = GaugeMetricFamily("mlxgw_replica_breaker_open", "1 while its circuit breaker is open", labels=labels)
        cold = CounterMetricFamily("mlxgw_replica_cold_warm_turns", "Later turns with no cache hit", labels=labels)
        indexed = GaugeMetricFamily("mlxgw_replica_indexed_prefixes", "Route entries it holds", labels=labels)
        evicted = CounterMetricFamily("mlxgw_replica_evicted_prefixes", "Route entries it evicted", labels=labels)
        for slot in list(self.manager.slots.values()):
            for row in self.manager.broker.pool.report(slot.name):
                at = [slot.name, row["replica"]]
                load.add_metric(at, row["load"])
                rate.add_metric(at, row["cache_hit_rate"] or 0.0)
                for how in ("prefix", "session", "load"):
                    routed.add_metric([*at, how], row[f"routed_by_{how}"])
                broken.add_metric(at, 1 if row["breaker_open_s"] > 0 else 0)
                cold.add_metric(at, row["cold_warm_turns"])
                indexed.add_metric(at, row["indexed_prefixes"])
                evicted.add_metric(at, row["reported_evicted"])
        yield from (load, rate, routed, broken, cold, indexed, evicted)


class _EdgeCollector:
    def __init__(self, stats: EdgeStats):
        self.stats = stats

    def collect(self):
        s = self.stats
        yield GaugeMetricFamily("mlxgw_http_connections", "Open HTTP connections", value=s.open)
        yield GaugeMetricFamily("mlxgw_http_connections_peak", "Most HTTP connections open at once", value=s.peak)
        closed = CounterMetricFamily(
            "mlxgw_http_connections_closed", "Connections the server closed, by reason", labels=["reason"]
        )
        for reason, n in (("evicted", s.evicted), ("refused", s.refused), ("timeout", s.timed_out)):
            closed.add_metric([reason], n)
        yield closed


class Metrics:
    def __init__(self, manager: ModelManager, edge: EdgeStats | None = None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("mlxgw_requests", "HTTP requests", ["route", "model", "key", "status"], registry=r)
        self.duration = Histogram(
            "mlxgw_request_duration_seconds",
            "End-to-end request latency",
            ["route", "model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "mlxgw_time_to_first_token_seconds", "Time to first token", ["model"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = _GapCollector()
        r.register(self.itl)
        self.tokens = Counter("mlxgw_tokens", "Tokens processed", ["model", "key", "kind"], registry=r)
        self._children: dict[tuple, object] = {}
        r.register(_ManagerCollector(manager))
        r.register(_PoolCollector(manager))
        if edge is not None:
            r.register(_EdgeCollector(edge))

    def _child(self, metric, *labels: str):
        """metric.labels(*labels), remembered: prometheus_client validates the labels and
        takes a lock on every call, and a request's labels are nearly always ones seen before."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def observe(self, route: str, model: str, key: str, status: int, duration: float, gen: Generation | None) -> None:
        self._child(self.requests, route, model, key, str(status)).inc()
        self._child(self.duration, route, model).observe(duration)
        if gen is None:
            return
        if gen.first_token_at is not None:
            self._child(self.ttft, model).observe(gen.first_token_at - gen.started)
        if any(gen.token_gaps.counts):
            self.itl.per_model.setdefault(model, GapHistogram()).merge(gen.token_gaps)
        u = gen.usage
        for kind, n in (("prompt", u.prompt_tokens), ("cached", u.cached_tokens), ("completion", u.completion_tokens)):
            if n:
                self._child(self.tokens, model, key, kind).inc(n)
