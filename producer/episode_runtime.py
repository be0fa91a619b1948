"""The producer-wide part of the episodes (:class:`EpisodeRuntime`): engine slots (held only while
a request runs, so tool time frees them), the named limits, the counters the heartbeat and the tests
read (engine requests and episodes in flight, and their peaks), the requests-in-flight ages, and
the wait for the pipeline to resume after an abort; and the caps they run under (:class:`EpisodeLimits`,
``rollstream produce`` flags)."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from rollstream.common.checked import is_int
from rollstream.common.errors import ConfigError
from rollstream.common.protocol import parse_limits
from rollstream.common.settings_fields import option

from .durable import JournalStats
from .engine import EngineClient
from .episode import SamplingParams
from .shared_limits import SharedLimits
from .slots import Slots
from .telemetry import Metrics

RESUME_POLL = 0.5
"""Seconds between two checks of the pause flag while an aborted call waits for resume."""


async def _resumed_at_once() -> None:
    """The default resume wait (no pipeline to ask): continue at once."""


class Stoppable(Protocol):
    """A running durable episode, as a drain sees it (:meth:`~.session.EpisodeSession.stop_now`)."""

    def stop_now(self) -> None: ...


@dataclass(frozen=True, slots=True)
class EpisodeLimits:
    """The caps of a producer's episodes (``rollstream produce`` flags)."""

    engine_concurrency: int | None = option(
        None, parse=int, help="engine requests in flight at most (default: --concurrency); tool time holds none")
    named: Mapping[str, int] = option(
        flag="--limit", factory=dict, parse=str, repeat=True, metavar="NAME=K",
        convert=lambda specs: parse_limits(specs),
        help="a named concurrency limit for `async with episode.limit(NAME)` (repeatable)")
    episode_timeout: float | None = option(
        None, parse=float, help="seconds one episode may take in total; past it the sample fails (recycled)")
    max_context: int | None = option(
        None, parse=int, help="tokens an episode's trajectory may hold: max_new_tokens is clamped to the room left")

    def __post_init__(self) -> None:
        if self.engine_concurrency is not None and self.engine_concurrency < 1:
            raise ConfigError(f"engine concurrency must be at least 1, got {self.engine_concurrency!r}")
        for name, size in self.named.items():
            if not name or not name.isidentifier():
                raise ConfigError(f"limit name {name!r} must be an identifier (--limit name=K)")
            if not is_int(size) or size < 1:
                raise ConfigError(f"limit {name!r} must be a positive integer, got {size!r}")
        if self.episode_timeout is not None and not self.episode_timeout > 0:
            raise ConfigError(f"episode timeout must be positive, got {self.episode_timeout!r}")
        if self.max_context is not None and self.max_context < 1:
            raise ConfigError(f"max context must be at least 1 token, got {self.max_context!r}")


class EngineRequest:
    """:meth:`EpisodeRuntime.request`: an engine slot, the request's age, the metrics."""

    __slots__ = ("_count", "_runtime", "_started", "_token")

    def __init__(self, runtime: EpisodeRuntime, count: int) -> None:
        self._runtime = runtime
        self._count = count
        self._started = 0.0
        self._token = 0

    async def __aenter__(self) -> None:
        runtime, count = self._runtime, self._count
        await runtime.engine_slots.acquire(count)
        try:
            self._started = started = time.monotonic()
            self._token = token = next(runtime._request_tokens)
            runtime._requests_in_flight[token] = (started, count)
            for _ in range(count):
                runtime.metrics.request_started()
        except BaseException:
            runtime._requests_in_flight.pop(self._token, None)
            runtime.engine_slots.release(count)
            raise

    async def __aexit__(self, *exc: object) -> None:
        runtime, count = self._runtime, self._count
        try:
            del runtime._requests_in_flight[self._token]
            seconds = time.monotonic() - self._started
            for _ in range(count):
                runtime.metrics.request_finished(seconds)
        finally:
            runtime.engine_slots.release(count)


