"""The producer's heartbeat: what it reports every ``heartbeat_interval`` (the
:class:`~rollstream.common.heartbeat.Heartbeat` written to the namespace's ``producers`` hash, read
by ``inspect``, the consumer's diagnosis and the metrics), and the periodic turn that writes it.

The turn also follows the engine registry (``--engines-from-registry``) and the trainer's weights
(``--catch-up-engines``), and refreshes the bias gauges when metrics are served. Admission's time
blocked is accounted here (:meth:`Pulse.blocked`) because the heartbeat reports it: each beat
carries the milliseconds blocked since the previous one.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Protocol

from rollstream.common.connection import redact_url
from rollstream.common.events import now_ms
from rollstream.common.logs import Prefixed
from rollstream.common.protocol import Control, EngineRegistry, Heartbeat, Heartbeats, TrainerMonitor
from rollstream.common.watchdog import LoopWatchdog

from .capacity import WorkTable
from .engine import EngineClient
from .rollout import Rollout
from .settings import ProducerSettings
from .telemetry import Metrics


class Beating(Protocol):
    """What the heartbeat reads of its producer (:class:`~.worker.Producer`): public members only."""

    @property
    def table(self) -> WorkTable: ...
    @property
    def name(self) -> str: ...
    @property
    def started(self) -> float: ...
    @property
    def log(self) -> Prefixed: ...
    @property
    def settings(self) -> ProducerSettings: ...
    @property
    def engine(self) -> EngineClient: ...
    @property
    def rollout(self) -> Rollout: ...
    @property
    def watchdog(self) -> LoopWatchdog: ...
    @property
    def metrics(self) -> Metrics: ...
    @property
    def heartbeats(self) -> Heartbeats: ...
    @property
    def monitor(self) -> TrainerMonitor: ...
    @property
    def control(self) -> Control: ...
    @property
    def registry(self) -> EngineRegistry: ...
    @property
    def payload_stats(self) -> dict[str, int]: ...


class Pulse:
    """The heartbeat of one :class:`~.worker.Producer`, assembled from its state and its engine's,
    rollout's and watchdog's counters."""

    def __init__(self, producer: Beating) -> None:
        self.producer = producer
        self._blocked_since: float | None = None
        self._blocked_total = 0.0
        self._blocked_reported = 0.0
        self._refusal = ""
        self._refusal_since_ms = 0
        self._publish_times: list[float] = []
        self._registry_skipped: set[str] = set()

    def blocked(self, blocked: bool, reason: str = "") -> None:
        """Admission's answer: refused (``reason``, the ADMIT status) or not; timed for the beats."""
        now = time.monotonic()
        if blocked and self._blocked_since is None:
            self._blocked_since = now
        elif not blocked and self._blocked_since is not None:
            self._blocked_total += now - self._blocked_since
            self._blocked_since = None
        if reason != self._refusal:
            self._refusal = reason
            self._refusal_since_ms = now_ms() if reason else 0

    def group_published(self) -> None:
        self._publish_times.append(time.monotonic())

    def _groups_last_minute(self) -> int:
        cutoff = time.monotonic() - 60
        self._publish_times = [t for t in self._publish_times if t >= cutoff]
        return len(self._publish_times)

    def assemble(self) -> tuple[Heartbeat, int]:
        """The heartbeat as of now, and the milliseconds admission was blocked since the last one
        (the loop's largest lag starts over)."""
        if self._blocked_since is not None:
            now = time.monotonic()
            self._blocked_total += now - self._blocked_since
            self._blocked_since = now
        blocked_ms = int((self._blocked_total - self._blocked_reported) * 1000)
        return self.stats(take_lag=True), blocked_ms

    def stats(self, *, take_lag: bool = False) -> Heartbeat:
        """The producer's stats as of now (what the heartbeat carries, and what a scrape of its
        Prometheus series reads); nothing starts over unless ``take_lag``."""
        p = self.producer
        runtime, watchdog, engine = p.rollout.runtime, p.watchdog, p.engine
        long_requests, oldest_request = p.rollout.requests_older_than(p.settings.long_request_after)
        lag = watchdog.take_max_lag() if take_lag else watchdog.max_lag
        return Heartbeat(
            host=socket.gethostname(),
            pid=os.getpid(),
            state=p.table.state,
            in_flight_samples=p.table.in_flight_samples,
            in_flight_prompts=len(p.table),
            concurrency=p.settings.concurrency,
            published=p.table.published,
            groups_last_minute=self._groups_last_minute(),
            duplicates=p.table.duplicates,
            reclaimed=p.table.reclaimed,
            engine_retries=engine.retries,
            engines=[redact_url(u) for u in engine.settings.all_urls],
            started_ms=int(p.started * 1000),
            last_seen_ms=now_ms(),
            admission=self._refusal,
            admission_since_ms=self._refusal_since_ms,
            long_requests=long_requests,
            oldest_request_s=round(oldest_request, 1),
            long_request_s=p.settings.long_request_after,
            episodes=runtime.episodes,
            episodes_peak=runtime.episodes_peak,
            engine_requests=runtime.engine_requests,
            engine_requests_peak=runtime.engine_slots.peak,
            episodes_failed=p.rollout.episodes_failed,
            aborts_continued=runtime.aborts_continued,
            journal_steps=runtime.journal.journaled,
            replayed_steps=runtime.journal.replayed,
            episodes_resumed=runtime.journal.resumed,
            resume_diverged=runtime.journal.diverged,
            payload_objects_put=p.payload_stats["objects_put"],
            payload_bytes_put=p.payload_stats["bytes_put"],
            payload_put_failures=p.payload_stats["put_failures"],
            payload_orphans_swept=p.payload_stats["orphans_swept"],
            engine_fleet=engine.fleet_status(),
            loop_stalls=watchdog.stalls,
            loop_stall_s=round(watchdog.stall_seconds, 2),
            loop_stall_longest_s=watchdog.longest.seconds if watchdog.longest else 0.0,
            loop_stall_where=watchdog.longest.describe() if watchdog.longest else "",
            loop_lag_max_s=round(lag, 3),
            loop_stall_after_s=watchdog.threshold,
            weight_versions_from=engine.versions_from,
        )

    async def write(self) -> None:
        """Write one heartbeat (the blocked time it carries counted as reported once written)."""
        p = self.producer
        beat, blocked_ms = self.assemble()
        await p.heartbeats.write(p.name, beat, blocked_ms)
        self._blocked_reported += blocked_ms / 1000
        if blocked_ms > 0:
            p.metrics.admission_blocked_for(blocked_ms / 1000)

    async def loop(self) -> None:
        await self.producer.table.outage.forever(self.turn, wrote=True)  # a write Redis refuses at maxmemory

    async def turn(self) -> bool:
        p = self.producer
        await asyncio.sleep(p.settings.heartbeat_interval)
        await self.follow_registry()
        await self.follow_weights()
        await self.write()
        if p.metrics.wants_bias:
            p.metrics.bias(await p.monitor.bias())
        return True

    async def follow_weights(self) -> None:
        """Where the trainer's weights are, for engines found behind (``--catch-up-engines``)."""
        p = self.producer
        if p.engine.settings.catch_up:
            p.engine.set_weights_source(await p.control.weights())

    async def follow_registry(self) -> None:
        """The engine registry's changes to the fleet (``--engines-from-registry``); an entry that
        cannot be used is skipped, with a warning once."""
        p = self.producer
        if not p.settings.engines_from_registry:
            return
        entries = await p.registry.entries()
        for url, entry in entries.items():
            problem = entry.problem
            if problem and url not in self._registry_skipped:
                self._registry_skipped.add(url)
                p.log.warning("engine registry entry %r skipped: %s", url, problem)
        p.engine.apply_registry({url: e.state for url, e in entries.items() if not e.problem})
