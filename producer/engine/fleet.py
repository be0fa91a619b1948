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

Routing (which engine a request goes to, and the wait for room) is :mod:`.routing`; an
engine's own record, :mod:`.engine_state`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from rollstream.common.backoff import Backoff
from rollstream.common.errors import EngineError

from .engine_state import JOINING_REASON, OUT, Engine, EngineState
from .routing import Router

logger = logging.getLogger(__name__)


class Fleet:
    """The engines of one client: their states and the moves between them, and routing through
    its :class:`~.routing.Router` (no I/O; the monitor probes)."""

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
        self._probe_backoff = probe_backoff or Backoff(1.0, 30.0)
        self.trainer_version: int | None = None
        self.max_staleness: int | None = None
        self.changed = asyncio.Event()
        """Set (and replaced) on every state change: a request waiting for a usable engine wakes."""
        self.transitions = 0
        self.router = Router(self.engines.values(), balance=balance, limited=concurrency_floor is not None)

    # -- routing ----------------------------------------------------------------------

    def routed(self) -> list[Engine]:
        return [e for e in self.engines.values() if e.routed]

    def pick(self, key: str | None = None, weight: int = 1) -> Engine | None:
        """The engine for a request of ``weight`` samples (None: no engine is routed, or every
        routed one is at its in-flight limit: see :meth:`wait_room`)."""
        return self.router.pick(self.engines, key, weight)

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
        limit (:meth:`Router.wait_room`)."""
        return await self.router.wait_room(seconds, again=again)

    def room_freed(self) -> None:
        self.router.room_freed()

    def room_opened(self) -> None:
        self.router.room_opened()

    @property
    def waiting_for_room(self) -> int:
        return self.router.waiting_for_room

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
            self.router.rebuild(self.engines.values())

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
            self.router.rebuild(self.engines.values())

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


