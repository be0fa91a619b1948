"""One prompt in, one scored group out: the rollout itself, without Redis.

:class:`Rollout` tokenizes the prompt (when it can), asks the engines for ``n`` samples (one
request with ``n`` where the engine API batches them, else one request per sample, concurrently),
continues the samples of an aborted attempt where partial rollout is on, builds the
:class:`~rollstream.common.models.Sample` objects and scores the group with the reward function.
It knows nothing of streams, leases or admission: the producer runtime
(:mod:`rollstream.producer.worker`) hands it a decoded prompt and the weight version the prompt
was admitted under, and publishes what comes back.

One bad prompt or one bad reply costs one failed group, never the producer: engine refusals and
unusable replies (:class:`~rollstream.common.errors.EngineRejected`, which
:class:`~rollstream.producer.replies.EngineReplyInvalid` is) fail the sample, and a reward that
fails on a group (:class:`~rollstream.common.errors.RewardError`: it raised, returned something
unusable, timed out) fails every sample of the group, with the reason in ``Sample.error``. The
consumer recycles FAILED groups with ``attempt + 1`` and dead-letters them after
``max_attempts``. Each reason is logged once per :data:`FAILURE_LOG_INTERVAL`, with a count of
the ones not logged.

What propagates (fatal for the producer): an engine that keeps failing after its retries, and a
reward that is broken rather than unlucky: :class:`~rollstream.producer.rewards.RewardBroken`,
raised when the reward failed on ``reward_failure_limit`` distinct prompts in a row (no group
scored in between), or when too many sync reward calls are stuck past their deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from rollstream.common.errors import ConfigError, EngineRejected, PromptNotSupported, RewardError
from rollstream.common.models import Group, Prompt, Sample, Status

from .engine import EngineClient, Generation
from .replay import with_routed_experts
from .replies import EngineReplyInvalid
from .rewards import RewardBroken, RewardFunction
from .teacher import TeacherScorer
from .telemetry import Metrics

logger = logging.getLogger(__name__)

FAILURE_LOG_INTERVAL = 60.0
"""Seconds between two log lines of the same failure reason (the others are counted)."""
REWARD_FAILURE_LIMIT = 8
"""Default: a reward that failed on this many distinct prompts in a row is broken (fatal)."""


class FailureLog:
    """Logs a failure once per ``reason`` and ``interval``; the next line says how many were not."""

    def __init__(self, interval: float = FAILURE_LOG_INTERVAL) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def report(self, reason: str, message: str) -> None:
        now = time.monotonic()
        last = self._last.get(reason)
        if last is not None and now - last < self.interval:
            self._quiet[reason] = self._quiet.get(reason, 0) + 1
            return
        self._last[reason] = now
        quiet = self._quiet.pop(reason, 0)
        more = f" ({quiet} more like it in the last {self.interval:.0f} s)" if quiet else ""
        logger.warning("%s%s", message, more)


SampleDone = Callable[[int], None]
"""Called with a number of samples whose engine work has just ended."""


def _ignore(count: int) -> None:
    """The default ``sample_done``: nobody is counting."""


@dataclass(frozen=True, slots=True)
class RolloutSettings:
    """What a rollout needs to know of the pipeline and of its producer."""

    n_samples: int
    """Samples per prompt (the namespace's ``n_samples_per_prompt``)."""
    partial_rollout: bool = False
    """Continue the aborted samples of an earlier attempt instead of regenerating them."""
    tokenize_prompts: bool = True
    """Ask the engine's ``/tokenize`` for prompt ids, so samples carry prompt + response ids."""
    producer: str = ""
    """Written into every group's ``producer`` field."""
    reward_failure_limit: int = REWARD_FAILURE_LIMIT
    """A reward that failed on this many distinct prompts in a row is broken: fatal."""

    def __post_init__(self) -> None:
        if isinstance(self.n_samples, bool) or not isinstance(self.n_samples, int) or self.n_samples < 1:
            raise ValueError(f"n_samples must be a positive integer, got {self.n_samples!r}")
        if self.reward_failure_limit < 1:
            raise ConfigError(f"reward_failure_limit must be at least 1, got {self.reward_failure_limit!r}")


class Rollout:
    """Turns a prompt into a scored group with an engine client and a reward function."""

    def __init__(
        self,
        engine: EngineClient,
        reward: RewardFunction,
        settings: RolloutSettings,
        metrics: Metrics | None = None,
        teacher: TeacherScorer | None = None,
    ) -> None:
        self.engine = engine
        self.teacher = teacher
        """Scores every response on a teacher model before the reward (``--teacher-engine``)."""
        self.reward = reward
        self.settings = settings
        self.metrics = metrics if metrics is not None else Metrics()
        self.failures = FailureLog()
        self._requests_in_flight: dict[int, tuple[float, int]] = {}
        """Engine requests in flight: token -> (monotonic start, samples asked for)."""
        self._request_tokens = itertools.count()
        self._reward_failed_on: set[tuple[int, int]] = set()
        """(index, epoch) of the prompts the reward failed on since it last scored a group."""

    async def run(
        self, prompt: Prompt, admitted_version: int, sample_done: SampleDone | None = None
    ) -> Group:
        """The group of ``prompt``; ``admitted_version`` (the trainer's weight version when the
        prompt was admitted) stands in for engines that do not report their own.

        ``sample_done(k)`` is called as soon as ``k`` samples' engine work has ended (each
        sample's request, or the one request of ``n``), before the group is scored: the
        producer releases engine capacity per sample with it. Over a run that returns, it is
        called for ``n`` samples in total; a run that raises may have called it for fewer."""
        n = self.settings.n_samples
        done = sample_done if sample_done is not None else _ignore
        prompt_ids = await self._prompt_ids(prompt)
        partial = prompt.partial if self.settings.partial_rollout else None
        if partial is None and self.engine.batches_samples:  # one request with n
            samples = await self._generate_together(prompt, prompt_ids, n, admitted_version, done)
        else:
            samples = await self._generate_each(prompt, prompt_ids, n, admitted_version, partial, done)
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
            producer=self.settings.producer,
            history=prompt.history,
            multimodal_inputs=prompt.multimodal_inputs,
        )

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
        reason = f"reply:{exc.reason}" if isinstance(exc, EngineReplyInvalid) else f"http_{exc.status_code}"
        self.failures.report(reason, f"prompt {prompt.index} (attempt {prompt.attempt}): sample failed: {exc}")

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

    async def _generate_each(
        self,
        prompt: Prompt,
        prompt_ids: array[int] | None,
        n: int,
        admitted_version: int,
        partial: list[Sample] | None,
        done: SampleDone,
    ) -> list[Sample]:
        """One request per sample, concurrently; the first real error (not the group wrapper) propagates."""
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(
                        self._generate_sample(
                            prompt, prompt_ids, i, admitted_version,
                            partial[i] if partial is not None and i < len(partial) else None,
                            done,
                        )
                    )
                    for i in range(n)
                ]
        except ExceptionGroup as errors:
            first: BaseException = errors
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from None
        return [t.result() for t in tasks]

    def requests_older_than(self, seconds: float) -> tuple[int, float]:
        """(samples whose engine request is in flight for longer than ``seconds``, age of the
        oldest request in flight or 0): what the heartbeat reports, and inspect warns about."""
        now = time.monotonic()
        old = sum(count for started, count in self._requests_in_flight.values() if now - started > seconds)
        oldest = min((started for started, _ in self._requests_in_flight.values()), default=now)
        return old, now - oldest

    @contextlib.contextmanager
    def _requests(self, count: int) -> Iterator[None]:
        """Account ``count`` engine requests in flight, their age, and their latency in the metrics."""
        started = time.monotonic()
        token = next(self._request_tokens)
        self._requests_in_flight[token] = (started, count)
        for _ in range(count):
            self.metrics.request_started()
        try:
            yield
        finally:
            del self._requests_in_flight[token]
            for _ in range(count):
                self.metrics.request_finished(time.monotonic() - started)

    async def _generate_sample(
        self,
        prompt: Prompt,
        prompt_ids: array[int] | None,
        index: int,
        admitted_version: int,
        partial: Sample | None,
        done: SampleDone,
    ) -> Sample:
        # A request that raised is not reported: the caller releases what a failed run still holds.
        sample = await self._sample(prompt, prompt_ids, index, admitted_version, partial)
        done(1)
        return sample

    async def _sample(
        self,
        prompt: Prompt,
        prompt_ids: array[int] | None,
        index: int,
        admitted_version: int,
        partial: Sample | None,
    ) -> Sample:
        if partial is not None and partial.status in (Status.COMPLETED, Status.TRUNCATED):
            return replace(partial, index=index)
        prefix: Sample | None = None
        if partial is not None and partial.status == Status.ABORTED and partial.response_length > 0:
            if prompt_ids is not None and partial.prompt_length == len(prompt_ids):
                prefix = partial
            else:
                logger.debug("prompt %d: partial sample without prompt ids; regenerating", prompt.index)
        max_new = self.engine.settings.max_new_tokens
        if prefix is not None and prefix.response_length >= max_new:
            return replace(prefix, index=index, status=Status.TRUNCATED, finish_reason="length")
        try:
            with self._requests(1):
                if prefix is not None:  # continue the aborted response where it stopped
                    generation = await self.engine.generate(
                        input_ids=prefix.tokens, max_new_tokens=max_new - prefix.response_length, **_media(prompt)
                    )
                else:
                    source = self._prompt_input(prompt, prompt_ids)
                    generation = await self.engine.generate(**source, max_new_tokens=max_new)
        except EngineRejected as exc:
            self._engine_refused(prompt, exc)
            return _rejected(index, prompt_ids, exc)
        self.metrics.tokens_generated(len(generation.output_ids))
        sample = _to_sample(index, prompt_ids, generation, admitted_version, prefix)
        return with_routed_experts(sample, generation, prefix)

    async def _generate_together(
        self, prompt: Prompt, prompt_ids: array[int] | None, n: int, admitted_version: int, done: SampleDone
    ) -> list[Sample]:
        """All ``n`` samples in one request (OpenAI ``n``): the prompt is prefilled once."""
        try:
            with self._requests(n):
                generations = await self.engine.generate_n(
                    n, max_new_tokens=self.engine.settings.max_new_tokens, **self._prompt_input(prompt, prompt_ids)
                )
        except EngineRejected as exc:
            self._engine_refused(prompt, exc)
            done(n)
            return [_rejected(i, prompt_ids, exc) for i in range(n)]
        done(n)
        self.metrics.tokens_generated(sum(len(g.output_ids) for g in generations))
        return [
            with_routed_experts(_to_sample(i, prompt_ids, g, admitted_version, None), g, None)
            for i, g in enumerate(generations)
        ]

    def _prompt_input(self, prompt: Prompt, prompt_ids: array[int] | None) -> dict[str, Any]:
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


