"""Prometheus metrics of one producer, served from its own event loop (aiohttp, no thread).

Each producer has its own registry, so several producers in one process (tests) do not clash.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping

from aiohttp import web
from rollstream.common.bias import KINDS, ledger
from rollstream.common.errors import ExtraNotInstalled
from rollstream.common.heartbeat import COUNTER, NUMERIC, TEXT, Heartbeat, Stat, stats
from rollstream.common.models import Group

try:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST
    from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
    from prometheus_client.registry import Collector
except ImportError as exc:  # a light install: only producers serving metrics need it
    raise ExtraNotInstalled("prometheus_client", "metrics", "Prometheus metrics (--metrics-port)") from exc

from .engine import EngineClient
from .telemetry import Metrics

logger = logging.getLogger(__name__)


def _help(s: Stat) -> str:
    return f"{s.meaning} ({s.unit})" if s.unit else s.meaning


class StatsCollector(Collector):
    """The producer's declared stats (:func:`rollstream.common.heartbeat.stats`), one series each,
    read from the producer at each scrape: ``rollstream_producer_<field>`` for a number (a counter
    or a gauge as declared), the text ones as labels of ``rollstream_producer_info``."""

    def __init__(self, read: Callable[[], Heartbeat] | None, labels: Mapping[str, str]) -> None:
        self._read = read
        self._labels = dict(labels)

    def describe(self) -> Iterator[Metric]:
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        return self._families(self._read() if self._read is not None else None)

    def _families(self, beat: Heartbeat | None) -> Iterator[Metric]:
        names, values = list(self._labels), list(self._labels.values())
        declared = stats(type(beat) if beat is not None else Heartbeat)
        for s in declared:
            if s.kind in NUMERIC:
                family = (CounterMetricFamily if s.kind == COUNTER else GaugeMetricFamily)(
                    s.metric, _help(s), labels=names)
                if beat is not None:
                    family.add_metric(values, float(getattr(beat, s.name)))
                yield family
        texts = [s for s in declared if s.kind == TEXT]
        info = InfoMetricFamily("rollstream_producer", "The producer's text stats: "
                                + "; ".join(f"{s.name}: {s.meaning}" for s in texts), labels=names)
        if beat is not None:
            info.add_metric(values, {s.name: str(getattr(beat, s.name)) for s in texts})
        yield info


class ProducerMetrics(Metrics):
    """The producer's :class:`~rollstream.producer.telemetry.Metrics`, exported to Prometheus."""

    def __init__(self, namespace: str, producer: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"namespace": namespace, "producer": producer}
        self._labels = labels
        names = list(labels)
        self.in_flight = Gauge(
            "rollstream_requests_in_flight", "Engine requests in flight", names, registry=self.registry
        ).labels(**labels)
        self.latency = Histogram(
            "rollstream_generation_seconds",
            "Latency of one engine generate request",
            names,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=self.registry,
        ).labels(**labels)
        self.tokens = Counter(
            "rollstream_tokens_generated", "Response tokens generated", names, registry=self.registry
        ).labels(**labels)
        self.groups = Counter(
            "rollstream_groups_published", "Groups published", names, registry=self.registry
        ).labels(**labels)
        self._errors = Counter(
            "rollstream_errors", "Errors by kind", [*names, "kind"], registry=self.registry
        )
        self._retries = Counter(
            "rollstream_engine_retries", "Engine requests retried", names, registry=self.registry
        ).labels(**labels)
        self._blocked = Counter(
            "rollstream_admission_blocked", "Admission attempts refused, by reason", [*names, "reason"],
            registry=self.registry,
        )
        self._blocked_seconds = Counter(
            "rollstream_admission_blocked_seconds",
            "Seconds admission was refused (paused, backlog or staleness), counted at each heartbeat",
            names,
            registry=self.registry,
        ).labels(**labels)
        engine_names = [*names, "engine"]
        self._engine_state = Gauge(
            "rollstream_engine_state", "1 for each engine's current state (joining, healthy, suspect, ejected, wedged, "
            "behind, draining)", [*engine_names, "state"], registry=self.registry,
        )
        self._engine_in_flight = Gauge(
            "rollstream_engine_in_flight", "Samples in flight on each engine", engine_names, registry=self.registry
        )
        self._engine_version = Gauge(
            "rollstream_engine_weight_version", "Each engine's last known weight version", engine_names,
            registry=self.registry,
        )
        self._engine_hit_rate = Gauge(
            "rollstream_engine_prefix_hit_rate", "Cached share of prompt tokens, where the engine reports it",
            engine_names, registry=self.registry,
        )
        self._engine_limit = Gauge(
            "rollstream_engine_limit", "Each engine's adaptive in-flight limit (samples), where it is limited",
            engine_names, registry=self.registry,
        )
        self._engine_kv_usage = Gauge(
            "rollstream_engine_kv_usage", "KV cache usage (0..1), where the engine reports it", engine_names,
            registry=self.registry,
        )
        self._lag = Gauge(
            "rollstream_loop_lag_seconds", "The event loop's largest lag since the previous scrape",
            names, registry=self.registry,
        ).labels(**labels)
        self._stalls = Histogram(
            "rollstream_loop_stall_seconds",
            "Stalls of the event loop over the threshold (user code blocking it), by length",
            names, buckets=(0.5, 1, 2, 5, 10, 30, 60, 300), registry=self.registry,
        ).labels(**labels)
        self._source_groups = Counter(
            "rollstream_source_groups_published", "Groups published, by named source (the namespace's mix)",
            [*names, "source"], registry=self.registry,
        )
        self._source_tokens = Counter(
            "rollstream_source_tokens_generated", "Response tokens of published groups, by named source",
            [*names, "source"], registry=self.registry,
        )
        self._bias_counts = Gauge(
            "rollstream_bias_prompts", "The namespace's bias ledger for its newest epoch: prompts per dimension, "
            "bucket and kind (fed, trained, dead, filtered, recycled; every producer exports the same)",
            [*names, "epoch", "dimension", "bucket", "kind"], registry=self.registry,
        )
        self._bias_shares = Gauge(
            "rollstream_bias_share", "Share of a bucket among the prompts fed or trained in the newest epoch "
            "(side: fed or trained); trained below 0.8x fed is flagged by take() and inspect",
            [*names, "epoch", "dimension", "bucket", "side"], registry=self.registry,
        )
        self._max_lag = 0.0
        self._engine: EngineClient | None = None
        self._seen_retries = 0
        self._seen_errors: dict[str, int] = {}

    def watch(self, stats: Callable[[], Heartbeat]) -> None:
        self.registry.register(StatsCollector(stats, self._labels))

    def attach(self, engine: EngineClient) -> None:
        self._engine = engine

    def request_started(self) -> None:
        self.in_flight.inc()

    def request_finished(self, seconds: float) -> None:
        self.in_flight.dec()
        self.latency.observe(seconds)

    def tokens_generated(self, count: int) -> None:
        self.tokens.inc(count)

    def group_published(self, group: Group) -> None:
        self.groups.inc()
        if group.source:
            self._source_groups.labels(**self._labels, source=group.source).inc()
            self._source_tokens.labels(**self._labels, source=group.source).inc(
                sum(s.response_length for s in group.samples)
            )

    def admission_blocked(self, reason: str) -> None:
        self._blocked.labels(**self._labels, reason=reason).inc()

    def admission_blocked_for(self, seconds: float) -> None:
        self._blocked_seconds.inc(seconds)

    def error(self, kind: str) -> None:
        self._errors.labels(**self._labels, kind=kind).inc()

    def loop_lag(self, seconds: float) -> None:
        self._max_lag = max(self._max_lag, seconds)

    def loop_stalled(self, seconds: float) -> None:
        self._stalls.observe(seconds)

    wants_bias = True

    def bias(self, fields: Mapping[str, int]) -> None:
        found = ledger(fields)
        self._bias_counts.clear()
        self._bias_shares.clear()
        if not found:
            return
        epoch = max(found)
        for name, buckets in found[epoch].items():
            for label, b in buckets.items():
                where = {**self._labels, "epoch": str(epoch), "dimension": name, "bucket": label}
                for kind in KINDS:
                    self._bias_counts.labels(**where, kind=kind).set(getattr(b, kind))
                self._bias_shares.labels(**where, side="fed").set(b.fed_share)
                self._bias_shares.labels(**where, side="trained").set(b.trained_share)

    def _sync_engine(self) -> None:
        """Fold the engine client's counters in (it counts; this module exports)."""
        if self._engine is None:
            return
        if self._engine.retries > self._seen_retries:
            self._retries.inc(self._engine.retries - self._seen_retries)
            self._seen_retries = self._engine.retries
        for kind, count in self._engine.errors.items():
            seen = self._seen_errors.get(kind, 0)
            if count > seen:
                self._errors.labels(**self._labels, kind=f"engine_{kind}").inc(count - seen)
                self._seen_errors[kind] = count
        self._engine_state.clear()  # engines leave; a state is 1 only where the engine is now
        self._engine_limit.clear()  # and a limit goes when the engine turns out to report no load
        self._engine_kv_usage.clear()
        for status in self._engine.fleet_status():
            engine = {**self._labels, "engine": status["url"]}
            self._engine_state.labels(**engine, state=status["state"]).set(1)
            self._engine_in_flight.labels(**engine).set(status["in_flight"])
            if status["version"] is not None:
                self._engine_version.labels(**engine).set(status["version"])
            if "prefix_hit_rate" in status:
                self._engine_hit_rate.labels(**engine).set(status["prefix_hit_rate"])
            for gauge, key in ((self._engine_limit, "limit"), (self._engine_kv_usage, "kv_usage")):
                if key in status:
                    gauge.labels(**engine).set(status[key])

    def render(self) -> bytes:
        self._sync_engine()
        self._lag.set(self._max_lag)
        self._max_lag = 0.0
        return generate_latest(self.registry)

    async def serve(self, host: str, port: int) -> web.AppRunner:
        async def handle(_: web.Request) -> web.Response:
            return web.Response(body=self.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.router.add_get("/metrics", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        logger.info("metrics on http://%s:%d/metrics", host, port)
        return runner
