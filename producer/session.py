"""The episode engine session behind :mod:`.episode`: token-in/token-out calls, caps, validation.

:class:`EpisodeRuntime` is the producer-wide part: engine slots (held only while a request runs,
so tool time frees them), the named limits, the counters the heartbeat and the tests read
(engine requests and episodes in flight, and their peaks), the requests-in-flight ages, and the
wait for the pipeline to resume after an abort. :class:`EpisodeSession` is one episode (the
:class:`~.episode.Episode` a generate function gets) and :class:`_Trajectory` one token
sequence of it, whose tokens, loss mask, log-probs, versions and version spans grow together,
so they cannot drift apart. :func:`~.checks.check_sample` is the one validation of what is published.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
import time
import weakref
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollstream.common.arrays import Packed
from rollstream.common.checked import is_int
from rollstream.common.errors import (
    ConfigError,
    EngineError,
    EpisodeAborted,
    EpisodeDrained,
    InvalidResult,  # noqa: F401  (raised by .checks; importable here as before)
    PromptNotSupported,
)
from rollstream.common.models import Sample, Status
from rollstream.common.protocol import parse_limits
from rollstream.common.settings_fields import option

from .durable import (
    EpisodeLog,
    JournalStats,
    decode_once,
    encode_once,
    pack_floats,
    pack_generations,
    pack_ints,
    request_digest,
    routing_rows,
    unpack_floats,
    unpack_generations,
    unpack_ints,
)
from .engine import EngineClient, Generation, route_key
from .engine.ids_json import IdsJson
from .episode import Episode, EpisodeInfo, SamplingParams, Trajectory, Turn
from .shared_limits import SharedLimits
from .telemetry import Metrics
from .warm import Prepared

logger = logging.getLogger(__name__)

MAX_ABORTS_PER_CALL = 64
"""Aborts one engine call survives (partial rollout on) before the episode is ABORTED whole."""
RESUME_POLL = 0.5
"""Seconds between two checks of the pause flag while an aborted call waits for resume."""


async def _resumed_at_once() -> None:
    """The default resume wait (no pipeline to ask): continue at once."""


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


class _Slots:
    """A weighted counting semaphore with counters: ``busy``, its ``peak``, ``waiting``."""

    def __init__(self, total: int | None) -> None:
        self.total = total
        self.busy = 0
        self.peak = 0
        self.waiting = 0
        self._changed = asyncio.Event()

    async def acquire(self, weight: int = 1) -> None:
        total = self.total
        if total is not None and total - self.busy < min(weight, total):  # only then: wait
            need = min(weight, total)  # a request of n on a smaller cap waits for all of it
            self.waiting += 1
            try:
                while total - self.busy < need:
                    self._changed.clear()
                    await self._changed.wait()
            finally:
                self.waiting -= 1
        self.busy += weight
        if self.busy > self.peak:
            self.peak = self.busy

    def release(self, weight: int = 1) -> None:
        self.busy -= weight
        self._changed.set()

    def hold(self, weight: int = 1) -> _Hold:
        """``async with slots.hold(k)``: ``k`` units while inside."""
        return _Hold(self, weight)


class _Hold:
    """:meth:`_Slots.hold` as a plain class (a generator-based context manager costs more per call)."""

    __slots__ = ("_slots", "_weight")

    def __init__(self, slots: _Slots, weight: int) -> None:
        self._slots = slots
        self._weight = weight

    async def __aenter__(self) -> None:
        await self._slots.acquire(self._weight)

    async def __aexit__(self, *exc: object) -> None:
        self._slots.release(self._weight)


class _EngineRequest:
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
        self.engine_slots = _Slots(self.limits.engine_concurrency)
        self.named = {name: _Slots(size) for name, size in self.limits.named.items()}
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
        self.sessions: set[EpisodeSession] = set()
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

    def episode_started(self) -> None:
        """An episode entered its generate function (the caller takes ``episodes`` down again)."""
        self.episodes += 1
        if self.episodes > self.episodes_peak:
            self.episodes_peak = self.episodes

    @contextlib.contextmanager
    def episode(self) -> Iterator[None]:
        self.episode_started()
        try:
            yield
        finally:
            self.episodes -= 1

    def request(self, count: int = 1) -> contextlib.AbstractAsyncContextManager[None]:
        """One engine request for ``count`` samples: an engine slot, its age, the metrics."""
        return _EngineRequest(self, count)

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


class _Trajectory(Trajectory):
    """One growing token sequence; every append keeps tokens, mask, log-probs and spans aligned."""

    def __init__(
        self, session: EpisodeSession, prompt_ids: Sequence[int] | None, source: dict[str, Any] | PromptNotSupported,
        number: int = 0,
    ) -> None:
        self.number = number
        """0 for the episode's main trajectory, k for its k-th segment (names it in the journal)."""
        # A weak reference: the session holds its trajectories, and a cycle between them would
        # leave every finished episode (its arrays, replies, tasks) to the cyclic collector
        # instead of freeing it at once (producer/gcpolicy.py)
        self._session: EpisodeSession = weakref.proxy(session)
        self.tokens = array("i", prompt_ids or ())
        self.prompt_length = len(self.tokens)
        self.known_prompt = prompt_ids is not None
        self._source = source
        """How to send the prompt while its ids are unknown (text or messages), or why it cannot be."""
        self.mask = array("B")
        self.log_probs: array[float] | None = array("f")
        self.text: list[str] = []
        self.versions: list[int] = []
        self.spans: list[tuple[int, int, int]] = []
        self.finish_reason: str | None = None
        self.status = Status.COMPLETED
        self.metadata: dict[str, Any] = {}
        self.generations: list[Generation] = []
        """Every engine reply that added to this trajectory, in order (the routing replay's source)."""
        self.rows: Packed | None = None
        """Durable episodes: the routing rows the replies so far add up to (journaled as a delta)."""
        self._encoded: IdsJson | None = None
        """The JSON text of :attr:`tokens` so far (they are only appended to), for the next request."""

    def continue_from(self, prefix: Sample) -> None:
        """Seed with an earlier attempt's aborted sample (the default rollout, partial rollout on)."""
        self.tokens = array("i", prefix.tokens)
        self.prompt_length = prefix.prompt_length
        self.known_prompt = True
        mask = prefix.loss_mask
        self.mask = array("B", mask) if mask is not None else array("B", b"\x01" * prefix.response_length)
        self.log_probs = None if prefix.rollout_log_probs is None else array("f", prefix.rollout_log_probs)
        self.rows = prefix.routed_experts
        self.text = [prefix.response]
        self.versions = list(prefix.weight_versions)
        spans = prefix.weight_version_spans
        if not spans and prefix.response_length:  # one call: its tokens share a version (the oldest if unsure)
            spans = [(0, prefix.response_length, min(prefix.weight_versions, default=0))]
        self.spans = list(spans or ())
        self.metadata = {**prefix.metadata, "continued_from": prefix.response_length}
        self._session.multi_turn = True  # the sample spans calls: publish each token's version

    @property
    def response_length(self) -> int:
        return len(self.tokens) - self.prompt_length

    @property
    def sample(self) -> Sample:
        """A snapshot (its own arrays: a sample taken before a later turn stays consistent)."""
        return Sample(
            index=self._session.info.member,
            tokens=array("i", self.tokens),
            response="".join(self.text),
            response_length=self.response_length,
            prompt_length=self.prompt_length,
            status=self.status,
            finish_reason=self.finish_reason,
            weight_versions=list(self.versions),
            rollout_log_probs=None if self.log_probs is None else array("f", self.log_probs),
            loss_mask=array("B", self.mask),
            metadata=dict(self.metadata),
            weight_version_spans=list(self.spans) if self._session.multi_turn else None,
        )

    @property
    def room(self) -> int | None:
        budget = self._session.runtime.limits.max_context
        return None if budget is None else max(0, budget - len(self.tokens))

    async def generate(
        self, *, max_new_tokens: int | None = None, sampling: SamplingParams | None = None, **params: Any
    ) -> Turn:
        session = self._session
        sampling = sampling if sampling is not None else session.info.sampling
        if params:
            sampling = sampling.replace(**params)
        limit = sampling.max_new_tokens if max_new_tokens is None else max_new_tokens
        room = self.room
        if room is not None:
            limit = min(limit, room)
        if limit <= 0:  # nothing may be added: the trajectory is at its length budget
            self.finish_reason, self.status = "length", Status.TRUNCATED
            return Turn("", array("i"), array("f"), "length", ())
        session.boundary()
        log = session.log
        step: dict[str, Any] | None = None
        digest = b""
        if log is not None:
            extra = [limit, session.runtime.sampling_dict(sampling), None if self.known_prompt else self._source]
            digest = request_digest("g", self.number, self.tokens if self.known_prompt else None, extra)
            step = await log.match("g", digest)
        if step is not None:
            turn, prompt_ids = session.replayed(step)
        else:
            if self.known_prompt:
                encoded = self._encoded
                if encoded is None or encoded.source is not self.tokens:
                    self._encoded = encoded = IdsJson(self.tokens)
                source: dict[str, Any] = {"input_ids": encoded.ids()}  # each token JSON-encoded once, in the body
            elif self.response_length == 0:
                if isinstance(self._source, PromptNotSupported):
                    raise self._source
                source = self._source
            else:
                raise PromptNotSupported(
                    "a multi-turn episode needs the prompt's token ids: give --tokenizer, or an engine "
                    "with /tokenize (or one that returns prompt token ids)"
                )
            with session.in_step():
                turn, prompt_ids = await session.call(source, limit, sampling, continuable=self.known_prompt)
                if log is not None and not session.aborted:
                    await log.record(session.turn_step("g", digest, turn, prompt_ids, self.rows))
        if not self.known_prompt and prompt_ids is not None:  # the engine said (vLLM return_token_ids)
            self.tokens = array("i", prompt_ids)
            self.prompt_length = len(self.tokens)
            self.known_prompt = True
        start = self.response_length
        self.tokens.extend(turn.token_ids)
        self.mask.frombytes(b"\x01" * len(turn.token_ids))
        if self.log_probs is not None:
            if turn.log_probs is None:
                self.log_probs = None  # the engine does not give them: none for the whole sample
            else:
                self.log_probs.extend(turn.log_probs)
        self.text.append(turn.text)
        self.versions.extend(turn.weight_versions)
        self.generations.extend(session.last_generations)
        if log is not None:
            self.rows = routing_rows(self.rows, session.last_generations)
        self.spans.extend((start + s, start + e, v) for s, e, v in turn.weight_version_spans)
        self.finish_reason = turn.finish_reason
        self.status = turn.status
        self.metadata.update(session.last_call_metadata)
        session.turns += 1
        if session.aborted:
            self.status = Status.ABORTED
            raise _aborted()
        session.boundary()
        return turn

    async def observe(self, content: str | Sequence[int]) -> int:
        if not self.known_prompt:
            raise PromptNotSupported("observing tokens needs the prompt's token ids (--tokenizer or /tokenize)")
        session = self._session
        session.boundary()
        if isinstance(content, str):
            ids: Sequence[int] = await session.tokenize(content)
        else:
            ids = content
        room = self.room
        if room is not None and len(ids) > room:
            ids = ids[:room]
        before = len(self.tokens)
        self.tokens.extend(ids)  # TypeError / OverflowError on anything but int32 ids: the sample fails
        if isinstance(content, str):
            self.text.append(content)
        added = len(self.tokens) - before
        self.mask.frombytes(b"\x00" * added)
        if self.log_probs is not None:
            self.log_probs.frombytes(b"\x00" * (4 * added))
        log = session.log
        if log is not None:
            digest = request_digest("o", self.number, self.tokens[before:], None)
            if await log.match("o", digest) is None:
                await log.record({"k": "o", "r": digest})
            session.boundary()
        return added


