"""The data model: prompts in, groups of samples out.

Token ids, log-probs and loss masks are kept as :class:`array.array` (``'i'``, ``'f'``, ``'B'``)
so that the codec moves them as packed little-endian bytes without a Python-level loop; any
sequence is accepted on construction and ``.tolist()`` gives plain lists back. Groups decoded by
``take()`` hold them as memoryviews cast to the same formats, on the entry's bytes (no
copy): both support ``len``, indexing, slicing, iteration, ``.tolist()``, ``.tobytes()`` and the
buffer protocol (``numpy.frombuffer``); to build a longer one, copy first (``array("i", v)``).
"""

from __future__ import annotations

import enum
import math
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

Reward = float | dict[str, float]
PromptContent = str | list[dict[str, Any]]


class Status(enum.StrEnum):
    """How a sample's generation ended."""

    COMPLETED = "completed"
    """The engine stopped on its own (EOS or a stop string)."""
    TRUNCATED = "truncated"
    """The engine hit ``max_new_tokens``."""
    ABORTED = "aborted"
    """The engine aborted the request (e.g. paused for a weight update): the group is recycled."""
    FAILED = "failed"
    """The engine refused the request: the group is recycled until ``max_attempts``."""

    @classmethod
    def from_finish_reason(cls, reason: str | None) -> Status:
        """Map SGLang's / OpenAI's ``finish_reason`` type to a status."""
        if reason in ("stop", "eos", "stop_str", None):
            return cls.COMPLETED
        if reason == "length":
            return cls.TRUNCATED
        if reason == "abort":
            return cls.ABORTED
        return cls.COMPLETED


IntArray: TypeAlias = "array[int] | memoryview[int]"
"""Packed ints: an ``array`` (``'i'`` ids, ``'B'`` masks) or a zero-copy ``memoryview`` of that format."""
FloatArray: TypeAlias = "array[float] | memoryview[float]"
"""Packed float32s: an ``array('f')`` or a zero-copy ``memoryview`` of format ``'f'``."""


def _packed(values: Any, typecode: str) -> bool:
    if isinstance(values, array):
        return values.typecode == typecode
    return isinstance(values, memoryview) and values.format == typecode and values.ndim == 1


def int_array(values: Iterable[int] | None) -> IntArray:
    if _packed(values, "i"):
        return values  # type: ignore[return-value]
    return array("i", values or ())


def float_array(values: Iterable[float] | None) -> FloatArray:
    if _packed(values, "f"):
        return values  # type: ignore[return-value]
    return array("f", values or ())


def mask_array(values: Iterable[int] | None) -> IntArray:
    if _packed(values, "B"):
        return values  # type: ignore[return-value]
    return array("B", values or ())


@dataclass(slots=True, eq=False)
class Sample:
    """One generated response to a prompt."""

    index: int
    """Position of the sample inside its group (0 .. n-1)."""
    tokens: IntArray = field(default_factory=lambda: array("i"))
    """Prompt ids followed by response ids (response ids only when the prompt ids are unknown)."""
    response: str = ""
    response_length: int = 0
    """Response ids at the end of ``tokens``."""
    prompt_length: int = -1
    """Prompt ids at the start of ``tokens``: where the response starts. ``0`` when the producer did
    not know the prompt ids (``tokens`` then holds the response only). Left at ``-1`` on
    construction, it is set to ``len(tokens) - response_length``."""
    reward: Reward | None = None
    status: Status = Status.COMPLETED
    finish_reason: str | None = None
    weight_versions: list[int] = field(default_factory=list)
    """The engine's weight version of every engine call that produced this response."""
    rollout_log_probs: FloatArray | None = None
    """Log-probs of the response tokens, as the engine computed them."""
    loss_mask: IntArray | None = None
    """One ``0``/``1`` per response token (slime's and miles' convention: ``response_length`` long,
    ``1`` = trained on). The producer always fills it with ones; a trainer may replace it (groups
    from ``take()`` hold read-only views: copy before editing in place)."""
    error: str | None = None
    """Why a FAILED sample failed (the engine's refusal), else None."""
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tokens = int_array(self.tokens)
        if self.rollout_log_probs is not None:
            self.rollout_log_probs = float_array(self.rollout_log_probs)
        if self.loss_mask is not None:
            self.loss_mask = mask_array(self.loss_mask)
        self.status = Status(self.status)
        if self.prompt_length < 0:
            self.prompt_length = len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> IntArray:
        return self.tokens[self.prompt_length :]

    @property
    def scalar_reward(self) -> float:
        """The reward as one float: the float itself, or the ``score`` key of a dict reward."""
        if self.reward is None:
            return math.nan
        if isinstance(self.reward, dict):
            return float(self.reward.get("score", math.nan))
        return float(self.reward)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sample):
            return NotImplemented
        return _as_tuple(self) == _as_tuple(other)


