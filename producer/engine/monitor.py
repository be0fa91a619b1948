"""The fleet monitor of one engine client: probes, loads, stalls, joining engines, the registry.

:class:`FleetMonitor` runs one task (started with the first request to a fleet of several, or
when an engine joins) that every ``health_interval`` probes the engines in trouble, each probe in
a task of its own (a hanging one holds up no other): the ejected and wedged ones for health (with
backoff), the busy ones without a reply for a wedge, the joining ones for their first answer, the
behind ones for their version (then :class:`~.versions.CatchUp`); it reads each engine's load
(adaptive concurrency, :mod:`.load`), stalls the engines silent past their bound and drops the
drained ones. It changes states through :class:`~.fleet.Fleet`, which tells the requests on an
engine taken out through their own await (:meth:`~.fleet.Engine.lost_signal`): it cancels only
its own tasks. Gateway workers (``GET /workers``) are read here for ``abort_all`` and tokenize.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping

from rollstream.common.errors import ConfigError
from rollstream.common.urls import check_url

from .discovery import INFO_BYTES, PROBE_ERRORS, gateway_workers
from .engine_state import JOINING_REASON, OUT, Engine, EngineState
from .fleet import Fleet
from .ids_json import ENCODER
from .load import LOAD_BYTES
from .settings import EngineSettings
from .transport import Transport
from .types import Dialect
from .weights import CatchUp, Versions, cancel_own

logger = logging.getLogger(__name__)

STALL_FACTOR = 8.0
"""An engine holding requests that answers none for this many times its mean request time (the
fleet's when it has none) is stalled: ``suspect``, out of routing, its requests sent elsewhere."""
STALL_FLOOR = 5.0
"""The stall bound's least seconds (a fleet of very short requests does not flap)."""
STALL_CAP_FRACTION = 0.25
"""The stall bound's most, as a fraction of ``request_timeout`` (well under it)."""
COLD_STALL_BOUND = 60.0
"""The stall bound, in seconds, while no engine has answered a generation yet (no mean to derive
it from): an engine that took every slot before its peers joined, then never answered, must not
hold the producer until ``request_timeout``. It doubles with each stall made under it, so a fleet
whose first generations are merely long is re-sent a few times at most, not forever."""
STALL_PAUSE = 15.0
"""Seconds a stalled engine stays out of routing, doubling with each stall (at most 300)."""
WORKERS_TTL = 10.0
"""Seconds a gateway's worker list is cached (workers come and go)."""


async def gather_probes(probe: Callable[[Engine], Awaitable[None]], engines: Iterable[Engine]) -> None:
    """Run ``probe`` on each engine at once (each bounded by its own timeout)."""
    engines = list(engines)
    if engines:
        results = await asyncio.gather(*(probe(e) for e in engines), return_exceptions=True)
        for engine, result in zip(engines, results, strict=True):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, BaseException):
                logger.warning("probe of %s failed: %r", engine.url, result)


