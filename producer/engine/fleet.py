"""The engine fleet of one producer: each engine's state and routing (:mod:`.monitor` probes them).

Engines are peers that fail one at a time (docs/engines.md, "The fleet"). Each has a state:

* ``joining``: in a fleet of several, an engine (at start, or added through the registry) gets no
  requests until it has answered a ``/health`` probe (any HTTP answer but a 5xx): one that accepts
  connections and never answers, or refuses them, costs no request its timeout.
* ``healthy``: gets requests; ``suspect``: a failure since its last good reply, still routed;
  or ``stalled``: it holds requests and has answered none for longer than a bound derived from
  its own reply times (the fleet's when it has none): no new requests, and its requests are sent
  again elsewhere; routed again after a pause (doubling), or at its next answer.
* ``ejected``: refused or reset a connection, or failed ``eject_after`` requests in a row (5xx,
  unusable replies); no new requests, its requests in flight are retried elsewhere, probed
  (``GET /health``) with backoff, back as ``suspect`` when it answers.
* ``wedged``: requests sit without a reply and a short ``/health`` probe gets no answer within
  ``health_timeout`` (a GPU or NCCL hang; independent of ``request_timeout``, since a generation
  may legitimately take an hour and a health check may not); treated as ejected.
* ``behind``: its weight version is more than ``max_staleness`` behind the trainer's (what it
  generates would be recycled as stale: restarted without the new weights?); probed for its
  version, back when it caught up. With ``--catch-up-engines`` an engine is also held ``behind``
  when it is the last routed one, while the trainer's weights load into it (``catching_up``):
  its requests are sent again once it caught up, and requests wait for it without the
  no-usable-engine clock (:meth:`Fleet.hold_for_catch_up`).
* ``draining``: the registry (or an operator) drains it: no new requests, the ones in flight
  finish, past ``drain_timeout`` they are retried elsewhere.

An engine is taken out of routing only while another usable one remains (a catch-up aside): the
last usable engine is retried with backoff as before, and only its failing after the retries is
fatal (a fleet with no usable engine at all).

Routing: requests that carry a key (a group's, and so every turn of its episodes) go to the
engine a consistent-hash ring names for it, unless that engine would then hold more than
``(1 + balance)`` x the mean load of the usable engines (plus :data:`AFFINITY_SLACK` samples:
consistent hashing with bounded loads, Mirrokni et al.): then the next one clockwise. The
samples of a group and the turns of an episode meet their prefix cache; no engine runs far above
the others. Requests without a key go to the
least-loaded usable engine. With adaptive concurrency (:mod:`.load`) an engine at its in-flight
limit is skipped like a full one; when every routed engine is at its limit, requests wait in the
client (:meth:`Fleet.wait_room`, first come first served) for one to end.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import enum
import hashlib
import logging
import math
import random
import time
import zlib
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from rollstream.common.backoff import Backoff
from rollstream.common.errors import EngineError

from .load import AdaptiveLimit, EngineLoad

logger = logging.getLogger(__name__)

RING_POINTS = 64
"""Points per engine on the hash ring, at least (spreads keys evenly over many engines)."""
RING_SIZE = 4096
"""Points on the ring of a small fleet: ``RING_SIZE // engines`` each, so two engines' shares of
the keys differ by a few per cent rather than ten (three runs of the bench's cache part: two
engines' prefix hit rate 0.99-1.0x one engine's, against 0.94-0.99x with 64 points each)."""
AFFINITY_SLACK = 8
"""Samples an engine may hold above the bounded load for its keys: at a light load the bound
alone would split every group (a first request sees a mean of 0.5); a group of up to 8 stays
together, and under load the slack is small beside ``balance`` x the mean."""


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


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class Fleet:
    """The engines of one client: states, routing and the ring (no I/O; the monitor probes)."""

    def __init__(self, urls: Iterable[str], *, eject_after: int = 3, balance: float = 0.25,
                 probe_backoff: Backoff | None = None, concurrency_floor: int | None = None,
                 registered: Iterable[str] = (), joining: bool = False) -> None:
        self.concurrency_floor = concurrency_floor
        """Adaptive concurrency's floor; None: off (no engine is ever limited)."""
        self.joining = joining
        """Engines join routing only after their first answered probe (a fleet of several)."""
        self.engines: dict[str, Engine] = {}
        for url in urls:
            engine = Engine(url, concurrency_floor=concurrency_floor)
            self.engines.setdefault(engine.url, engine)
        for url in registered:
            engine = Engine(url, registered=True, concurrency_floor=concurrency_floor)
            self.engines.setdefault(engine.url, engine)
        if joining:
            for engine in self.engines.values():
                engine.state, engine.reason = EngineState.JOINING, JOINING_REASON
        self.eject_after = eject_after
        self.balance = balance
        self._probe_backoff = probe_backoff or Backoff(1.0, 30.0)
        self.trainer_version: int | None = None
        self.max_staleness: int | None = None
        self.changed = asyncio.Event()
        """Set (and replaced) on every state change: a request waiting for a usable engine wakes."""
        self.transitions = 0
        self._room_waiters: deque[asyncio.Future[None]] = deque()
        self._ring: list[int] = []
        self._owners: list[Engine] = []
        self._rebuild()

    # -- routing ----------------------------------------------------------------------

    def _rebuild(self) -> None:
        per_engine = max(RING_POINTS, RING_SIZE // max(1, len(self.engines)))
        points = sorted((_point(f"{e.url}#{i}"), e.url) for e in self.engines.values() for i in range(per_engine))
        self._ring = [p for p, _ in points]
        self._owners = [self.engines[u] for _, u in points]

    def routed(self) -> list[Engine]:
        return [e for e in self.engines.values() if e.routed]

    def pick(self, key: str | None = None, weight: int = 1) -> Engine | None:
        """The engine for a request of ``weight`` samples (None: no engine is routed, or every
        routed one is at its in-flight limit: see :meth:`wait_room`)."""
        engines = self.engines
        if len(engines) == 1:
            only = next(iter(engines.values()))
            return only if only.routed and only.has_room(weight) else None
        usable = self.routed()
        if self.concurrency_floor is not None:
            usable = [e for e in usable if e.has_room(weight)]
        if not usable:
            return None
        if key is None or len(usable) == 1:
            least = min(e.in_flight for e in usable)
            return random.choice([e for e in usable if e.in_flight == least])
        bound = math.ceil((1 + self.balance) * (sum(e.in_flight for e in usable) + weight) / len(usable))
        bound += AFFINITY_SLACK
        ring, owners = self._ring, self._owners
        start = bisect.bisect(ring, zlib.crc32(key.encode()) << 32 | zlib.adler32(key.encode()))
        seen: set[str] = set()
        for i in range(len(ring)):
            engine = owners[(start + i) % len(ring)]
            if engine.url in seen or not engine.routed or not engine.has_room(weight):
                continue
            if engine.in_flight + weight <= bound:
                return engine
            seen.add(engine.url)
            if len(seen) == len(usable):
                break
        return min(usable, key=lambda e: e.in_flight)

    def any_routed(self) -> bool:
        return any(e.routed for e in self.engines.values())

    async def wait_engine(self, key: str | None, weight: int, *, no_engine: float, room: float) -> Engine:
        """The engine for a request once there is one: while every routed engine is at its
        in-flight limit, waits for a request to end (``room`` seconds at a time, first come first
        served); while none is routed, at most ``no_engine`` seconds for a state change (the clock
        stands still while an engine is held for a catch-up: its weight load is bounded on its
        own), then :class:`EngineError` naming each engine's state."""
        deadline = time.monotonic() + no_engine
        woken = False
        while (engine := self.pick(key, weight)) is None:
            if self.any_routed():  # all at their limits: not a fleet without engines
                woken = await self.wait_room(room, again=woken)
                deadline = time.monotonic() + no_engine
                continue
            if any(e.catching_up for e in self.engines.values()):  # loading the trainer's weights
                deadline = time.monotonic() + no_engine
            left = deadline - time.monotonic()
            if left <= 0:
                states = "; ".join(f"{e.url} {e.state}: {e.reason}" for e in self.engines.values())
                raise EngineError(f"no usable engine for {no_engine:g} s: {states or 'none'}")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 1.0)):
                    await self.changed.wait()
        return engine

    async def wait_room(self, seconds: float, *, again: bool = False) -> bool:
        """Wait (at most ``seconds``) for a request to end while every routed engine is at its
        limit; first come first served (``again``: woken before and beaten to the room, so first
        in line). True when woken, False on the timeout."""
        waiter = asyncio.get_running_loop().create_future()
        if again:
            self._room_waiters.appendleft(waiter)
        else:
            self._room_waiters.append(waiter)
        try:
            async with asyncio.timeout(seconds):
                await waiter
            return True
        except TimeoutError:
            return False
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.room_freed()  # woken, then cancelled: the next in line gets the room
            raise
        finally:
            if not waiter.done():
                waiter.cancel()
            with contextlib.suppress(ValueError):
                self._room_waiters.remove(waiter)

    def room_freed(self) -> None:
        """A request ended (or a limit rose): the first request waiting for room tries again."""
        waiters = self._room_waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def room_opened(self) -> None:
        """Limits rose or engines changed: every request waiting for room tries again."""
        waiters, self._room_waiters = self._room_waiters, deque()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    @property
    def waiting_for_room(self) -> int:
        return len(self._room_waiters)

    # -- what requests tell -----------------------------------------------------------

    def answered(self, engine: Engine, version: int | None = None) -> None:
        """A usable reply: its run of failures ends; a version from the reply is fresh news."""
        engine.failures = 0
        engine.replies += 1
        engine.last_reply = engine.last_answer = time.monotonic()
        if engine.stalled:
            engine.stalled = False
            self._wake()
        if engine.state is EngineState.SUSPECT:
            self._move(engine, EngineState.HEALTHY, "answered")
        if version is not None:
            self.version_seen(engine, version)

    def failed(self, engine: Engine, why: str, *, at_once: bool = False) -> bool:
        """A failed request (``at_once``: a refused or reset connection, no need to count): True
        when the engine was taken out of routing for it."""
        engine.errors += 1
        engine.failures += 1
        engine.last_reply = time.monotonic()
        if engine.state in OUT or engine.state in (EngineState.DRAINING, EngineState.JOINING):
            return True
        if at_once or engine.failures >= self.eject_after:
            detail = why if at_once else f"{engine.failures} failed requests in a row, last: {why}"
            return self.take_out(engine, EngineState.EJECTED, detail)
        if engine.state is EngineState.HEALTHY:
            self._move(engine, EngineState.SUSPECT, why)
        return False

    def take_out(self, engine: Engine, state: EngineState, why: str) -> bool:
        """Take ``engine`` out of routing (ejected, wedged) unless it is the last routed one;
        its requests in flight are cancelled and retried elsewhere. True when it was."""
        if engine.routed and not any(e.routed for e in self.engines.values() if e is not engine):
            if engine.state is EngineState.HEALTHY:
                self._move(engine, EngineState.SUSPECT, why)
            return False
        engine.out_count += 1
        engine.next_probe = time.monotonic() + self._probe_backoff.delay(engine.out_count - 1)
        self._move(engine, state, why)
        self.lose_requests(engine)
        return True

    def stall(self, engine: Engine, why: str, pause: float) -> bool:
        """``engine`` holds requests with no answer past its bound: out of routing (``suspect``,
        ``stalled``) for ``pause`` seconds, its requests sent again elsewhere; only while another
        routed engine has room (True when it was)."""
        if not engine.routed or not any(e.routed and e.has_room(1) for e in self.engines.values() if e is not engine):
            return False
        if engine.state is EngineState.SUSPECT:
            engine.reason = why
            logger.warning("engine %s: suspect: %s", engine.url, why)
        else:
            self._move(engine, EngineState.SUSPECT, why)
        engine.stalled, engine.stalled_until = True, time.monotonic() + pause
        engine.stalls += 1
        self._wake()
        self.lose_requests(engine)
        return True

    def unstall(self, engine: Engine) -> None:
        """A stalled engine's pause is over: routed again (``suspect`` until it answers)."""
        engine.stalled = False
        engine.reason = f"{engine.reason} (routed again after {time.monotonic() - engine.since:.0f} s)"
        logger.info("engine %s: stalled %.0f s, routed again (suspect until it answers)", engine.url,
                    time.monotonic() - engine.since)
        self._wake()

    def lose_requests(self, engine: Engine) -> None:
        """Tell the requests in flight on ``engine`` that it is out (each awaits :meth:`Engine.lost_signal`
        and sends itself again elsewhere; nothing is cancelled from here)."""
        lost, engine.lost = engine.lost, None
        if lost is not None and not lost.done():
            lost.set_result(None)

    def joined(self, engine: Engine, why: str) -> None:
        """A joining engine answered its first probe: routed (``healthy``), unless it is behind."""
        engine.failures = 0
        engine.last_reply = time.monotonic()
        if self._behind(engine):
            self._move(engine, EngineState.BEHIND, self._behind_reason(engine))
        else:
            self._move(engine, EngineState.HEALTHY, why)

    def rejoin(self, engine: Engine, why: str) -> None:
        """A probe answered: back in routing (``suspect`` until a reply), unless it is behind."""
        engine.failures = 0
        engine.last_reply = time.monotonic()
        if self._behind(engine):
            self._move(engine, EngineState.BEHIND, self._behind_reason(engine))
        else:
            self._move(engine, EngineState.SUSPECT, why)

    # -- versions ---------------------------------------------------------------------

    def set_trainer_version(self, version: int, max_staleness: int) -> bool:
        """The trainer's version (from admission): True when it moved (the monitor then checks
        the engines that now look behind before judging them on a cached version)."""
        moved = version != self.trainer_version or max_staleness != self.max_staleness
        self.trainer_version, self.max_staleness = version, max_staleness
        return moved

    def looks_behind(self, engine: Engine) -> bool:
        return self._behind(engine)

    def _behind(self, engine: Engine) -> bool:
        t, s, v = self.trainer_version, self.max_staleness, engine.version
        return t is not None and s is not None and v is not None and t - v > s

    def _behind_reason(self, engine: Engine) -> str:
        return (
            f"at version {engine.version}, the trainer at {self.trainer_version} (max_staleness "
            f"{self.max_staleness}): restarted without the new weights?"
        )

    def hold_for_catch_up(self, engine: Engine, why: str) -> None:
        """``engine`` is behind and a catch-up of it will run (``--catch-up-engines``): out of
        routing (``behind``) even as the last routed engine, its requests in flight sent again once
        an engine is routed (what it generates now would be recycled as stale), and no request
        fails for want of an engine while it is held (:meth:`wait_engine`)."""
        engine.catching_up = True
        if engine.state is not EngineState.BEHIND:
            self._move(engine, EngineState.BEHIND, why)
            self.lose_requests(engine)

    def catch_up_ended(self, engine: Engine, why: str) -> None:
        """The catch-up of ``engine`` ended. Caught up, it is routed again (:meth:`version_seen`
        did it); still behind and no other engine routed, it is routed again as it was before the
        hold (behind, but the only engine: a fleet without one would be fatal), ``why`` its reason."""
        engine.catching_up = False
        if engine.state is EngineState.BEHIND and not any(e.routed for e in self.engines.values() if e is not engine):
            self._move(engine, EngineState.SUSPECT, why)
        else:
            self._wake()

    def version_seen(self, engine: Engine, version: int) -> None:
        """A fresh version of ``engine`` (its reply or a probe): behind, or back from behind."""
        engine.version = version
        if self._behind(engine):
            if engine.routed and any(e.routed for e in self.engines.values() if e is not engine):
                self._move(engine, EngineState.BEHIND, self._behind_reason(engine))
        elif engine.state is EngineState.BEHIND:
            self._move(engine, EngineState.HEALTHY, f"caught up: at version {version}")

    # -- the registry -----------------------------------------------------------------

    def apply_registry(self, entries: Mapping[str, str], drain_timeout: float) -> None:
        """The registry's engines (URL -> ``active`` | ``draining``): new ones join, drained ones
        drain; registry engines it no longer lists drain and are dropped once idle."""
        now = time.monotonic()
        listed = {url.rstrip("/"): state for url, state in entries.items()}
        changed = False
        for url, state in listed.items():
            engine = self.engines.get(url)
            if engine is None:
                if state != "active":
                    continue
                engine = self.engines[url] = Engine(url, registered=True, concurrency_floor=self.concurrency_floor)
                engine.state, engine.reason = EngineState.JOINING, JOINING_REASON  # routed once it answers
                changed = True
                logger.warning("engine %s joined (registry)", url)
                self._wake()
            elif state == "active" and engine.state is EngineState.DRAINING:
                engine.removed, engine.drain_deadline = False, None
                self._move(engine, EngineState.SUSPECT, "active again in the registry")
            if state == "draining":
                self.drain(engine, drain_timeout, now)
        for engine in list(self.engines.values()):
            if engine.registered and engine.url not in listed:
                engine.removed = True
                self.drain(engine, drain_timeout, now)
        if changed:
            self._rebuild()

    def drain(self, engine: Engine, drain_timeout: float, now: float) -> None:
        if engine.state is not EngineState.DRAINING:
            engine.drain_deadline = now + drain_timeout
            self._move(engine, EngineState.DRAINING, "removed from the registry" if engine.removed else "drained")

    def drop_drained(self, now: float) -> None:
        """Registry engines drained and idle are dropped; past its deadline a drain retries the
        requests still in flight elsewhere."""
        dropped = False
        for engine in list(self.engines.values()):
            if engine.state is not EngineState.DRAINING:
                continue
            if engine.drain_deadline is not None and now >= engine.drain_deadline and engine.attempts:
                logger.warning("engine %s: drain timeout, %d requests retried elsewhere", engine.url,
                               len(engine.attempts))
                self.lose_requests(engine)
            if engine.removed and engine.in_flight == 0 and len(self.engines) > 1:
                del self.engines[engine.url]
                dropped = True
                logger.warning("engine %s left (drained)", engine.url)
        if dropped:
            self._rebuild()

    # -- bookkeeping ------------------------------------------------------------------

    def _move(self, engine: Engine, state: EngineState, why: str) -> None:
        if engine.state is state:
            return
        engine.stalled = False  # a new state is judged afresh (stall() sets it after its move)
        if state is not EngineState.BEHIND:
            engine.catching_up = False  # back from behind, however (a catch-up ends with it)
        before = engine.state
        engine.state, engine.since = state, time.monotonic()
        engine.reason = why if state is not EngineState.HEALTHY else ""
        self.transitions += 1
        log = logger.info if state in (EngineState.HEALTHY, EngineState.SUSPECT) else logger.warning
        log("engine %s: %s -> %s: %s", engine.url, before, state, why)
        self._wake()

    def _wake(self) -> None:
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()
        self.room_opened()

    def status(self, limit: int = 64) -> list[dict[str, Any]]:
        """Each engine's status; past ``limit`` engines only those not healthy (at most
        ``limit``): a heartbeat of a thousand-engine fleet stays small."""
        engines = list(self.engines.values())
        if len(engines) > limit:
            engines = [e for e in engines if e.state is not EngineState.HEALTHY][:limit]
        return [e.status() for e in engines]


@contextlib.contextmanager
def attempt(engine: Engine, key: object) -> Any:
    """Register a request in flight on ``engine`` under ``key`` (its stall clock and count)."""
    engine.attempts[key] = time.monotonic()
    try:
        yield
    finally:
        engine.attempts.pop(key, None)
