"""Why a ``take()`` waits: the stall clock, the stale streak and the one-line diagnosis; no I/O.

The consumer reads a :class:`~rollstream.common.protocol.Diagnosis` in one pipelined round trip
and hands it here; nothing in this module does I/O.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from rollstream.common.admission import at_maxmemory, memory_deadlock, wait_cause
from rollstream.common.config import PipelineConfig
from rollstream.common.events import Event, now_ms, unrecovered
from rollstream.common.heartbeat import fold
from rollstream.common.keys import StateField
from rollstream.common.models import Group
from rollstream.common.namespace import state_int
from rollstream.common.protocol import Diagnosis, live_producers

from .verdict import Cause, StaleContext, Verdict, stale_reportable


@dataclass(slots=True)
class StallClock:
    """Seconds without a live producer, on the consumer's clock: it lives in the consumer, not in
    one ``take()``, so short calls (``asyncio.timeout``) add up."""

    since: float | None = None
    checked: float = -math.inf
    """When it was last ticked (``time.monotonic()``)."""

    def tick(self, alive: int) -> float:
        """Seconds without a live producer (0 while one is alive)."""
        now = time.monotonic()
        self.checked = now
        if alive:
            self.since = None
            return 0.0
        if self.since is None:
            self.since = now
        return now - self.since


@dataclass(slots=True)
class StaleStreak:
    """Groups recycled as stale in a row with no usable group in between (across takes)."""

    since: float
    since_ms: int
    oldest: int
    newest: int
    trainer: int
    limit: int
    count: int = 0
    reported: float = -math.inf

    def add(self, oldest: int, newest: int, trainer: int, limit: int) -> None:
        self.count += 1
        self.oldest, self.newest = min(self.oldest, oldest), max(self.newest, newest)
        self.trainer, self.limit = trainer, limit

    def describe(self) -> str:
        versions = str(self.oldest) if self.oldest == self.newest else f"{self.oldest}..{self.newest}"
        return (
            f"groups are being recycled as stale: {self.count} in a row over {time.monotonic() - self.since:.0f} s, "
            f"none usable; the engines generated them at weight version {versions} while the trainer is at "
            f"{self.trainer} (max_staleness {self.limit}): do the new weights reach the engines?"
        )

    def record(self, reported_ms: int) -> dict[str, int]:
        """The ``StateField.STALE`` fields ``inspect`` shows."""
        return {
            StateField.STALE_STREAK: self.count, StateField.STALE_SINCE_MS: self.since_ms,
            StateField.STALE_REPORTED_MS: reported_ms, StateField.STALE_ENGINE_OLDEST: self.oldest,
            StateField.STALE_ENGINE_NEWEST: self.newest, StateField.STALE_TRAINER_VERSION: self.trainer,
        }


@dataclass(slots=True)
class StaleWatch:
    """The consumer's stale streak across takes: the groups recycled as stale since the last usable
    one (None: the last group was usable), and whether any group was ever fresh."""

    batch_size: int
    streak: StaleStreak | None = None
    fresh_seen: bool = False

    def context(self) -> StaleContext:
        """What :func:`.verdict.judge` needs to know of the streak."""
        return StaleContext(self.fresh_seen, 0 if self.streak is None else self.streak.count)

    def saw(self, verdict: Verdict, version: int, limit: int | None) -> None:
        """Follow one verdict: a stale group extends the streak, a fresh one ends it."""
        if verdict.cause == Cause.STALE and verdict.group is not None and limit is not None:
            self._add(verdict.group, version, limit)
        elif verdict.cause.fresh:
            self.streak = None  # a fresh group: whatever went stale before, weights reach the engines
            self.fresh_seen = True

    @property
    def reportable(self) -> StaleStreak | None:
        """The streak when it is long enough to report (:func:`.verdict.stale_reportable`)."""
        streak = self.streak
        return streak if streak is not None and stale_reportable(streak.count, self.batch_size) else None

    def _add(self, group: Group, version: int, limit: int) -> None:
        versions = [v for s in group.samples for v in s.weight_versions]
        oldest, newest = (min(versions), max(versions)) if versions else (0, 0)
        if self.streak is None:
            self.streak = StaleStreak(time.monotonic(), now_ms(), oldest, newest, version, limit)
        self.streak.add(oldest, newest, version, limit)


def alive_producers(diagnosis: Diagnosis, config: PipelineConfig) -> tuple[int, int]:
    """(producers alive, in-flight samples of the alive ones) when the diagnosis was read."""
    return live_producers(diagnosis.heartbeats, diagnosis.now_ms, config.heartbeat_timeout)


def unrecovered_failure(diagnosis: Diagnosis) -> Event | None:
    """The newest producer failure when no group was published after it."""
    event = diagnosis.fatal
    if event is not None and unrecovered(event.ts_ms, state_int(diagnosis.state, StateField.LAST_PUBLISH_MS)):
        return event
    return None


def deadlock_at_maxmemory(diagnosis: Diagnosis, batch_size: int) -> str | None:
    """Why nothing can move at ``maxmemory`` (``common.admission.memory_deadlock``), or None."""
    in_flight_prompts = diagnosis.terms.outstanding - diagnosis.terms.ready
    return memory_deadlock(
        diagnosis.memory, prompts_waiting=max(0, diagnosis.queued - in_flight_prompts),
        in_flight_prompts=in_flight_prompts, groups_held=diagnosis.groups_length, batch_size=batch_size,
    )


def wait_summary(
    diagnosis: Diagnosis,
    config: PipelineConfig,
    *,
    last_error: str,
    stale: str | None,
    deadlock: str | None = None,
) -> str:
    """One line for a waiting take's warning: the likeliest cause first
    (``common.admission.wait_cause``, or the stale streak's description when it is reportable; a
    deadlock at maxmemory before both, and Redis at maxmemory named), then the pipeline's figures."""
    fleet = fold(diagnosis.heartbeats, diagnosis.now_ms, config.heartbeat_timeout)
    alive, in_flight = len(fleet.alive), fleet.in_flight
    terms = diagnosis.terms
    queued = diagnosis.queued
    in_flight_prompts = terms.outstanding - terms.ready
    paused = diagnosis.state.get(StateField.PAUSED, "0") == "1"
    cause = stale if stale is not None else wait_cause(
        producers_alive=alive, paused=paused, prompts_waiting=max(0, queued - in_flight_prompts),
        in_flight_prompts=in_flight_prompts, ready=terms.ready,
        refusals=fleet.refusals,
        terms=terms if config.admission_enabled else None,
        engine_retries=sum(m.beat.engine_retries for m in fleet.alive if m.beat is not None), last_error=last_error,
    )
    if deadlock is not None:
        cause = deadlock
    elif at_maxmemory(diagnosis.memory):
        cause = f"Redis is at maxmemory (writes refused, backing off until commits free memory); {cause}"
    troubled = {
        f"engine {e.get('url')} {e.get('state')}: {e.get('reason', '')}"
        for m in fleet.alive if m.beat is not None for e in m.beat.troubled_engines()
        if e.get("state") in ("ejected", "wedged", "behind")
    }
    engines = f"; {'; '.join(sorted(troubled)[:3])}" if troubled else ""
    return (
        f"{cause} (backlog {diagnosis.groups_length}, prompts queued {queued}, in flight {in_flight} samples, "
        f"live producers {alive}, paused {paused}){engines}"
    )