def _as_tuple(sample: Sample) -> tuple[Any, ...]:
    return (
        sample.index,
        sample.tokens.tolist(),
        sample.response,
        sample.response_length,
        sample.prompt_length,
        sample.reward,
        sample.status,
        sample.finish_reason,
        sample.weight_versions,
        None if sample.rollout_log_probs is None else sample.rollout_log_probs.tolist(),
        None if sample.loss_mask is None else sample.loss_mask.tolist(),
        sample.error,
        sample.metadata,
    )


@dataclass(slots=True)
class Prompt:
    """A prompt waiting in (or recycled into) the prompt stream."""

    index: int
    """Global, increasing index assigned by the feeder."""
    prompt: PromptContent
    label: Any = None
    epoch: int = 0
    attempt: int = 0
    """How many times this prompt was recycled (0 for the first attempt)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    input_ids: array[int] | None = None
    """Prompt token ids, when the feeder tokenised the prompt."""
    partial: list[Sample] | None = None
    """With partial rollout: the samples of the aborted attempt, continued by the next one."""
    history: list[str] = field(default_factory=list)
    """Why earlier attempts were recycled, newest last (for the dead-letter reason)."""

    def __post_init__(self) -> None:
        if self.input_ids is not None:  # an array of its own: the producer extends it
            ids = int_array(self.input_ids)
            self.input_ids = ids if isinstance(ids, array) else array("i", ids)


@dataclass(slots=True)
class Group:
    """The ``n`` samples of one prompt, scored: the unit the trainer consumes."""

    index: int
    prompt: PromptContent
    samples: list[Sample]
    label: Any = None
    epoch: int = 0
    attempt: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    producer: str = ""
    history: list[str] = field(default_factory=list)
    """Why earlier attempts of this prompt were recycled (carried over from the Prompt)."""

    @property
    def status(self) -> Status:
        """The worst status of the samples: FAILED > ABORTED > TRUNCATED > COMPLETED."""
        statuses = {s.status for s in self.samples}
        for status in (Status.FAILED, Status.ABORTED, Status.TRUNCATED):
            if status in statuses:
                return status
        return Status.COMPLETED

    @property
    def min_version(self) -> int | None:
        """The oldest weight version any sample was generated with."""
        versions = [v for s in self.samples for v in s.weight_versions]
        return min(versions) if versions else None

    @property
    def max_version(self) -> int | None:
        versions = [v for s in self.samples for v in s.weight_versions]
        return max(versions) if versions else None

    @property
    def reward_mean(self) -> float:
        rewards = [s.scalar_reward for s in self.samples]
        rewards = [r for r in rewards if not math.isnan(r)]
        return sum(rewards) / len(rewards) if rewards else math.nan

    def staleness(self, trainer_version: int) -> int:
        """Trainer version minus the oldest sample version (0 when no version is known)."""
        oldest = self.min_version
        return 0 if oldest is None else max(0, trainer_version - oldest)


MAX_HISTORY = 20
"""Recycle reasons a prompt keeps (the newest)."""


def retry_prompt(group: Group, reason: str, *, keep_partial: bool = False, uses_attempt: bool = True) -> Prompt:
    """The prompt of ``group`` for its next attempt: ``attempt + 1`` (unchanged when not
    ``uses_attempt``: a group recycled as stale is the pipeline's doing, not the prompt's),
    ``reason`` added to its history, the prompt ids of its samples kept (when the producer knew
    them) and, with ``keep_partial``, the samples themselves (partial rollout continues them).

    The one group -> prompt conversion: recycling and dead-lettering a group both use it."""
    first = group.samples[0] if group.samples else None
    input_ids = (
        array("i", first.tokens[: first.prompt_length]) if first is not None and first.prompt_length > 0 else None
    )
    return Prompt(
        index=group.index,
        prompt=group.prompt,
        label=group.label,
        epoch=group.epoch,
        attempt=group.attempt + 1 if uses_attempt else group.attempt,
        metadata=dict(group.metadata),
        input_ids=input_ids,
        partial=group.samples if keep_partial else None,
        history=[*group.history, reason][-MAX_HISTORY:],
    )


def as_prompt_content(value: Any) -> PromptContent:
    """Validate a dataset's prompt field: a string or a list of chat messages."""
    if isinstance(value, str):
        return value
    if isinstance(value, Sequence) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value
    ):
        return [dict(m) for m in value]
    raise ValueError(
        "a prompt must be a string or a list of chat messages ({'role': ..., 'content': ...})"
    )
