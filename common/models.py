"""The data model: prompts in, groups of samples out.

Token ids, log-probs and loss masks are kept as :class:`array.array` (``'i'``, ``'f'``, ``'B'``)
so that the codec moves them as packed little-endian bytes without a Python-level loop; any
sequence is accepted on construction and ``.tolist()`` gives plain lists back. Groups decoded by
``take()`` hold them as memoryviews cast to the same formats, on the entry's bytes (no
copy): both support ``len``, indexing, slicing, iteration, ``.tolist()``, ``.tobytes()`` and the
buffer protocol (``numpy.frombuffer``); to build a longer one, copy first (``array("i", v)``).

The per-token arrays slime and miles train on beside those (routing replay, indexer and top-p
replay) are :class:`~.arrays.Packed`: a flat packed array in its smallest exact integer dtype
(``uint8`` expert ids when they fit) and a shape, so that a 48-layer top-8 routing replay costs
384 bytes a token, not 384 msgpack ints. Every optional field left at its default costs nothing
on the wire. The arrays themselves live in :mod:`.arrays` (imported here for the model's users).
"""

from __future__ import annotations

import enum
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .arrays import FloatArray, IntArray, Packed, float_array, int_array, mask_array

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


@dataclass(frozen=True, slots=True)
class Adapter:
    """The LoRA adapter a sample is bound to (miles' ``AdapterRef``: multi-LoRA slot)."""

    name: str
    slot: int


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
    # --- what slime and miles train on beyond the above (all optional; unset costs nothing) ---
    routed_experts: Packed | None = None
    """MoE routing replay (R3): the experts every token was routed to, shape
    ``(len(tokens) - 1, layers, topk)``, from the engine (SGLang ``return_routed_experts``)."""
    indexer_topk: Packed | None = None
    """Indexer top-k replay of DSA models (miles ``rollout_indexer_topk``), shape
    ``(len(tokens) - 1, indexer_layers, index_topk)``."""
    top_p_token_ids: Packed | None = None
    """Nucleus replay (slime ``rollout_top_p_token_ids``): for response token ``i`` the kept ids
    are ``top_p_token_ids[offsets[i]:offsets[i + 1]]``."""
    top_p_token_offsets: Packed | None = None
    """``response_length + 1`` offsets into :attr:`top_p_token_ids`, starting at 0."""
    teacher_log_probs: FloatArray | None = None
    """Log-probs of the response tokens under a teacher model (on-policy distillation)."""
    opd_reverse_kl: FloatArray | None = None
    """Per-token reverse-KL estimate of on-policy distillation (miles), ``response_length`` long."""
    remove_sample: bool = False
    """Kept in the batch (its reward counts for the group baseline) but its loss is zeroed."""
    train_metadata: dict[str, Any] | None = None
    """Per-sample training options (e.g. which loss), handed to the trainer as ``metadata``."""
    rollout_id: int | None = None
    """Shared by samples of one rollout execution (agent segments); None = one per sample."""
    spec_info: dict[str, int] | None = None
    """Speculative decoding counters (slime/miles ``SpecInfo``: spec_accept_token_num, ...)."""
    prefix_cache_info: dict[str, int] | None = None
    """Prefix-cache counters (``cached_tokens``, ``total_prompt_tokens``)."""
    non_generation_time: float = 0.0
    """Seconds this sample spent outside the engine (tools, environment)."""
    adapter: Adapter | None = None
    """The LoRA adapter of a multi-LoRA run (miles)."""
    multimodal_train_inputs: dict[str, Any] | None = None
    """Processed media for the trainer (e.g. ``pixel_values``): plain data or :class:`Packed`."""
    weight_version_spans: list[tuple[int, int, int]] | None = None
    """Optional per-token versions: ``(start, end, version)`` over the response tokens (offsets
    from ``prompt_length``, end exclusive), one span per engine call, in order; tokens of no span
    (tool observations) were not generated. Written by multi-turn episodes; None otherwise."""

    def __post_init__(self) -> None:
        self.tokens = int_array(self.tokens)
        if self.rollout_log_probs is not None:
            self.rollout_log_probs = float_array(self.rollout_log_probs)
        if self.loss_mask is not None:
            self.loss_mask = mask_array(self.loss_mask)
        for name in ("routed_experts", "indexer_topk", "top_p_token_ids", "top_p_token_offsets"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Packed):
                setattr(self, name, Packed.of(value))
        if self.teacher_log_probs is not None:
            self.teacher_log_probs = float_array(self.teacher_log_probs)
        if self.opd_reverse_kl is not None:
            self.opd_reverse_kl = float_array(self.opd_reverse_kl)
        if isinstance(self.adapter, dict):
            self.adapter = Adapter(str(self.adapter["name"]), int(self.adapter["slot"]))
        self.status = Status(self.status)
        if self.prompt_length < 0:
            self.prompt_length = len(self.tokens) - self.response_length

    @property
    def oldest_version(self) -> int | None:
        """The oldest weight version of any engine call of this sample (staleness is judged by it)."""
        return min(self.weight_versions) if self.weight_versions else None

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
        sample.routed_experts,
        sample.indexer_topk,
        sample.top_p_token_ids,
        sample.top_p_token_offsets,
        None if sample.teacher_log_probs is None else sample.teacher_log_probs.tolist(),
        None if sample.opd_reverse_kl is None else sample.opd_reverse_kl.tolist(),
        sample.remove_sample,
        sample.train_metadata,
        sample.rollout_id,
        sample.spec_info,
        sample.prefix_cache_info,
        sample.non_generation_time,
        sample.adapter,
        sample.multimodal_train_inputs,
        sample.weight_version_spans,
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
    multimodal_inputs: dict[str, Any] | None = None
    """Raw media of the prompt (e.g. ``{"images": [...]}``: URLs or base64 data), passed to the
    engines and carried to the trainer."""

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
    multimodal_inputs: dict[str, Any] | None = None
    """The prompt's raw media (carried over from the Prompt)."""

    @property
    def status(self) -> Status:
        """The worst status of the samples: FAILED > ABORTED > TRUNCATED > COMPLETED."""
        statuses = {s.status for s in self.samples}
        for status in (Status.FAILED, Status.ABORTED, Status.TRUNCATED):
            if status in statuses:
                return status
        return Status.COMPLETED

    def size_error(self, n: int) -> str | None:
        """Why this group does not hold ``n`` episodes (None when it does): ``n`` samples, or
        more whose indices (episode ids, shared by an episode's segments) are exactly ``0..n-1``."""
        if len(self.samples) == n:
            return None
        if len(self.samples) > n and {s.index for s in self.samples} == set(range(n)):
            return None
        return f"{len(self.samples)} samples, expected {n}"

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
        multimodal_inputs=group.multimodal_inputs,
    )


def prompt_images(prompt: PromptContent) -> list[str]:
    """The images of a chat prompt: every ``image_url`` (OpenAI: ``{"type": "image_url",
    "image_url": {"url": ...}}``) or ``image`` (``{"type": "image", "image": ...}``) content part,
    in order (URLs or ``data:`` URIs, as the engines take them)."""
    images: list[str] = []
    if isinstance(prompt, str):
        return images
    for message in prompt:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict):
                continue
            if part.get("type") == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if isinstance(url, str):
                    images.append(url)
            elif part.get("type") == "image" and isinstance(part.get("image"), str):
                images.append(part["image"])
    return images


def multimodal_of(prompt: PromptContent, images: Any = None) -> dict[str, Any] | None:
    """The ``multimodal_inputs`` of a dataset record: the chat prompt's images, else the record's
    own ``images`` list (slime's ``--multimodal-keys`` convention); None without images."""
    found = prompt_images(prompt)
    if not found and isinstance(images, list) and all(isinstance(i, str) for i in images):
        found = list(images)
    return {"images": found} if found else None


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
