"""What a producer reports about itself, as a typed interface with a no-op default.

:class:`Metrics` does nothing; :class:`rollstream.producer.metrics.ProducerMetrics` exports the
same calls to Prometheus. The producer and the rollout always hold one (never ``None``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from rollstream.common.heartbeat import Heartbeat
from rollstream.common.models import Group


class Metrics:
    """The producer's instrumentation points; every method is a no-op here."""

    def request_started(self) -> None:
        """An engine request for one sample started."""

    def request_finished(self, seconds: float) -> None:
        """An engine request for one sample finished after ``seconds``."""

    def tokens_generated(self, count: int) -> None:
        """``count`` response tokens came back from the engine."""

    def group_published(self, group: Group) -> None:
        """``group`` was published to the group stream."""

    def admission_blocked(self, reason: str) -> None:
        """An admission attempt was refused (``paused``, ``backlog`` or ``staleness``)."""

    def admission_blocked_for(self, seconds: float) -> None:
        """Admission was refused for ``seconds`` since the last heartbeat."""

    def error(self, kind: str) -> None:
        """An error of ``kind`` happened."""

    def loop_lag(self, seconds: float) -> None:
        """The event loop woke ``seconds`` late (measured every tick by the watchdog)."""

    def loop_stalled(self, seconds: float) -> None:
        """The event loop stood still ``seconds``, over the stall threshold (a stall ended)."""

    def watch(self, stats: Callable[[], Heartbeat]) -> None:
        """The producer's stats (each :class:`~rollstream.common.heartbeat.Heartbeat` field), read
        when they are wanted: at each scrape."""

    wants_bias = False
    """Whether :meth:`bias` is wanted: the producer then reads the namespace's bias ledger every
    heartbeat (one HGETALL of the state hash), else never."""

    def bias(self, fields: Mapping[str, int]) -> None:
        """The namespace's bias ledger (:mod:`rollstream.common.bias`: the state hash's fields)."""
