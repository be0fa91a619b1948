"""One prompt in, one scored group out: the rollout itself, without Redis.

:class:`Rollout` tokenizes the prompt (when it can), runs the generate function (the rollout
plug-in, :mod:`.episode`; the default :data:`single_turn` is one engine call per sample, and on
the OpenAI API one request with ``n`` for the group) once per group member, concurrently, each
episode under its deadline, validates every sample it returns (:func:`.checks.check_sample`)
and scores the group with the reward function.
It knows nothing of streams, leases or admission: the producer runtime
(:mod:`rollstream.producer.worker`) hands it a decoded prompt and the weight version the prompt
was admitted under, and publishes what comes back.

One bad prompt or one bad reply costs one failed group, never the producer: engine refusals and
unusable replies (:class:`~rollstream.common.errors.EngineRejected`, which
:class:`~rollstream.common.errors.EngineReplyInvalid` is) fail the sample, and a reward that
fails on a group (:class:`~rollstream.common.errors.RewardError`: it raised, returned something
unusable, timed out) fails every sample of the group, with the reason in ``Sample.error``. The
consumer recycles FAILED groups with ``attempt + 1`` and dead-letters them after
``max_attempts``. Each reason is logged once per :data:`FAILURE_LOG_INTERVAL`, with a count of
the ones not logged.

A generate function that raises, times out (``--episode-timeout``) or returns something
unusable fails its sample with the reason, like an engine refusal. What propagates (fatal for
the producer): an engine that keeps failing after its retries; an engine that is broken rather
than unlucky (:class:`~rollstream.common.errors.EngineBroken`: its replies were refused or
unusable on ``engine_failure_limit`` distinct prompts in a row with no usable reply from it in
between, or the same across all engines); a generate function that failed on
``generate_failure_limit`` distinct prompts in a row (:class:`~rollstream.common.errors.GenerateBroken`); and a
reward that is broken rather than unlucky: :class:`~rollstream.common.errors.RewardBroken`,
raised when the reward failed on ``reward_failure_limit`` distinct prompts in a row (no group
scored in between), or when too many sync reward calls are stuck past their deadline. One bad
reply, or one poison prompt retried, stays a failed sample: prompts are counted once each.
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from rollstream.common.checked import is_int
from rollstream.common.errors import (
    ConfigError,
    EngineBroken,
    EngineError,
    EngineRejected,
    EngineReplyInvalid,
    EpisodeAborted,
    EpisodeDrained,
    GenerateBroken,
    InvalidResult,
    PromptNotSupported,
    RewardBroken,
    RewardError,
)
from rollstream.common.eval_lane import eval_settings
from rollstream.common.models import Group, Prompt, Sample, Status

from .checks import as_samples, check_sample
from .durable import EpisodeLog, PromptJournal
from .engine import EngineClient, route_key
from .episode import EpisodeInfo, GenerateFunction, SamplingParams
from .episode_runtime import EpisodeRuntime
from .outcomes import FailureLog, failed, rejected, to_sample
from .plugin import single_turn
from .replay import with_routed_experts
from .rewards import RewardFunction
from .session import EpisodeSession
from .settings import EpisodeSettings
from .teacher import TeacherScorer
from .telemetry import Metrics
from .warm import Prepared, warm_hooks

logger = logging.getLogger(__name__)

ALL_ENGINES = "all engines"
"""What :class:`EngineBroken` names when no engine in particular is to blame."""


SampleDone = Callable[[int], None]
"""Called with a number of group members (episodes) whose work has just ended."""


def _ignore(count: int) -> None:
    """The default ``sample_done``: nobody is counting."""


class Rollout:
    """Turns a prompt into a scored group: ``n`` episodes of the generate function, then the reward."""

    def __init__(
        self,
        engine: EngineClient,
        reward: RewardFunction,
        n_samples: int,
        episodes: EpisodeSettings | None = None,
        *,
        partial_rollout: bool = False,
        producer: str = "",
        metrics: Metrics | None = None,
        teacher: TeacherScorer | None = None,
        wait_resumed: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """``n_samples`` per prompt and ``partial_rollout`` are the namespace's; ``producer`` is
        written into every group; ``episodes`` (the producer's sub-settings) hold the plug-in,
        its caps and the failure limits."""
        if not is_int(n_samples) or n_samples < 1:
            raise ConfigError(f"n_samples must be a positive integer, got {n_samples!r}")
        self.engine = engine
        self.teacher = teacher
        """Scores every response on a teacher model before the reward (``--teacher-engine``)."""
        self.reward = reward
        self.n_samples = n_samples
        self.settings = episodes if episodes is not None else EpisodeSettings()
        self.partial_rollout = partial_rollout
        self.producer = producer
        self.metrics = metrics if metrics is not None else Metrics()
        self.generate: GenerateFunction = self.settings.generate if self.settings.generate is not None else single_turn
        self.warm = warm_hooks(self.generate)
        """The generate function's ``prepare`` / ``release`` hooks (warm pools), or None."""
        self.runtime = EpisodeRuntime(
            engine,
            self.settings.limits,
            partial_rollout=partial_rollout,
            metrics=self.metrics,
            on_reply=self._engine_answered,
            **({"wait_resumed": wait_resumed} if wait_resumed is not None else {}),
        )
        self.failures = FailureLog()
        self._reward_failed_on: set[tuple[int, int]] = set()
        """(index, epoch) of the prompts the reward failed on since it last scored a group."""
        self._generate_failed_on: set[tuple[int, int]] = set()
        """(index, epoch) of the prompts the generate function failed on since it last succeeded."""
        self.episodes_failed = 0
        """Episodes whose function raised, timed out or returned an invalid result."""
        self.function_failures = 0
        """Of those, the ones held against the function (raised or invalid, not the deadline)."""
        self._engine_failed_on: dict[str, set[tuple[int, int]]] = {}
        """Engine URL -> (index, epoch) of the prompts it gave no usable reply for since its last usable one."""
        self._engines_failed_on: set[tuple[int, int]] = set()
        """The same over all engines: since any engine last gave a usable reply."""

    @property
    def journals(self) -> bool:
        """Whether durable episodes apply: a generate function of the user's (the default
        single-turn rollout already continues its one call with partial rollout)."""
        return self.generate is not single_turn

    def prepare(self, prompt: Prompt, admitted_version: int) -> Prepared | None:
        """Start the generate function's ``prepare(info)`` for each episode of ``prompt`` (warm
        pools); None without the hook. The caller releases what no episode took."""
        if self.warm is None:
            return None
        ids = None if prompt.input_ids is None else tuple(prompt.input_ids)
        sampling = self.runtime.sampling()
        infos = [
            EpisodeInfo(index=prompt.index, epoch=prompt.epoch, attempt=prompt.attempt, member=member,
                        n=self.n_samples, prompt=prompt.prompt, label=prompt.label,
                        metadata=MappingProxyType(dict(prompt.metadata)), prompt_ids=ids,
                        admitted_version=admitted_version, deadline=None, sampling=sampling)
            for member in range(self.n_samples)
        ]
        return Prepared(self.warm, infos)

    async def run(
        self, prompt: Prompt, admitted_version: int, sample_done: SampleDone | None = None,
        journal: PromptJournal | None = None, prepared: Prepared | None = None,
    ) -> Group:
        """The group of ``prompt``; ``admitted_version`` (the trainer's weight version when the
        prompt was admitted) stands in for engines that do not report their own.

        ``sample_done(k)`` is called as soon as ``k`` episodes have ended (each member's, or the
        one request of ``n``), before the group is scored: the producer releases capacity per
        episode with it. Over a run that returns, it is called for ``n`` in total; a run that
        raises may have called it for fewer. ``journal`` (durable episodes): the prompt's episode
        journal, replayed by each member and appended to; a drain then raises
        :class:`EpisodeDrained` out of here (the prompt goes back with its journal)."""
        lane = eval_settings(prompt)
        n = lane.n_samples if lane is not None else self.n_samples
        done = sample_done if sample_done is not None else _ignore
        prompt_ids = await self._prompt_ids(prompt)
        partial = prompt.partial if self.partial_rollout else None
        if self.generate is single_turn and partial is None and self.engine.batches_samples:  # one request with n
            samples = await self._generate_together(prompt, prompt_ids, n, admitted_version, done)
        else:
            samples = await self._episodes(prompt, prompt_ids, n, admitted_version, partial, done, journal, prepared)
        if self.teacher is not None and all(s.status in (Status.COMPLETED, Status.TRUNCATED) for s in samples):
            await self.teacher.score(samples)
        if all(s.status in (Status.COMPLETED, Status.TRUNCATED) for s in samples):
            await self._score(prompt, samples)
        return Group(
            index=prompt.index,
            epoch=prompt.epoch,
            attempt=prompt.attempt,
            prompt=prompt.prompt,
            label=prompt.label,
            metadata=dict(prompt.metadata),
            samples=samples,
            producer=self.producer,
            history=prompt.history,
            multimodal_inputs=prompt.multimodal_inputs,
            source=prompt.source,
            admitted_ms=prompt.admitted_ms,
        )

    def _sampling(self, prompt: Prompt) -> SamplingParams:
        """The producer's sampling parameters, with an eval prompt's ``max_new_tokens``,
        ``temperature`` and ``top_p`` where it sets them."""
        sampling = self.runtime.sampling()
        lane = eval_settings(prompt)
        if lane is None:
            return sampling
        changes: dict[str, Any] = {"max_new_tokens": lane.max_new_tokens, "temperature": lane.temperature,
                                   "top_p": lane.top_p}
        return sampling.replace(**{k: v for k, v in changes.items() if v is not None})

    async def aclose(self) -> None:
        """Release what the generate function holds (``aclose()``, when it has one): called by
        the producer once no episode runs any more (after the drain, or a fatal error)."""
        close = getattr(self.generate, "aclose", None)
        if close is not None:
            await close()

    def requests_older_than(self, seconds: float) -> tuple[int, float]:
        """See :meth:`EpisodeRuntime.requests_older_than`."""
        return self.runtime.requests_older_than(seconds)

    async def _score(self, prompt: Prompt, samples: list[Sample]) -> None:
        """Set the samples' rewards, or fail them all with the reward's error."""
        try:
            rewards = await self.reward.score(prompt.prompt, prompt.label, samples, metadata=prompt.metadata)
        except RewardBroken:
            raise
        except RewardError as exc:
            self._reward_failed_on.add((prompt.index, prompt.epoch))
            failed = len(self._reward_failed_on)
            if failed >= self.settings.reward_failure_limit:
                raise RewardBroken(
                    f"reward {self.reward.name!r} failed on {failed} distinct prompts in a row, "
                    f"none scored in between: it is broken, not the prompts; last error: {exc}"
                ) from exc
            cause = type(exc.__cause__).__name__ if exc.__cause__ is not None else "invalid"
            self.failures.report(
                f"reward:{cause}", f"prompt {prompt.index} (attempt {prompt.attempt}): group failed: {exc}"
            )
            self.metrics.error("reward")
            for sample in samples:
                sample.status = Status.FAILED
                sample.error = f"reward: {exc}"[:1000]
            return
        self._reward_failed_on.clear()
        for sample, reward in zip(samples, rewards, strict=True):
            sample.reward = reward

    def _engine_refused(self, prompt: Prompt, exc: EngineRejected) -> None:
        """Log the failed sample; raise :class:`EngineBroken` when the engine (or every engine)
        has now failed on ``engine_failure_limit`` distinct prompts in a row."""
        reason = f"reply:{exc.reason}" if isinstance(exc, EngineReplyInvalid) else f"http_{exc.status_code}"
        if not isinstance(exc, PromptNotSupported):  # decided here, no engine was asked
            key = (prompt.index, prompt.epoch)
            engine = exc.engine or ALL_ENGINES
            failed_on = self._engine_failed_on.setdefault(engine, set())
            failed_on.add(key)
            self._engines_failed_on.add(key)
            limit = self.settings.engine_failure_limit
            for who, count in ((engine, len(failed_on)), (ALL_ENGINES, len(self._engines_failed_on))):
                if count >= limit and who != ALL_ENGINES and self.engine.take_out(who, reason):
                    failed_on.clear()  # out of routing, probed: one engine of several is not fatal
                    continue
                if count >= limit:
                    subject, scope = (who, "any") if who == ALL_ENGINES else (f"engine {who}", "it")
                    raise EngineBroken(
                        who, reason,
                        f"{subject} gave no usable reply for {count} distinct prompts in a row (none usable from "
                        f"{scope} in between): it is broken, not the prompts; last: {reason}: {exc}",
                    ) from exc
        self.failures.report(reason, f"prompt {prompt.index} (attempt {prompt.attempt}): sample failed: {exc}")

    def _engine_answered(self, engine: str) -> None:
        """A usable reply from ``engine``: its run of failures (and the all-engines one) ends."""
        self._engine_failed_on.pop(engine, None)
        self._engines_failed_on.clear()

    async def _prompt_ids(self, prompt: Prompt) -> array[int] | None:
        if prompt.input_ids is not None:
            return prompt.input_ids
        if isinstance(prompt.prompt, str) and self.settings.tokenize_prompts:
            ids = await self.engine.tokenize(prompt.prompt)
            if ids is not None:
                return array("i", ids)
        elif isinstance(prompt.prompt, list):  # chat messages: the chat template, with a tokenizer
            ids = await self.engine.chat_ids(prompt.prompt)
            if ids is not None:
                return array("i", ids)
        return None

    async def _episodes(
        self,
        prompt: Prompt,
        prompt_ids: array[int] | None,
        n: int,
        admitted_version: int,
        partial: list[Sample] | None,
        done: SampleDone,
        journal: PromptJournal | None = None,
        prepared: Prepared | None = None,
    ) -> list[Sample]:
        """The ``n`` episodes, concurrently; a fatal error (not the group wrapper) propagates,
        and so does a drain's :class:`EpisodeDrained`."""
        failed_before = self.function_failures
        shared = self._shared(prompt, prompt_ids)
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(
                        self._member(
                            prompt, prompt_ids, i, admitted_version,
                            partial[i] if partial is not None and i < len(partial) else None, done, shared,
                            journal, prepared,
                        )
                    )
                    for i in range(n)
                ]
        except ExceptionGroup as errors:
            fatal = errors.subgroup(lambda e: not isinstance(e, EpisodeDrained | BaseExceptionGroup))
            first: BaseException = fatal if fatal is not None else errors
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from None
        key = (prompt.index, prompt.epoch)
        if self.function_failures > failed_before:
            self._generate_failed_on.add(key)
            failed = len(self._generate_failed_on)
            if failed >= self.settings.generate_failure_limit:
                raise GenerateBroken(
                    f"the generate function {_name(self.generate)} failed on {failed} distinct prompts in a "
                    "row, none succeeded in between: it is broken, not the prompts; last error: "
                    + next((s.error or "" for t in tasks for s in t.result() if s.status == Status.FAILED), "")
                )
        elif any(s.status != Status.FAILED for t in tasks for s in t.result()):
            self._generate_failed_on.clear()  # the function worked on this prompt
        return [s for t in tasks for s in t.result()]

    async def _member(
        self,
        prompt: Prompt,
        prompt_ids: array[int] | None,
        member: int,
        admitted_version: int,
        partial: Sample | None,
        done: SampleDone,
        shared: _Shared | None = None,
        journal: PromptJournal | None = None,
        prepared: Prepared | None = None,
    ) -> list[Sample]:
        # A member that raised is not reported: the caller releases what a failed run still holds.
        log = journal.member(member) if journal is not None else None
        samples = await self._episode(prompt, prompt_ids, member, admitted_version, partial, shared, log, prepared)
        if prepared is not None:  # its episode did not take it
            await prepared.release_unused([member])
        done(1)
        return samples

    def _shared(self, prompt: Prompt, prompt_ids: array[int] | None) -> _Shared:
        """What every member of the group gets alike, built once per group (all read-only)."""
        try:
            source: dict[str, Any] | PromptNotSupported = self._prompt_source(prompt, prompt_ids)
        except PromptNotSupported as exc:  # raised when the episode sends the prompt: the sample fails
            source = exc
        return _Shared(
            MappingProxyType(dict(prompt.metadata)), None if prompt_ids is None else tuple(prompt_ids), source,
            _media(prompt),
        )

    async def _episode(
        self,
        prompt: Prompt,
        prompt_ids: array[int] | None,
        member: int,
        admitted_version: int,
        partial: Sample | None,
        shared: _Shared | None = None,
        log: EpisodeLog | None = None,
        prepared: Prepared | None = None,
    ) -> list[Sample]:
        """One member's episode: run the function under its deadline, validate what it returned;
        every failure becomes a FAILED (or ABORTED) sample with the reason. A durable episode
        stopped by a drain raises :class:`EpisodeDrained` instead."""
        fn = self.generate
        resumable = bool(getattr(fn, "continues_partial", False))
        if resumable and partial is not None and partial.status in (Status.COMPLETED, Status.TRUNCATED):
            return [replace(partial, index=member)]
        timeout = self.settings.limits.episode_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        if shared is None:
            shared = self._shared(prompt, prompt_ids)
        info = EpisodeInfo(
            index=prompt.index, epoch=prompt.epoch, attempt=prompt.attempt, member=member,
            n=self.n_samples, prompt=prompt.prompt, label=prompt.label,
            metadata=shared.metadata, prompt_ids=shared.prompt_ids,
            admitted_version=admitted_version, deadline=deadline, sampling=self._sampling(prompt),
            partial=partial,
        )
        source = shared.source
        if isinstance(source, PromptNotSupported):  # rare: each member raises its own exception object
            try:
                source = self._prompt_source(prompt, prompt_ids)
            except PromptNotSupported as exc:
                source = exc
        session = EpisodeSession(self.runtime, info, source, shared.media, prompt_ids=prompt_ids, log=log)
        if prepared is not None:
            session.warm = (prepared, member)
        prefix: Sample | None = None
        if resumable and partial is not None and partial.status == Status.ABORTED and partial.response_length > 0:
            if prompt_ids is not None and partial.prompt_length == len(prompt_ids):
                session.main.continue_from(partial)
                prefix = partial
            else:
                logger.debug("prompt %d: partial sample without prompt ids; regenerating", prompt.index)
        where = f"prompt {prompt.index} (attempt {prompt.attempt}) member {member}"
        scope: asyncio.Timeout | None = None
        runtime = self.runtime
        if log is not None:
            session.task = asyncio.current_task()
            runtime.sessions.add(session)
        try:
            with runtime.episode():
                try:
                    if timeout is None:
                        result = await fn(session)
                    else:
                        async with asyncio.timeout(timeout) as scope:
                            result = await fn(session)
                finally:
                    runtime.sessions.discard(session)
            if session.drained:  # the user's code caught EpisodeDrained and returned
                raise EpisodeDrained(f"{where}: stopped by the drain")
            samples = as_samples(result)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if session.drained and task is not None and task.uncancel() == 0:  # cancelled by the drain only
                raise EpisodeDrained(f"{where}: stopped by the drain between steps") from None
            raise
        except Exception as exc:
            if session.fatal is not None:  # an engine that keeps failing, even if the user's code caught it
                raise session.fatal from None
            if session.drained or isinstance(exc, EpisodeDrained):
                raise EpisodeDrained(f"{where}: stopped by the drain") from None
            expired = scope is not None and scope.expired()
            return [self._sample_of_failure(exc, session, prompt, member, prompt_ids, prefix, where, expired)]
        if session.fatal is not None:
            raise session.fatal
        if session.aborted:  # an abort the user's code caught: the episode is ABORTED all the same
            return [replace(session.sample, status=Status.ABORTED, finish_reason="abort")]
        for k, sample in enumerate(samples):
            sample.index = member  # the episode's id inside the group, shared by its segments
            if len(samples) > 1:
                sample.metadata = {**sample.metadata, "segment": k}
            problem = check_sample(sample)
            if problem is not None:
                return [self._function_failed(where, member, prompt_ids, "invalid", f"invalid sample {k}: {problem}")]
        if len(samples) == 1 and session.main.generations:  # the engine's arrays of the main trajectory
            samples = [with_routed_experts(samples[0], session.main.generations, prefix)]
        return samples

    def _sample_of_failure(
        self, exc: Exception, session: EpisodeSession, prompt: Prompt, member: int, prompt_ids: array[int] | None,
        prefix: Sample | None, where: str, expired: bool,
    ) -> Sample:
        """The sample an episode whose function raised ``exc`` ends as (``expired``: its deadline
        passed); an engine that keeps failing is raised again (fatal, as in the single-turn rollout)."""
        match exc:
            case EpisodeAborted():
                aborted = replace(session.sample, status=Status.ABORTED, finish_reason="abort")
                return with_routed_experts(aborted, session.main.generations, prefix)
            case EngineRejected():  # the engine refused a request (or the prompt cannot be sent)
                self._engine_refused(prompt, exc)
                return rejected(member, prompt_ids, exc)
            case TimeoutError() if expired:
                self.episodes_failed += 1  # not counted against the function: a deadline may be the load's
                self.metrics.error("episode_deadline")
                timeout = self.settings.limits.episode_timeout
                reason = f"episode deadline: not done within {timeout:g} s (--episode-timeout)"
                self.failures.report("episode:deadline", f"{where}: sample failed: {reason}")
                return failed(member, prompt_ids, reason, "deadline")
            case InvalidResult():
                return self._function_failed(where, member, prompt_ids, "invalid", f"invalid result: {exc}")
            case EngineError():
                raise exc
            case _:  # the user's code or a tool raised: this sample fails, not the producer
                return self._function_failed(where, member, prompt_ids, "exception", _describe(exc))

    def _function_failed(
        self, where: str, member: int, prompt_ids: array[int] | None, kind: str, reason: str
    ) -> Sample:
        """A FAILED sample for a generate function that raised or returned something unusable."""
        self.episodes_failed += 1
        self.function_failures += 1
        self.metrics.error(f"generate_{kind}")
        reason = f"generate {_name(self.generate)}: {reason}"
        self.failures.report(f"generate:{kind}", f"{where}: sample failed: {reason}")
        return failed(member, prompt_ids, reason, kind)

    async def _generate_together(
        self, prompt: Prompt, prompt_ids: array[int] | None, n: int, admitted_version: int, done: SampleDone
    ) -> list[Sample]:
        """All ``n`` samples in one request (OpenAI ``n``): the prompt is prefilled once."""
        try:
            async with self.runtime.request(n):
                sampling = self._sampling(prompt)
                generations = await self.engine.generate_n(
                    n, max_new_tokens=sampling.max_new_tokens, key=route_key(prompt.index, prompt.epoch),
                    sampling=sampling.engine_params() if eval_settings(prompt) is not None else None,
                    **self._prompt_source(prompt, prompt_ids),
                )
        except EngineRejected as exc:
            self._engine_refused(prompt, exc)
            done(n)
            return [rejected(i, prompt_ids, exc) for i in range(n)]
        for engine in {g.engine for g in generations}:
            self._engine_answered(engine)
        self.metrics.tokens_generated(sum(len(g.output_ids) for g in generations))
        samples = [
            with_routed_experts(to_sample(i, prompt_ids, g, admitted_version), [g], None)
            for i, g in enumerate(generations)
        ]
        aborted = [s for s in samples if s.status == Status.ABORTED] if self.partial_rollout else []
        done(n - len(aborted))
        if aborted:
            await self._continue_aborted(prompt, samples, aborted, admitted_version, done)
        return samples

    async def _continue_aborted(
        self, prompt: Prompt, samples: list[Sample], aborted: list[Sample], admitted_version: int, done: SampleDone
    ) -> None:
        """Partial rollout on the one request of ``n``: each aborted sample is continued in its
        own episode once the pipeline resumes (prompt + its tokens as token input), as the
        episodes of the SGLang API continue theirs; a sample whose prompt ids nobody knows
        (no tokenizer, no echo) or that carries images stays ABORTED and the group is recycled."""
        ids = array("i", aborted[0].tokens[: aborted[0].prompt_length]) if aborted[0].prompt_length else None
        if ids is None or _media(prompt):
            done(len(aborted))
            return
        self.runtime.aborts_continued += len(aborted)
        await self.runtime.wait_resumed()
        shared = self._shared(prompt, ids)
        async with asyncio.TaskGroup() as tg:
            tasks = [
                tg.create_task(self._member(prompt, ids, s.index, admitted_version, s, done, shared)) for s in aborted
            ]
        for sample, task in zip(aborted, tasks, strict=True):
            samples[sample.index : sample.index + 1] = task.result()[:1]

    def _prompt_source(self, prompt: Prompt, prompt_ids: array[int] | None) -> dict[str, Any]:
        """How the prompt goes to the engine: token ids, else text, else chat messages (which
        carry their own images); the prompt's images go beside ids or text (SGLang ``image_data``)."""
        media = _media(prompt)
        if prompt_ids is not None:
            return {"input_ids": prompt_ids, **media}
        if isinstance(prompt.prompt, str):
            return {"text": prompt.prompt, **media}
        if self.engine.accepts_messages:
            return {"messages": prompt.prompt}
        raise PromptNotSupported(
            "chat prompts need a tokenizer with a chat template (--tokenizer) or the openai engine API"
        )


@dataclass(frozen=True, slots=True)
class _Shared:
    """The parts of a group's episodes that are alike for every member (read-only, built once)."""

    metadata: MappingProxyType[str, Any]
    prompt_ids: tuple[int, ...] | None
    source: dict[str, Any] | PromptNotSupported
    media: dict[str, Any]


def _media(prompt: Prompt) -> dict[str, Any]:
    """The prompt's images for the engine (SGLang ``image_data``), if it has any."""
    images = (prompt.multimodal_inputs or {}).get("images")
    return {"image_data": images} if images and isinstance(images, list) else {}


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