def _media(prompt: Prompt) -> dict[str, Any]:
    """The prompt's images for the engine (SGLang ``image_data``), if it has any."""
    images = (prompt.multimodal_inputs or {}).get("images")
    return {"image_data": images} if images and isinstance(images, list) else {}


def _to_sample(
    index: int,
    prompt_ids: array[int] | None,
    generation: Generation,
    admitted_version: int,
    prefix: Sample | None,
) -> Sample:
    metadata: dict[str, Any] = {"engine": generation.engine}
    if prompt_ids is None and prefix is None and generation.prompt_ids is not None:
        prompt_ids = array("i", generation.prompt_ids)  # the engine said (vLLM return_token_ids)
    version = generation.weight_version
    if version is None:
        version = admitted_version
        metadata["weight_version_source"] = "trainer_at_admission"
    status = Status.from_finish_reason(generation.finish_reason)
    if prefix is not None:
        log_probs = None
        if prefix.rollout_log_probs is not None and generation.log_probs is not None:
            log_probs = prefix.rollout_log_probs + array("f", generation.log_probs)
        metadata["continued_from"] = prefix.response_length
        response_length = prefix.response_length + len(generation.output_ids)
        return Sample(
            index=index,
            tokens=prefix.tokens + array("i", generation.output_ids),
            response=prefix.response + generation.text,
            response_length=response_length,
            prompt_length=prefix.prompt_length,
            loss_mask=_ones(response_length),
            status=status,
            finish_reason=generation.finish_reason,
            weight_versions=[*prefix.weight_versions, version],
            rollout_log_probs=log_probs,
            metadata={**prefix.metadata, **metadata},
        )
    tokens = (prompt_ids if prompt_ids is not None else array("i")) + array("i", generation.output_ids)
    return Sample(
        index=index,
        tokens=tokens,
        response=generation.text,
        response_length=len(generation.output_ids),
        prompt_length=0 if prompt_ids is None else len(prompt_ids),
        loss_mask=_ones(len(generation.output_ids)),
        status=status,
        finish_reason=generation.finish_reason,
        weight_versions=[version],
        rollout_log_probs=None if generation.log_probs is None else array("f", generation.log_probs),
        metadata=metadata,
    )


def _rejected(index: int, prompt_ids: array[int] | None, exc: EngineRejected) -> Sample:
    """A FAILED sample: the engine refused the request; the consumer recycles the group."""
    return Sample(
        index=index,
        tokens=prompt_ids if prompt_ids is not None else array("i"),
        prompt_length=0 if prompt_ids is None else len(prompt_ids),
        loss_mask=array("B"),
        status=Status.FAILED,
        finish_reason="rejected",
        error=str(exc)[:1000],
    )


def _ones(count: int) -> array[int]:
    """The loss mask of a response: every response token is trained on."""
    return array("B", b"\x01" * count)