class EpisodeSession(Episode):
    """One episode: the object a generate function gets (see :class:`~.episode.Episode`)."""

    def __init__(
        self,
        runtime: EpisodeRuntime,
        info: EpisodeInfo,
        source: dict[str, Any] | PromptNotSupported,
        media: Mapping[str, Any] | None = None,
        *,
        prompt_ids: array[int] | None = None,
        log: EpisodeLog | None = None,
    ) -> None:
        self.runtime = runtime
        self.log = log
        """Durable episodes: this episode's journal (replayed first, then appended); else None."""
        self.drained = False
        """A drain stopped the episode at a step boundary (:class:`EpisodeDrained`)."""
        self.task: asyncio.Task[Any] | None = None
        """The task running the generate function (a drain cancels it between steps)."""
        self._steps_running = 0
        self.warm: tuple[Prepared, int] | None = None
        """Warm pools: the prompt's prepared resources and this episode's member number."""
        self.media = dict(media) if media else {}
        """The prompt's images (SGLang ``image_data``), sent with every request of the episode."""
        self._info = info
        self.multi_turn = False
        """Whether a second call or an observation happened (then spans are published)."""
        self.turns = 0
        self.aborted = False
        """An engine call was aborted and could not be continued: the sample is ABORTED."""
        self.fatal: BaseException | None = None
        """An engine that keeps failing (EngineError after retries): fatal, even if user code caught it."""
        self.last_call_metadata: dict[str, Any] = {}
        self.last_generations: list[Generation] = []
        """The engine replies of the last call (one per request: continuations after aborts)."""
        # ``prompt_ids``: the same ids as ``info.prompt_ids`` as an array (copied without a loop).
        self.main = _Trajectory(self, prompt_ids if prompt_ids is not None else info.prompt_ids, source)
        self.segments: list[_Trajectory] = []

    @property
    def info(self) -> EpisodeInfo:
        return self._info

    # -- durable episodes ---------------------------------------------------------------

    def boundary(self) -> None:
        """At a step boundary: a draining producer stops a journaled episode here."""
        if self.runtime.stopping and self.log is not None and self.log.durable:
            self.drained = True
            raise EpisodeDrained("the producer is draining: the episode stops here and resumes from its journal")

    def stop_now(self) -> None:
        """A drain: cancel the episode if it is between steps (its journal is complete)."""
        if self._steps_running == 0 and self.log is not None and self.log.durable and self.task is not None:
            self.drained = True
            self.task.cancel()

    @contextlib.contextmanager
    def in_step(self) -> Iterator[None]:
        """Around a step's own work: a drain lets it finish (and be journaled)."""
        self._steps_running += 1
        try:
            yield
        finally:
            self._steps_running -= 1

    def turn_step(
        self, kind: str, digest: bytes, turn: Turn, prompt_ids: array[int] | None, rows: Packed | None = None
    ) -> dict[str, Any]:
        """The journal entry of an engine call's reply (``rows``: the trajectory's routing rows
        before it, so a full routing replay is journaled from the first new row)."""
        return {
            "k": kind, "r": digest, "x": turn.text, "i": pack_ints(turn.token_ids),
            "l": None if turn.log_probs is None else pack_floats(turn.log_probs), "f": turn.finish_reason,
            "v": list(turn.weight_versions), "s": [list(span) for span in turn.weight_version_spans],
            "p": None if prompt_ids is None else pack_ints(prompt_ids), "m": dict(self.last_call_metadata),
            "e": pack_generations(self.last_generations, rows),
        }

    def replayed(self, step: dict[str, Any]) -> tuple[Turn, array[int] | None]:
        """The turn (and prompt ids) a journaled reply stands for; no engine is asked."""
        log_probs = step.get("l")
        turn = Turn(
            str(step.get("x") or ""), unpack_ints(step["i"]), None if log_probs is None else unpack_floats(log_probs),
            step.get("f"), tuple(int(v) for v in step.get("v") or ()),
            tuple((int(a), int(b), int(c)) for a, b, c in step.get("s") or ()),
        )
        self.last_call_metadata = dict(step.get("m") or {})
        self.last_generations = unpack_generations(step.get("e"))
        if len(turn.weight_versions) > 1:
            self.multi_turn = True
        prompt_ids = step.get("p")
        return turn, None if prompt_ids is None else unpack_ints(prompt_ids)

    async def once(self, key: str, fn: Callable[[], Any]) -> Any:
        self.boundary()
        log = self.log
        if log is None:
            return await _run_once(fn)
        digest = request_digest("once", 0, None, key)
        step = await log.match("once", digest)
        if step is not None:
            return decode_once(step["val"])
        with self.in_step():
            value = await _run_once(fn)
            await log.record({"k": "once", "r": digest, "val": encode_once(value)})
        self.boundary()
        return value

    @property
    def sample(self) -> Sample:
        return self.main.sample

    @property
    def response_length(self) -> int:
        return self.main.response_length

    @property
    def room(self) -> int | None:
        return self.main.room

    async def generate(
        self, *, max_new_tokens: int | None = None, sampling: SamplingParams | None = None, **params: Any
    ) -> Turn:
        if self.turns:
            self.multi_turn = True
        return await self.main.generate(max_new_tokens=max_new_tokens, sampling=sampling, **params)

    async def observe(self, content: str | Sequence[int]) -> int:
        self.multi_turn = True
        return await self.main.observe(content)

    @property
    def tokenizer(self) -> Any:
        return self.runtime.engine.tokenizer

    async def tokenize(self, text: str) -> list[int]:
        ids = await self.runtime.engine.tokenize(text)
        if ids is None:
            raise PromptNotSupported("no tokenizer: give --tokenizer, or an engine with /tokenize")
        return ids

    def limit(self, name: str) -> contextlib.AbstractAsyncContextManager[None]:
        return self.runtime.limit(name)

    async def rate(self, name: str) -> None:
        await self.runtime.rate(name)

    async def prepared(self) -> Any:
        if self.warm is None:
            return None
        prepared, member = self.warm
        return await prepared.get(member)

    async def segment(self, prompt: str | Sequence[int]) -> Trajectory:
        self.multi_turn = True
        ids = await self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        trajectory = _Trajectory(self, ids, {}, len(self.segments) + 1)
        self.segments.append(trajectory)
        return trajectory

    async def complete(
        self, input_ids: Sequence[int], *, max_new_tokens: int | None = None,
        sampling: SamplingParams | None = None, **params: Any,
    ) -> Turn:
        sampling = sampling if sampling is not None else self.info.sampling
        if params:
            sampling = sampling.replace(**params)
        limit = sampling.max_new_tokens if max_new_tokens is None else max_new_tokens
        budget = self.runtime.limits.max_context
        if budget is not None:
            limit = min(limit, budget - len(input_ids))
        if limit <= 0:
            return Turn("", array("i"), array("f"), "length", ())
        self.boundary()
        log = self.log
        digest = b""
        if log is not None:
            digest = request_digest("c", 0, input_ids, [limit, self.runtime.sampling_dict(sampling)])
            step = await log.match("c", digest)
            if step is not None:
                self.boundary()
                return self.replayed(step)[0]
        with self.in_step():
            turn, _ = await self.call({"input_ids": array("i", input_ids)}, limit, sampling, continuable=True)
            if log is not None and not self.aborted:
                await log.record(self.turn_step("c", digest, turn, None))
        if self.aborted:
            raise _aborted()
        self.boundary()
        return turn

    async def call(
        self, source: dict[str, Any], max_new: int, sampling: SamplingParams, *, continuable: bool
    ) -> tuple[Turn, array[int] | None]:
        """One turn: engine requests until it ends, continuing after aborts with partial rollout
        on (from ``source`` + the tokens so far, after the pipeline resumed); its prompt ids
        when the engine reported them."""
        runtime = self.runtime
        params = runtime.sampling_dict(sampling)
        generation = await self._request(source, max_new, params)
        self.last_generations = [generation]
        if (generation.finish_reason != "abort" and not generation.weight_version_spans
                and generation.weight_version_before is None):
            # One request, not aborted (the common case): its arrays become the turn's as they are.
            return self._one_request(generation), generation.prompt_ids
        ids = array("i")
        log_probs: array[float] | None = array("f")
        text: list[str] = []
        versions: list[int] = []
        spans: list[tuple[int, int, int]] = []
        prompt_ids: array[int] | None = None
        for aborts in itertools.count():
            if aborts:
                sent = source.get("input_ids")
                prefix = sent if sent is not None else prompt_ids
                request = source if not ids or prefix is None else {"input_ids": array("i", prefix) + ids}
                generation = await self._request(request, max_new - len(ids), params)
                self.last_generations.append(generation)
            if prompt_ids is None and generation.prompt_ids is not None:
                prompt_ids = generation.prompt_ids
            version = self._version(generation)
            engine_spans = generation.weight_version_spans  # vLLM: the versions inside one request
            if engine_spans and generation.weight_version is not None:
                spans.extend((len(ids) + start, len(ids) + end, v) for v, start, end in engine_spans)
                versions.extend(dict.fromkeys(v for v, _, _ in engine_spans))
            elif generation.weight_version_before is not None:  # moved while it ran, nothing says where
                spans.append((len(ids), len(ids) + len(generation.output_ids), generation.weight_version_before))
                versions.extend((generation.weight_version_before, version))
                self.last_call_metadata["weight_version_split"] = "unknown"
            else:
                spans.append((len(ids), len(ids) + len(generation.output_ids), version))
                versions.append(version)
            ids.extend(generation.output_ids)
            text.append(generation.text)
            if log_probs is not None:
                log_probs = None if generation.log_probs is None else log_probs + generation.log_probs
            runtime.metrics.tokens_generated(len(generation.output_ids))
            runtime.episode_turns += 1
            finish = generation.finish_reason
            if finish != "abort":
                break
            # Without the prompt's ids sent, the engine's echo of them (OpenAI ``return_token_ids``)
            # lets the call continue as token input; not beside images, which ids cannot carry.
            continuable = continuable or (prompt_ids is not None and not self.media)
            if not runtime.partial_rollout or not continuable or aborts >= MAX_ABORTS_PER_CALL:
                self.aborted = True  # the caller appends what came, then raises EpisodeAborted
                break
            if len(ids) >= max_new:
                finish = "length"
                break
            runtime.aborts_continued += 1
            await runtime.wait_resumed()
        if len(versions) > 1:
            self.multi_turn = True
        return Turn("".join(text), ids, log_probs, finish, tuple(versions), tuple(spans)), prompt_ids

    def _one_request(self, generation: Generation) -> Turn:
        """The turn of a single engine call that was not aborted and gave no version spans:
        :meth:`call`'s loop for one request, without copying the reply's arrays."""
        runtime = self.runtime
        output = generation.output_ids
        if type(output) is not array or output.typecode != "i":
            output = array("i", output)
        log_probs = generation.log_probs
        if log_probs is not None and (type(log_probs) is not array or log_probs.typecode != "f"):
            log_probs = array("f", log_probs)
        version = self._version(generation)
        runtime.metrics.tokens_generated(len(output))
        runtime.episode_turns += 1
        spans = ((0, len(output), version),)
        return Turn(generation.text, output, log_probs, generation.finish_reason, (version,), spans)

    async def _request(self, source: dict[str, Any], max_new: int, params: dict[str, Any]) -> Generation:
        runtime = self.runtime
        try:
            async with runtime.request(1):
                generation = await runtime.engine.generate(
                    **{**self.media, **source}, max_new_tokens=max_new, sampling=params,
                    key=route_key(self._info.index, self._info.epoch),
                )
        except EngineError as exc:
            self.fatal = exc  # kept even if the user's code swallows it
            raise
        if runtime.on_reply is not None:
            runtime.on_reply(generation.engine)
        self.last_call_metadata = {"engine": generation.engine}
        return generation

    def _version(self, generation: Generation) -> int:
        if generation.weight_version is not None:
            return generation.weight_version
        self.last_call_metadata["weight_version_source"] = "trainer_at_admission"
        return self.info.admitted_version


async def _run_once(fn: Callable[[], Any]) -> Any:
    result = fn()
    return await result if inspect.isawaitable(result) else result


def _aborted() -> EpisodeAborted:
    return EpisodeAborted(
        "an engine call was aborted (a weight update?) and could not be continued (partial rollout "
        "off, or no prompt ids): the episode is recycled whole"
    )
