"""The data model: prompts in, groups of samples out.

Token ids, log-probs and loss masks are kept as :class:`array.array` (``'i'``, ``'f'``, ``'B'``)
so that the codec moves them as packed little-endian bytes without a Python-level loop; any
sequence is accepted on construction and ``.tolist()`` gives plain lists back. Groups decoded by
``take()`` hold them as memoryviews cast to the same formats, on the entry's bytes (no
copy): both support ``len``, indexing, slicing, iteration, ``.tolist()``, ``.tobytes()`` and the
buffer protocol (``numpy.frombuffer``); to build a longer one, copy first (``array("i", v)``).

The per-token arrays slime and miles train on beside those (routing replay, indexer and top-p
replay) are :class:`Packed`: a flat packed array in its smallest exact integer dtype (``uint8``
expert ids when they fit) and a shape, so that a 48-layer top-8 routing replay costs 384 bytes a
token, not 384 msgpack ints. Every optional field left at its default costs nothing on the wire.
"""

from __future__ import annotations

import enum
import math
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from .imports import require_extra

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


PACKED_CODES = ("B", "H", "i", "f")
"""Typecodes a :class:`Packed` holds: uint8, uint16, int32 (the integer ladder) and float32."""
_INT_LIMITS = (("B", 0, 0xFF), ("H", 0, 0xFFFF), ("i", -(2**31), 2**31 - 1))
_NUMPY_NAMES = {"B": "uint8", "H": "uint16", "i": "int32", "f": "float32"}


def smallest_int_code(lo: int, hi: int) -> str:
    """The smallest typecode of the integer ladder that holds every value in ``lo..hi`` exactly."""
    for code, low, high in _INT_LIMITS:
        if low <= lo and hi <= high:
            return code
    raise ValueError(f"integer values {lo}..{hi} do not fit in int32")


def _shape_of(values: Any) -> tuple[int, ...]:
    shape = []
    while isinstance(values, list | tuple):
        shape.append(len(values))
        if not values:
            break
        values = values[0]
    return tuple(shape)


def _flatten(values: Any, depth: int) -> list[Any]:
    for _ in range(depth - 1):
        values = [x for row in values for x in row]
    return list(values)


