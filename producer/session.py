"""One episode (:class:`EpisodeSession`: the :class:`~.episode.Episode` a generate function gets):
token-in/token-out engine calls with abort continuation, its trajectories (:mod:`.trajectory`),
its journal's steps (durable episodes: each step replayed from the journal or run live, then
recorded, by :meth:`EpisodeSession.journaled`), the drain's step boundaries. What all episodes share
is :mod:`.episode_runtime`; :func:`~.checks.check_sample` is the one validation of what is published.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
from array import array
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from rollstream.common.arrays import Packed
from rollstream.common.errors import (
    EngineError,
    EpisodeDrained,
    InvalidResult,  # noqa: F401  (raised by .checks; importable here as before)
    PromptNotSupported,
)
from rollstream.common.models import Sample

from .durable import (
    EpisodeLog,
    decode_once,
    encode_once,
    pack_floats,
    pack_generations,
    pack_ints,
    request_digest,
    unpack_floats,
    unpack_generations,
    unpack_ints,
)
from .engine import Generation, route_key
from .episode import Episode, EpisodeInfo, SamplingParams, Trajectory, Turn
from .episode_runtime import EpisodeRuntime
from .trajectory import SessionTrajectory, aborted
from .warm import Prepared

MAX_ABORTS_PER_CALL = 64
"""Aborts one engine call survives (partial rollout on) before the episode is ABORTED whole."""

R = TypeVar("R")


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
        self.main = SessionTrajectory(self, prompt_ids if prompt_ids is not None else info.prompt_ids, source)
        self.segments: list[SessionTrajectory] = []

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

    async def journaled(
        self, kind: str, digest: bytes, live: Callable[[], Awaitable[R]],
        entry: Callable[[R], dict[str, Any] | None], replay: Callable[[dict[str, Any]], R],
    ) -> R:
        """One step of the episode: with a journal, its recorded answer when it has one (``replay``
        of the entry of ``kind`` and ``digest``: no engine asked, no function run); else ``live()``,
        run as a step (a drain lets it finish), and its ``entry`` recorded (None: not recorded)."""
        log = self.log
        if log is not None:
            step = await log.match(kind, digest)
            if step is not None:
                return replay(step)
        with self.in_step():
            result = await live()
            if log is not None and (recorded := entry(result)) is not None:
                await log.record(recorded)
        return result

    async def once(self, key: str, fn: Callable[[], Any]) -> Any:
        self.boundary()
        if self.log is None:
            return await _run_once(fn)
        digest = request_digest("once", 0, None, key)
        value = await self.journaled(
            "once", digest, lambda: _run_once(fn),
            lambda value: {"k": "once", "r": digest, "val": encode_once(value)},
            lambda step: decode_once(step["val"]),
        )
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
        trajectory = SessionTrajectory(self, ids, {}, len(self.segments) + 1)
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
        digest = b""
        if self.log is not None:
            digest = request_digest("c", 0, input_ids, [limit, self.runtime.sampling_dict(sampling)])
        turn, _ = await self.journaled(
            "c", digest,
            lambda: self.call({"input_ids": array("i", input_ids)}, limit, sampling, continuable=True),
            lambda reply: None if self.aborted else self.turn_step("c", digest, reply[0], None),
            self.replayed,
        )
        if self.aborted:
            raise aborted()
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