class FleetMonitor:
    """Probes and reads the engines of one :class:`~.fleet.Fleet`; changes their states through it."""

    def __init__(self, fleet: Fleet, transport: Transport, dialect: Dialect, settings: EngineSettings,
                 versions: Versions, errors: dict[str, int]) -> None:
        self.fleet = fleet
        self.transport = transport
        self.dialect = dialect
        self.settings = settings
        self.versions = versions
        self.catch_up = CatchUp(versions)
        self.errors = errors
        """The client's error counts by kind (a stall counts ``engine_stalled``)."""
        self.task: asyncio.Task[None] | None = None
        """The monitor loop (None until started)."""
        self._probes: dict[str, asyncio.Task[None]] = {}
        """Engine URL -> its probe running now (each runs apart, so a hanging one delays no other)."""
        self._wake = asyncio.Event()
        self._next_load = 0.0
        self._cold_stalls = 0
        """Stalls made under the cold bound (each doubles it)."""

    def ensure(self) -> None:
        """Start the monitor loop unless it runs."""
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._loop(), name="engine-monitor")

    async def aclose(self) -> None:
        task, self.task = self.task, None
        probes = list(self._probes.values())
        self._probes.clear()
        await cancel_own([*probes, *([task] if task is not None else [])])
        await self.catch_up.aclose()

    def set_trainer_version(self, version: int, max_staleness: int) -> None:
        """The trainer's version (the producer's, at each admission): engines more than
        ``max_staleness`` behind it get no new requests (checked on a fresh version)."""
        if self.fleet.set_trainer_version(version, max_staleness) and any(
            self._version_due(e) or e.state is EngineState.BEHIND for e in self.fleet.engines.values()
        ):
            self.ensure()
            self._wake.set()

    def apply_registry(self, entries: Mapping[str, str]) -> None:
        """The engine registry's entries (URL -> ``active`` | ``draining``): see
        :meth:`Fleet.apply_registry`; an entry whose URL fails :func:`check_url` or whose state is
        neither is skipped with a warning naming it (a typo in the registry never kills a producer)."""
        valid: dict[str, str] = {}
        for url, state in entries.items():
            try:
                checked = check_url(url)
            except ConfigError as exc:
                logger.warning("engine registry entry %r skipped: %s", url, exc)
                continue
            if state not in ("active", "draining"):
                logger.warning("engine registry entry %r skipped: state %r is not active or draining", url, state)
                continue
            valid[checked] = state
        self.fleet.apply_registry(valid, self.settings.drain_timeout)
        self.ensure()

    def set_weights_source(self, weights: tuple[str, int] | None) -> None:
        """Where the trainer's current weights are (``Keys.weights``): what a behind engine loads
        with ``catch_up``."""
        if weights != self.catch_up.weights and weights is not None and any(
            e.state is EngineState.BEHIND for e in self.fleet.engines.values()
        ):
            self._wake.set()
        self.catch_up.weights = weights

    def take_out(self, url: str, why: str) -> bool:
        """Take the engine at ``url`` out of routing (its replies are unusable), unless it is the
        last routed one: True when it was (it is probed and rejoins as any ejected engine)."""
        engine = self.fleet.engines.get(url)
        if engine is None:
            return False
        out = self.fleet.take_out(engine, EngineState.EJECTED, why)
        if out:
            self.ensure()
        return out

    async def _loop(self) -> None:
        """Probe the engines in trouble every ``health_interval``: the ejected and wedged ones
        for health (with backoff), the busy ones without a reply for ``health_interval`` for a
        wedge, the behind ones for their version; drains past their timeout."""
        settings = self.settings
        probed = OUT | {EngineState.JOINING}
        adaptive = settings.adaptive_concurrency
        tick = min(settings.health_interval, settings.load_interval) if adaptive else settings.health_interval
        while True:
            now = time.monotonic()
            fleet = self.fleet
            fleet.drop_drained(now)
            due = [
                e for e in fleet.engines.values()
                if (e.state in probed and now >= e.next_probe)
                or (e.routed and e.attempts and now - e.last_reply >= settings.health_interval)
                or e.state is EngineState.BEHIND or self._version_due(e)
            ]
            self._check_stalls(now)
            loads: list[Engine] = []
            if adaptive and now >= self._next_load:
                self._next_load = now + settings.load_interval
                loads = [e for e in fleet.engines.values() if e.routed and e.load_path != ""]
            for engine in due:  # each probe on its own: one that hangs (a wedge) holds up no other
                if engine.url not in self._probes:
                    task = asyncio.create_task(self._probe_logged(engine), name=f"probe {engine.url}")
                    self._probes[engine.url] = task
                    task.add_done_callback(self._probe_ended)
            await gather_probes(self.read_load, loads)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(tick):
                    await self._wake.wait()
            self._wake.clear()

    def stall_bound(self, engine: Engine) -> float:
        """Seconds ``engine`` may hold requests without answering one before it is stalled:
        :data:`STALL_FACTOR` x its mean request time (the fleet's mean when it has answered none;
        :data:`COLD_STALL_BOUND`, doubled per stall made under it, while no engine has answered),
        at least :data:`STALL_FLOOR`, at most a quarter of ``request_timeout``."""
        cap = self.settings.request_timeout * STALL_CAP_FRACTION
        if self._cold:
            return min(COLD_STALL_BOUND * 2**self._cold_stalls, cap)
        base = engine.round_trip
        if base is None:
            times = [e.round_trip for e in self.fleet.engines.values() if e.round_trip is not None]
            base = sum(times) / len(times)
        return min(max(STALL_FLOOR, STALL_FACTOR * base), cap)

    @property
    def _cold(self) -> bool:
        """No engine has answered a generation yet."""
        return all(e.round_trip is None for e in self.fleet.engines.values())

    def _check_stalls(self, now: float) -> None:
        """Stall the routed engines silent past their bound; route again those whose pause is over."""
        fleet = self.fleet
        if len(fleet.engines) < 2:
            return
        for engine in list(fleet.engines.values()):
            if engine.stalled:
                if now >= engine.stalled_until:
                    fleet.unstall(engine)
                continue
            silent = engine.silent_for(now)
            if not silent or not engine.routed:
                continue
            bound = self.stall_bound(engine)
            if silent < bound:
                continue
            pause = min(300.0, STALL_PAUSE * 2**engine.stalls)
            cold = self._cold
            whose = "its" if engine.round_trip is not None else "the fleet's"
            rule = f"{STALL_FACTOR:g} x {whose} mean request time"
            if cold:
                rule = "no engine has answered yet: the cold bound"
            why = (f"{len(engine.attempts)} requests and no answer for {silent:.0f} s (its bound {bound:.0f} s: "
                   f"{rule}); no new requests for {pause:.0f} s, its requests sent elsewhere")
            if fleet.stall(engine, why, pause):
                self.errors["engine_stalled"] = self.errors.get("engine_stalled", 0) + 1
                self._cold_stalls += cold

    def _probe_ended(self, task: asyncio.Task[None]) -> None:
        for url, running in list(self._probes.items()):
            if running is task:
                del self._probes[url]

    async def _probe_logged(self, engine: Engine) -> None:
        try:
            await self._probe(engine)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a probe never ends the monitor; the next tick probes again
            logger.warning("probe of %s failed: %r", engine.url, exc)

    async def read_load(self, engine: Engine) -> None:
        """Read ``engine``'s load (the first of the dialect's load endpoints that answers, then
        that one) and move its in-flight limit (:mod:`.load`)."""
        endpoints = self.dialect.loads
        if engine.load_path:  # the one that answered before
            endpoints = tuple(e for e in endpoints if e.path == engine.load_path)
        seconds = min(5.0, self.settings.health_timeout)
        for endpoint in endpoints:
            path = endpoint.path
            try:
                status, raw = await self.transport.request("GET", engine.url + path, limit=LOAD_BYTES, seconds=seconds)
            except PROBE_ERRORS as exc:
                logger.debug("load of %s: %s failed: %s", engine.url, path, exc)
                if engine.load_path is None:  # never read: not held at the floor for it
                    self._no_load(engine, f"{path} failed: {type(exc).__name__}")
                return  # its health is judged elsewhere
            load = endpoint.parse(raw) if status == 200 else None
            if load is not None:
                break
        else:
            if engine.load_path is None:
                self._no_load(engine, "none of " + ", ".join(e.path for e in endpoints))
            return
        engine.load_path = path
        adaptive = engine.adaptive
        if adaptive is None:
            return
        before = adaptive.limit
        raised = adaptive.update(load, engine.in_flight, engine.held, time.monotonic(), engine.round_trip)
        engine.held, engine.load = False, load
        if adaptive.limit != before:
            logger.debug("engine %s: in-flight limit %s -> %s (%s)", engine.url, before, adaptive.limit, load)
        if raised:
            self.fleet.room_opened()

    def _no_load(self, engine: Engine, why: str) -> None:
        """``engine``'s load cannot be read: it is not limited (driven as without the option)."""
        engine.load_path = ""
        logger.info("engine %s reports no load (%s): no in-flight limit for it", engine.url, why)
        if engine.adaptive is not None:
            engine.adaptive.release()
            self.fleet.room_opened()

    def _version_due(self, engine: Engine) -> bool:
        """Whether ``engine``'s version is worth asking now: it looks behind the trainer on what
        is known, or it was never asked (a restarted engine is found before its first reply). In a
        fleet of one only with ``--catch-up-engines`` (else it is never taken out of routing)."""
        fleet = self.fleet
        if (fleet.trainer_version is None or not engine.routed
                or (len(fleet.engines) < 2 and not self.settings.catch_up)):
            return False
        never = engine.version is None and engine.has_model_info and engine.version_checked == -float("inf")
        return never or fleet.looks_behind(engine)

    def _probe_later(self, engine: Engine) -> None:
        """An engine out of routing that did not answer its probe: the next one later (doubling)."""
        engine.next_probe = time.monotonic() + min(30.0, self.settings.health_interval * 2**engine.out_count)

    async def _probe(self, engine: Engine) -> None:
        settings = self.settings
        fleet = self.fleet
        if engine.state is EngineState.BEHIND or self._version_due(engine):
            await self.versions.read_now(engine)
            self.catch_up.maybe(engine)
            return
        if engine.state is EngineState.JOINING:
            await self._probe_joining(engine)
            return
        try:
            status, _ = await self.transport.request(
                "GET", engine.url + "/health", limit=INFO_BYTES, seconds=settings.health_timeout
            )
        except TimeoutError:
            if engine.routed:
                why = (f"/health gave no answer within {settings.health_timeout:g} s while {len(engine.attempts)} "
                       f"requests had no reply for {time.monotonic() - engine.last_reply:.0f} s")
                fleet.take_out(engine, EngineState.WEDGED, why)
            else:
                self._probe_later(engine)
            return
        except PROBE_ERRORS as exc:
            if engine.routed:
                fleet.take_out(engine, EngineState.EJECTED, f"/health failed: {exc}")
            else:
                self._probe_later(engine)
            return
        if engine.routed:
            engine.last_reply = time.monotonic()  # alive: its requests are just long
            return
        if status == 200:
            await self.versions.read_now(engine)
            fleet.rejoin(engine, f"/health answered after {time.monotonic() - engine.since:.1f} s out")
        else:
            self._probe_later(engine)

    async def _probe_joining(self, engine: Engine) -> None:
        """A joining engine's ``/health``: any answer but a 5xx (a server without the endpoint
        answers 404) lets it join; none, a refusal or a 5xx: probed again later."""
        try:
            status, _ = await self.transport.request(
                "GET", engine.url + "/health", limit=INFO_BYTES, seconds=self.settings.health_timeout
            )
        except PROBE_ERRORS as exc:
            engine.reason = f"{JOINING_REASON}: {type(exc).__name__}: {exc}"[:300]
            self._probe_later(engine)
            return
        if status >= 500:
            engine.reason = f"{JOINING_REASON}: /health answered HTTP {status}"
            self._probe_later(engine)
            return
        await self.versions.read_now(engine)
        self.fleet.joined(engine, f"/health answered (HTTP {status}) {time.monotonic() - engine.since:.1f} s after "
                                  "it was added")

    async def workers(self, engine: Engine) -> list[str] | None:
        """Worker URLs if ``engine`` is an SGLang gateway, else None; cached for :data:`WORKERS_TTL`."""
        now = time.monotonic()
        if now - engine.workers_checked < WORKERS_TTL:
            return engine.workers
        engine.workers_checked = now
        answered, workers = await gateway_workers(self.transport, engine.url, self.settings.model_info_timeout)
        if not answered:
            return engine.workers  # keep what we knew
        if workers is not None and engine.workers is None:
            logger.info("%s is a gateway with workers %s", engine.url, ", ".join(workers) or "(none)")
        engine.workers = workers
        return engine.workers

    async def abort_all(self) -> None:
        """Ask every engine to abort its in-flight requests (best effort); behind a gateway,
        every worker it lists (the gateway does not route the abort)."""
        urls: list[str] = []
        for engine in list(self.fleet.engines.values()):
            engine.workers_checked = -float("inf")  # the freshest list
            workers = await self.workers(engine)
            urls.extend(workers if workers is not None else [engine.url])
        path = self.dialect.abort.path
        content = ENCODER.encode(self.dialect.abort.body or {})

        async def abort(url: str) -> None:
            try:
                status, _ = await self.transport.request("POST", url + path, content, limit=INFO_BYTES, seconds=5.0)
            except PROBE_ERRORS as exc:
                logger.warning("abort on %s failed: %s", url, exc)
                return
            if status != 200:
                logger.warning("abort on %s answered HTTP %d", url, status)

        await asyncio.gather(*(abort(url) for url in dict.fromkeys(urls)))