@dataclass(slots=True, eq=False)
class Packed:
    """An n-dimensional array as one flat packed array and a shape (rows first).

    ``data`` is an ``array`` or, in groups from ``take()``, a memoryview on the entry's bytes
    (zero-copy); :meth:`numpy` is a view on it. Build one with :meth:`of` (nested lists, numpy
    arrays, torch tensors, or a flat buffer with a shape), which picks the smallest exact dtype.
    """

    data: Any
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        code = _code_of(self.data)
        if code not in PACKED_CODES:
            raise ValueError(f"a Packed array holds one of {PACKED_CODES}, got {code!r}")
        self.shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in self.shape) or math.prod(self.shape) != len(self.data):
            raise ValueError(f"shape {self.shape} does not match {len(self.data)} values")

    @property
    def typecode(self) -> str:
        return _code_of(self.data)

    @property
    def row_size(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def nbytes(self) -> int:
        return len(self.data) * self.data.itemsize

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 0

    @classmethod
    def of(cls, values: Any, shape: Sequence[int] | None = None, *, floats: bool = False) -> Packed:
        """``values`` packed: a Packed as it is; a numpy array or torch tensor (any int dtype,
        narrowed to the smallest exact one; floats become float32); nested lists; or a flat
        sequence with ``shape``. ``floats`` packs as float32 instead of integers."""
        if isinstance(values, Packed):
            return values
        if hasattr(values, "detach") and hasattr(values, "cpu"):  # a torch tensor
            values = values.detach().cpu()
            if str(values.dtype) in ("torch.bfloat16", "torch.float16"):  # numpy has no bfloat16
                values = values.float()
            values = values.numpy()
        if hasattr(values, "dtype") and hasattr(values, "astype") and hasattr(values, "shape"):
            return cls._of_ndarray(values, floats)
        if shape is None and _code_of(values):  # a flat packed array: one dimension
            shape = (len(values),)
        if shape is None:
            shape = _shape_of(values)
            flat = _flatten(values, len(shape)) if shape else []
        else:
            flat = values
        shape = tuple(shape)
        if floats or _code_of(flat) == "f":
            return cls(flat if _code_of(flat) == "f" else array("f", flat), shape)
        if _code_of(flat) in ("B", "H", "i"):
            data: Any = flat
            if len(flat):
                code = smallest_int_code(min(flat), max(flat))
                if code != _code_of(flat):
                    data = array(code, flat)
            return cls(data, shape)
        ints = flat if isinstance(flat, list) else list(flat)
        code = smallest_int_code(min(ints), max(ints)) if ints else "B"
        return cls(array(code, ints), shape)

    @classmethod
    def _of_ndarray(cls, values: Any, floats: bool) -> Packed:
        shape = tuple(int(d) for d in values.shape)
        kind = values.dtype.kind
        if floats or kind == "f":
            code = "f"
        elif kind in "iub":
            code = smallest_int_code(int(values.min()), int(values.max())) if values.size else "B"
        else:
            raise ValueError(f"cannot pack an array of dtype {values.dtype}")
        data = array(code)
        data.frombytes(values.astype(_NUMPY_NAMES[code]).tobytes())  # native order, C-contiguous copy
        return cls(data, shape)

    def numpy(self) -> Any:
        """A numpy array of this shape sharing the memory (read-only for groups from ``take()``)."""
        np = require_extra("numpy", "numpy", "numpy views of packed arrays")
        return np.frombuffer(self.data, dtype=_NUMPY_NAMES[self.typecode]).reshape(self.shape)

    def tolist(self) -> list[Any]:
        flat = self.data.tolist()
        for d in reversed(self.shape[1:]):
            flat = [flat[i : i + d] for i in range(0, len(flat), d)]
        return flat

    def rows(self, stop: int) -> Packed:
        """The first ``stop`` rows (a view when ``data`` is a memoryview)."""
        stop = max(0, min(stop, len(self)))
        return Packed(self.data[: stop * self.row_size], (stop, *self.shape[1:]))

    def concat(self, other: Packed) -> Packed:
        """These rows followed by ``other``'s (a copy, in the smallest dtype holding both)."""
        if self.shape[1:] != other.shape[1:]:
            raise ValueError(f"cannot append rows of shape {other.shape[1:]} to rows of shape {self.shape[1:]}")
        if "f" in (self.typecode, other.typecode):
            return Packed(array("f", [*self.data, *other.data]), (len(self) + len(other), *self.shape[1:]))
        codes = [c for c, _, _ in _INT_LIMITS]
        code = codes[max(codes.index(self.typecode), codes.index(other.typecode))]
        data = array(code, self.data)
        data.extend(other.data if _code_of(other.data) == code else array(code, other.data))
        return Packed(data, (len(self) + len(other), *self.shape[1:]))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Packed):
            return NotImplemented
        return self.shape == other.shape and self.data.tolist() == other.data.tolist()

    def __repr__(self) -> str:
        return f"Packed({self.typecode}, shape={self.shape})"


def _code_of(values: Any) -> str:
    if isinstance(values, array):
        return values.typecode
    if isinstance(values, memoryview):
        return values.format
    return ""


@dataclass(frozen=True, slots=True)
class Adapter:
    """The LoRA adapter a sample is bound to (miles' ``AdapterRef``: multi-LoRA slot)."""

    name: str
    slot: int


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


def retry_prompt(group: Group, reason: str, *, keep_partial: bool = False) -> Prompt:
    """The prompt of ``group`` for its next attempt: ``attempt + 1``, ``reason`` added to its
    history, the prompt ids of its samples kept (when the producer knew them) and, with
    ``keep_partial``, the samples themselves (partial rollout continues them).

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
        attempt=group.attempt + 1,
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
