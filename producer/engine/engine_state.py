"""One engine of the fleet as the client knows it: :class:`EngineState` (the states, described in
:mod:`.fleet`, which moves engines between them) and :class:`Engine` (its state, its requests in
flight, its counters, its adaptive in-flight limit and what the heartbeat shows of it).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from typing import Any

from .load import AdaptiveLimit, EngineLoad


class EngineState(enum.StrEnum):
    JOINING = "joining"
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    EJECTED = "ejected"
    WEDGED = "wedged"
    BEHIND = "behind"
    DRAINING = "draining"


ROUTED = frozenset({EngineState.HEALTHY, EngineState.SUSPECT})
"""The states that get new requests."""
OUT = frozenset({EngineState.EJECTED, EngineState.WEDGED})
"""The states probed for health until the engine answers (``joining`` is too, until its first answer)."""
JOINING_REASON = "no answered health probe yet"


class Engine:
    """One engine URL (credentials stripped), its state and what the client knows of it."""

    __slots__ = (
        "adaptive", "attempts", "cached_tokens", "catching_up", "drain_deadline", "errors", "failures",
        "has_model_info", "held", "in_flight", "last_answer", "last_reply", "load", "load_path", "lost",
        "next_probe", "out_count", "prompt_tokens", "reason", "registered", "removed", "replies", "round_trip",
        "since", "stalled", "stalled_until", "stalls", "state", "tokens", "url", "version", "version_checked",
        "workers", "workers_checked",
    )

    def __init__(self, url: str, *, registered: bool = False, concurrency_floor: int | None = None) -> None:
        self.url = url.rstrip("/")
        self.in_flight = 0
        self.version: int | None = None
        self.version_checked = -float("inf")
        self.has_model_info = True
        self.workers: list[str] | None = None
        """Worker URLs when this URL is a gateway, else None."""
        self.workers_checked = -float("inf")
        self.state = EngineState.HEALTHY
        self.reason = ""
        self.since = time.monotonic()
        self.failures = 0
        """Failed requests since its last good reply."""
        self.errors = 0
        self.replies = 0
        self.tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.last_reply = time.monotonic()
        """When a request on it last ended with an answer (a wedge shows as none for long)."""
        self.next_probe = 0.0
        self.out_count = 0
        """Times it was taken out of routing (the probe backoff grows with it)."""
        self.attempts: dict[object, float] = {}
        """Its requests in flight (one key each) and when each was sent."""
        self.last_answer = time.monotonic()
        """When a request on it last ended with a usable reply (probes do not move it)."""
        self.stalled = False
        """Holding requests with no answer past its bound: ``suspect`` and out of routing (:meth:`Fleet.stall`)."""
        self.stalled_until = 0.0
        self.stalls = 0
        self.lost: asyncio.Future[None] | None = None
        """Resolved when it is taken out with requests in flight: each request awaits it alongside its
        HTTP call (:meth:`lost_signal`) and is sent again elsewhere; then replaced for the next ones."""
        self.registered = registered
        """Came from the engine registry (dropped once drained when the registry forgets it)."""
        self.removed = False
        self.drain_deadline: float | None = None
        self.adaptive = AdaptiveLimit(concurrency_floor) if concurrency_floor is not None else None
        """Its in-flight limit from its own load (None: adaptive concurrency is off)."""
        self.held = False
        """A request waited for room on it since its load was last read (its limit binds)."""
        self.load: EngineLoad | None = None
        self.load_path: str | None = None
        """The load endpoint that answered; ``""``: none does (no limit then)."""
        self.round_trip: float | None = None
        """Mean seconds of its answered requests (moving average; adaptive concurrency's pace)."""
        self.catching_up = False
        """Held ``behind`` for a catch-up (``--catch-up-engines``): the trainer's weights load into it,
        or will once its requests ended; requests wait for it (:meth:`Fleet.wait_engine`)."""

    @property
    def limit(self) -> int | None:
        """Samples in flight at most now (None: not limited)."""
        return self.adaptive.limit if self.adaptive is not None else None

    def has_room(self, weight: int) -> bool:
        limit = self.limit
        if limit is None or self.in_flight == 0 or self.in_flight + weight <= limit:
            return True
        self.held = True
        return False

    @property
    def routed(self) -> bool:
        return self.state in ROUTED and not self.stalled

    def lost_signal(self) -> asyncio.Future[None]:
        """What a request sent to it now awaits beside its reply: resolved when it is taken out."""
        lost = self.lost
        if lost is None or lost.done():
            lost = self.lost = asyncio.get_running_loop().create_future()
        return lost

    def silent_for(self, now: float) -> float:
        """Seconds it has held requests without answering one (0 when it holds none)."""
        if not self.attempts:
            return 0.0
        return now - max(self.last_answer, min(self.attempts.values()))

    def status(self) -> dict[str, Any]:
        """What the heartbeat, ``inspect`` and the metrics show of it."""
        out: dict[str, Any] = {
            "url": self.url, "state": str(self.state), "in_flight": self.in_flight, "version": self.version,
            "errors": self.errors, "replies": self.replies, "tokens": self.tokens,
            "since_s": round(time.monotonic() - self.since, 1),
        }
        if self.reason:
            out["reason"] = self.reason
        if self.stalled:
            out["stalled"] = True
        if self.prompt_tokens:
            out["prefix_hit_rate"] = round(self.cached_tokens / self.prompt_tokens, 3)
        if self.limit is not None:
            out["limit"] = self.limit
        load = self.load
        if load is not None:
            if load.waiting is not None:
                out["engine_waiting"] = load.waiting
            if load.kv_usage is not None:
                out["kv_usage"] = round(load.kv_usage, 3)
        return out


@contextlib.contextmanager
def attempt(engine: Engine, key: object) -> Any:
    """Register a request in flight on ``engine`` under ``key`` (its stall clock and count)."""
    engine.attempts[key] = time.monotonic()
    try:
        yield
    finally:
        engine.attempts.pop(key, None)