class EpisodeRuntime:
    """What all episodes of a producer share: the engine client, slots, limits and counters."""

    def __init__(
        self,
        engine: EngineClient,
        limits: EpisodeLimits | None = None,
        *,
        partial_rollout: bool = False,
        metrics: Metrics | None = None,
        wait_resumed: Callable[[], Awaitable[None]] = _resumed_at_once,
        on_reply: Callable[[str], None] | None = None,
    ) -> None:
        self.engine = engine
        self.on_reply = on_reply
        """Called with the engine's URL after every usable reply (the broken-engine count resets)."""
        self.limits = limits if limits is not None else EpisodeLimits()
        self.partial_rollout = partial_rollout
        self.metrics = metrics if metrics is not None else Metrics()
        self.wait_resumed = wait_resumed
        self.engine_slots = Slots(self.limits.engine_concurrency)
        self.named = {name: Slots(size) for name, size in self.limits.named.items()}
        self.episodes = 0
        """Episodes running now (inside the generate function)."""
        self.episodes_peak = 0
        self.episode_turns = 0
        """Engine calls made by episodes (continuations after an abort counted)."""
        self.aborts_continued = 0
        """Aborted engine calls continued in the session (partial rollout on)."""
        self._requests_in_flight: dict[int, tuple[float, int]] = {}
        self._request_tokens = itertools.count()
        self._sampling_of: Any = None
        self._sampling = SamplingParams(1)
        self._sampling_params: dict[str, Any] = {}
        self.journal = JournalStats()
        """Durable episodes: steps journaled, replayed, episodes resumed and diverged."""
        self.stopping = False
        """A drain with durable episodes: episodes stop at their next step boundary."""
        self.sessions: set[Stoppable] = set()
        """Durable episodes running now (so a drain can stop the ones between steps at once)."""
        self.shared: SharedLimits | None = None
        """The namespace's limits and rates (set by the producer runtime; None in-process)."""

    def stop_episodes(self) -> None:
        """A drain (durable episodes): every journaled episode stops at a step boundary. One
        between steps (in a tool, in user code) is cancelled now, its journal ends at its last
        finished step; one inside a step (an engine call, a ``once`` function) finishes and
        journals the step first. The prompts go back with their journals."""
        self.stopping = True
        for session in list(self.sessions):
            session.stop_now()

    @property
    def engine_requests(self) -> int:
        """Engine requests in flight now (a request for ``n`` samples counts ``n``)."""
        return self.engine_slots.busy

    def sampling(self) -> SamplingParams:
        """The producer's sampling parameters (frozen, so one object serves every episode; built
        again when the engine's settings object is replaced)."""
        s = self.engine.settings
        if self._sampling_of is not s:
            self._sampling = SamplingParams(s.max_new_tokens, s.temperature, s.top_p, dict(s.sampling_params))
            self._sampling_params = _sampling_dict(self._sampling)
            self._sampling_of = s
        return self._sampling

    def sampling_dict(self, sampling: SamplingParams) -> dict[str, Any]:
        """The engine's ``sampling`` mapping of ``sampling``: the producer's own built once (the
        client and the dialects copy it into each request, never change it)."""
        if sampling is self._sampling and self._sampling_of is self.engine.settings:
            return self._sampling_params
        return _sampling_dict(sampling)

    @contextlib.contextmanager
    def episode(self) -> Iterator[None]:
        """Around an episode's generate function: counted in ``episodes`` (and its peak) meanwhile."""
        self.episodes += 1
        if self.episodes > self.episodes_peak:
            self.episodes_peak = self.episodes
        try:
            yield
        finally:
            self.episodes -= 1

    def request(self, count: int = 1) -> contextlib.AbstractAsyncContextManager[None]:
        """One engine request for ``count`` samples: an engine slot, its age, the metrics."""
        return EngineRequest(self, count)

    def requests_older_than(self, seconds: float) -> tuple[int, float]:
        """(samples whose engine request is in flight for longer than ``seconds``, age of the
        oldest request in flight or 0): what the heartbeat reports, and inspect warns about."""
        now = time.monotonic()
        old = sum(count for started, count in self._requests_in_flight.values() if now - started > seconds)
        oldest = min((started for started, _ in self._requests_in_flight.values()), default=now)
        return old, now - oldest

    def limit(self, name: str) -> contextlib.AbstractAsyncContextManager[None]:
        """The producer-wide limit ``name`` (``--limit``) and the namespace's (``rollstream limits``):
        both when both are set, the namespace unit first (waiting for it holds no local slot)."""
        slots = self.named.get(name)
        shared = self.shared if self.shared is not None and self.shared.has_limit(name) else None
        if slots is None and shared is None and self.shared is not None and self.shared.is_removed(name):
            return contextlib.nullcontext()  # removed by `rollstream limits remove`: no longer applied
        if slots is None and shared is None:
            known = ", ".join(sorted({*self.named, *(self.shared.sizes if self.shared else ())})) or "none"
            raise KeyError(f"no limit named {name!r} (--limit {name}=K or rollstream limits set; configured: {known})")
        if shared is None:
            return slots.hold()  # type: ignore[union-attr]
        if slots is None:
            return shared.hold(name)
        return _both(shared.hold(name), slots.hold())

    async def rate(self, name: str) -> None:
        """A token of the namespace rate ``name`` (``rollstream limits set --rate``)."""
        if self.shared is not None and not self.shared.has_rate(name) and self.shared.is_removed(name):
            return  # removed by `rollstream limits remove`: no longer applied
        if self.shared is None or not self.shared.has_rate(name):
            raise KeyError(f"no namespace rate named {name!r} (rollstream init/limits set --rate {name}=R/s)")
        await self.shared.take(name)


@contextlib.asynccontextmanager
async def _both(
    first: contextlib.AbstractAsyncContextManager[None], second: contextlib.AbstractAsyncContextManager[None]
) -> AsyncIterator[None]:
    async with first, second:
        yield


def _sampling_dict(sampling: SamplingParams) -> dict[str, Any]:
    return sampling.engine_params()
