"""Each engine's weight version, and the catch-up of engines left behind (docs/engines.md).

:class:`Versions`: a version is read from the dialect's model-info endpoints (concurrent readers
share one read; cached for ``model_info_ttl``; best effort, a failure keeps the last good value);
a weight update's news (:meth:`Versions.moved`) holds requests back until every engine was read
again, so none is labelled from before it; a reply without a version is labelled from a read
(:meth:`Versions.label`). :class:`CatchUp`: ``--catch-up-engines`` loads the trainer's recorded
weights into an engine found behind, backing off when a reload answers success and does not take.
Both own their tasks and cancel them on ``aclose()``; nothing here cancels a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Sequence

from .discovery import FROM_REPLIES, FROM_TRAINER, INFO_BYTES, PROBE_ERRORS, probe_version_at
from .engine_state import Engine, EngineState
from .fleet import Fleet
from .ids_json import ENCODER
from .parse import json_object
from .settings import EngineSettings
from .transport import Transport
from .types import Dialect, Generation

logger = logging.getLogger(__name__)

CATCH_UP_TIMEOUT = 600.0
"""Seconds one step of a catch-up (a weight reload) may take."""
CATCH_UP_RETRY = 60.0
"""Seconds before a failed catch-up of an engine is tried again."""
CATCH_UP_RETRY_MAX = 900.0
"""Most seconds between the catch-ups of an engine whose reloads answer success and do not take
(the pause doubles from :data:`CATCH_UP_RETRY`)."""


async def cancel_own(tasks: Iterable[asyncio.Future[None]]) -> None:
    """Cancel and wait for tasks this module started (its own, never a caller's)."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task


class Versions:
    """The weight versions of one client's engines: reads, a weight update's news, reply labels."""

    def __init__(self, fleet: Fleet, transport: Transport, dialect: Dialect, settings: EngineSettings) -> None:
        self.fleet = fleet
        self.transport = transport
        self.dialect = dialect
        self.settings = settings
        self.settled = asyncio.Event()
        """Cleared from a weight update's news (:meth:`moved`) until every engine's version was read
        again: no request is sent meanwhile (each waits on it), so none is labelled from before it."""
        self.settled.set()
        self._paths: dict[str, str] = {}
        """Engine URL -> the endpoint that last gave its weight version."""
        self._from: dict[str, str] = {}
        """Engine URL -> where its last reply's versions came from (``weight_versions_from``)."""
        self._reads: dict[str, asyncio.Task[None]] = {}
        """Engine URL -> its read in flight (concurrent askers share it; dropped when it ends)."""
        self._reread: set[str] = set()
        """Engines whose last reply without a version was aborted (a weight update starts so): the
        next finished reply reads the version again, whatever was cached in between."""
        self._said_none: set[str] = set()
        """Engines named in the no-version warning (once each)."""
        self._moved_again = False
        self._paused = False
        self._news_at = -float("inf")
        """When the last news of a weight update came: a reply to a request sent before it is checked."""
        self._task: asyncio.Task[None] | None = None

    async def aclose(self) -> None:
        task, self._task = self._task, None
        await cancel_own([*self._reads.values(), *([task] if task is not None else [])])

    async def read(self, engine: Engine) -> int | None:
        """Best-effort weight version of ``engine``: cached for ``model_info_ttl`` seconds, else
        read from the dialect's model-info endpoints; a failure keeps the last good value."""
        reading = self._reads.get(engine.url)
        if reading is not None:  # a read in flight: wait for its answer rather than the value it replaces
            await asyncio.shield(reading)
            return engine.version
        now = time.monotonic()
        if not engine.has_model_info or now - engine.version_checked < self.settings.model_info_ttl:
            return engine.version
        engine.version_checked = now
        task = self._reads[engine.url] = asyncio.create_task(self._read(engine), name=f"version {engine.url}")
        task.add_done_callback(lambda done: self._read_ended(engine.url, done))
        await asyncio.shield(task)  # a cancelled asker leaves the read to the others (it is kept above)
        return engine.version

    def _read_ended(self, url: str, task: asyncio.Task[None]) -> None:
        if self._reads.get(url) is task:
            del self._reads[url]

    async def read_now(self, engine: Engine) -> int | None:
        """``engine``'s version read now, whatever is cached (a probe, a catch-up)."""
        engine.version_checked = -float("inf")
        return await self.read(engine)

    async def _read(self, engine: Engine) -> None:
        version, path, exists = await probe_version_at(
            self.transport, engine.url, self.dialect.version_paths, self.settings.model_info_timeout
        )
        if not exists:
            engine.has_model_info = False  # an engine with none of the endpoints: stop asking
            logger.info("%s has no model-info endpoint; weight versions come from the trainer", engine.url)
        elif version is not None:
            self._paths[engine.url] = path
            self.fleet.version_seen(engine, version)

    def before_send(self) -> dict[str, int | None]:
        """Each engine's version as known when a request is sent (None: unknown, read after the reply).
        An engine that aborted a reply since its last read may have new weights: unknown."""
        reread = self._reread
        return {url: None if url in reread else e.version for url, e in self.fleet.engines.items()}

    async def label(self, engine: Engine, generations: Sequence[Generation], sent: float,
                    before: dict[str, int | None]) -> None:
        """Give the generations of ``engine``'s reply that carry no version one (and the earlier one
        when the weights moved while it ran), and record where its versions came from."""
        aborted = any(g.finish_reason == "abort" for g in generations)
        missing = False
        asked: int | None = None
        earlier: int | None = None
        for generation in generations:
            if generation.weight_version is not None:
                continue
            if not missing:  # once per reply
                if not aborted and engine.url in self._reread:
                    engine.version_checked = -float("inf")
                    self._reread.discard(engine.url)
                earlier, asked = await self._for_reply(engine, sent, before.get(engine.url), aborted)
                missing = True
                if asked is None:
                    self._say_none([engine.url])
            generation.weight_version_before, generation.weight_version = earlier, asked
        if missing and aborted:
            self._reread.add(engine.url)
        where = f"GET {self._paths.get(engine.url, '?')}" if asked is not None else FROM_TRAINER
        self._from[engine.url] = where if missing else FROM_REPLIES

    async def _for_reply(
        self, engine: Engine, sent: float, before: int | None, aborted: bool = False
    ) -> tuple[int | None, int | None]:
        """``(earlier, version)`` of a reply that carried no version. ``before`` is the engine's
        version as known when the request was sent (a weight update's news has every engine read
        again before any request is sent). While no read started and no news came since it was
        sent (the cache is fresh), that stands; else the weights may have moved while it ran, and a read
        after the reply decides: the same version, or both (``earlier`` the older: nothing says
        where the change fell). An aborted reply's tokens came before the pause that aborted it:
        the version before stands."""
        replied = time.monotonic()
        if aborted and before is not None:
            return None, before
        if before is None or not engine.has_model_info:
            return None, await self.read(engine)
        if engine.version_checked < sent and self._news_at < sent:
            await self.read(engine)  # read only when the cache is past model_info_ttl
            if engine.version_checked < sent:
                return None, before
        after = await self._read_after(engine, replied)
        if after is None or after == before:
            return None, before
        return min(before, after), max(before, after)

    async def _read_after(self, engine: Engine, moment: float) -> int | None:
        """The engine's version from a read started at or after ``moment`` (reads in flight are shared)."""
        for _ in range(2):
            reading = self._reads.get(engine.url)
            if reading is not None:
                await asyncio.shield(reading)
            if engine.version_checked >= moment:
                return engine.version
            if reading is None:
                return await self.read_now(engine)
        return engine.version

    def moved(self, *, paused: bool = False) -> None:
        """News of a weight update: a pause (``paused``: while it lasts the versions cannot be
        known, so no request is sent), a resume or a new trainer version (every engine's version
        is read again, then requests go out)."""
        self._news_at = time.monotonic()
        self.settled.clear()
        self._paused = paused
        if paused:
            return
        if self._task is not None and not self._task.done():
            self._moved_again = True
            return
        self._moved_again = False
        self._task = asyncio.create_task(self._read_all(), name="versions-moved")

    async def _read_all(self) -> None:
        try:
            while True:
                engines = [e for e in self.fleet.engines.values() if e.has_model_info]
                await asyncio.gather(*(self.read_now(e) for e in engines), return_exceptions=True)
                if not self._moved_again:
                    break
                self._moved_again = False
        finally:
            if not self._paused:
                self.settled.set()

    @property
    def sources(self) -> str:
        """Where the weight versions come from, over the engines' last replies (before any reply:
        what :meth:`check` found); the heartbeat's ``weight_versions_from``."""
        return ", ".join(sorted(set(self._from.values())))

    async def check(self) -> None:
        """Once at start, on an API whose replies carry no version (OpenAI): ask every engine for
        its weight version, and say which give none (:meth:`_say_none`). On the native APIs the
        replies carry them; an engine whose reply has none and whose endpoint gives none is named
        at that first reply instead."""
        if self.dialect.replies_carry_versions:
            return
        engines = list(self.fleet.engines.values())
        versions = await asyncio.gather(*(self.read(e) for e in engines))  # one timeout in all
        silent = []
        for engine, version in zip(engines, versions, strict=True):
            if version is not None:
                self._from.setdefault(engine.url, f"GET {self._paths.get(engine.url, '?')}")
            else:
                silent.append(engine.url)
                self._from.setdefault(engine.url, FROM_TRAINER)
        self._say_none(silent)

    def _say_none(self, urls: list[str]) -> None:
        """A warning, once per engine: its samples get the trainer's version at admission
        (staleness is then counted from admission, not from the weights that generated them),
        and which API would give versions."""
        new = [url for url in urls if url not in self._said_none]
        if not new:
            return
        self._said_none.update(new)
        api = self.settings.api
        logger.warning(
            "engine(s) %s on --engine-api %s report no weight version at %s (or could not be asked)%s: "
            "their samples get the trainer's version at admission (weight_version_source "
            "trainer_at_admission); %s",
            ", ".join(new), api, ", ".join(f"GET {p}" for p in self.dialect.version_paths),
            " nor in their replies" if self.dialect.replies_carry_versions else "", self.dialect.version_hint,
        )


class CatchUp:
    """``--catch-up-engines``: load the trainer's recorded weights into engines found behind."""

    def __init__(self, versions: Versions) -> None:
        self.versions = versions
        self.weights: tuple[str, int] | None = None
        """Where the trainer's weights are (``Keys.weights``): path, version."""
        self._tasks: dict[str, asyncio.Task[None]] = {}
        """Engine URL -> its catch-up running now (dropped when it ends)."""
        self._after: dict[str, float] = {}
        self._failures: dict[str, int] = {}
        """Engine URL -> catch-ups in a row that answered success and left its version behind."""

    async def aclose(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        await cancel_own(tasks)

    def maybe(self, engine: Engine) -> None:
        """Start loading the recorded weights into ``engine`` when they are newer than its
        version, it is behind (or looks behind as the last routed engine: then held out of routing
        for it, :meth:`~.fleet.Fleet.hold_for_catch_up`), it is idle, and no catch-up of it runs or
        failed within a minute."""
        weights = self.weights
        fleet = self.versions.fleet
        if (not self.versions.settings.catch_up or weights is None or engine.url in self._tasks
                or time.monotonic() < self._after.get(engine.url, 0.0)
                or (engine.version is not None and weights[1] <= engine.version)):
            return
        if engine.state is not EngineState.BEHIND:
            if not (engine.routed and fleet.looks_behind(engine)):
                return
            # The last routed engine (version_seen moves any other): what it generates would be
            # recycled as stale, so it is held and its requests wait for the new weights.
            fleet.hold_for_catch_up(engine, f"at version {engine.version}, the trainer at {fleet.trainer_version} "
                                            f"(max_staleness {fleet.max_staleness}): held while version {weights[1]} "
                                            "loads into it (--catch-up-engines; the only routed engine)")
        if engine.in_flight:
            return  # its requests end first (a held engine's are sent again: they end at once)
        engine.catching_up = True
        task = asyncio.create_task(self._run(engine, *weights), name=f"catch-up {engine.url}")
        self._tasks[engine.url] = task
        task.add_done_callback(lambda _: self._tasks.pop(engine.url, None))

    async def _run(self, engine: Engine, path: str, version: int) -> None:
        why = "catch-up cancelled"
        try:
            why = await self._load(engine, path, version)
        finally:
            self.versions.fleet.catch_up_ended(engine, why)

    async def _load(self, engine: Engine, path: str, version: int) -> str:
        """Load ``path`` as ``version`` into ``engine``; why it is still behind if it is."""
        logger.warning("engine %s at version %s, behind: loading %s (version %d) into it (--catch-up-engines)",
                       engine.url, engine.version, path, version)
        started = time.monotonic()
        transport = self.versions.transport
        for step, body in self.versions.dialect.weights.catch_up_requests(path, version):
            try:
                status, raw = await transport.request("POST", engine.url + step, ENCODER.encode(body),
                                                      limit=INFO_BYTES, seconds=CATCH_UP_TIMEOUT)
            except PROBE_ERRORS as exc:
                status, raw = 0, f"{type(exc).__name__}: {exc}".encode()
            reply = json_object(raw) if status == 200 else None
            if status != 200 or (reply is not None and reply.get("success") is False):
                self._after[engine.url] = time.monotonic() + CATCH_UP_RETRY
                detail = raw.decode("utf-8", "replace")[:300]
                logger.warning("engine %s: catch-up failed at %s (HTTP %s: %s); tried again in %.0f s", engine.url,
                               step, status or "-", detail, CATCH_UP_RETRY)
                return (f"behind: catch-up failed at {step} (HTTP {status or '-'}); tried again in "
                        f"{CATCH_UP_RETRY:.0f} s, routed meanwhile as the only engine")
        await self.versions.read_now(engine)
        if engine.version is None or engine.version < version:
            # Answered success, version unmoved: without a pause every monitor tick would reload.
            failures = self._failures[engine.url] = self._failures.get(engine.url, 0) + 1
            delay = min(CATCH_UP_RETRY_MAX, CATCH_UP_RETRY * 2 ** (failures - 1))
            self._after[engine.url] = time.monotonic() + delay
            engine.reason = (f"behind: reload did not take (loaded {path}, version {version}; still at version "
                             f"{engine.version}); tried again in {delay:.0f} s")
            logger.warning("engine %s: %s", engine.url, engine.reason)
            return engine.reason
        self._failures.pop(engine.url, None)
        logger.warning("engine %s: loaded version %d in %.1f s, now at version %s", engine.url, version,
                       time.monotonic() - started, engine.version)
        return f"at version {engine.version} after its catch-up"
