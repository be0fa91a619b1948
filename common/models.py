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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from operator import attrgetter
from typing import Any

from .arrays import FloatArray, IntArray, Packed, Unfetched, UnfetchedText, float_array, int_array, mask_array
from .payload.refs import GroupPayload
from .sample_fields import BIN_CODES, Kind, SampleField, declare

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
    """One generated response to a prompt.

    Each field declares itself once (``metadata=declare(wire key, kind, ...)``): the codec, the
    framework conversion and the batch's numpy views follow from :data:`SAMPLE_FIELDS`, in this
    order (the wire order). A new field is one declaration here (and its tests)."""

    index: int = field(metadata=declare("i", Kind.INT, required=True))
    """Position of the sample inside its group (0 .. n-1)."""
    tokens: IntArray = field(default_factory=lambda: array("i"), metadata=declare("tok", Kind.IDS, required=True,
                                                                                  numpy=True))
    """Prompt ids followed by response ids (response ids only when the prompt ids are unknown)."""
    response: str = field(default="", metadata=declare("resp", Kind.TEXT, required=True))
    response_length: int = field(default=0, metadata=declare("rlen", Kind.INT, required=True))
    """Response ids at the end of ``tokens``."""
    prompt_length: int = field(default=-1, metadata=declare("pl", Kind.INT, required=True, since=2))
    """Prompt ids at the start of ``tokens``: where the response starts. ``0`` when the producer did
    not know the prompt ids (``tokens`` then holds the response only). Left at ``-1`` on
    construction, it is set to ``len(tokens) - response_length``."""
    reward: Reward | None = field(default=None, metadata=declare("rew", Kind.REWARD))
    status: Status = field(default=Status.COMPLETED, metadata=declare("st", Kind.STATUS, required=True))
    finish_reason: str | None = field(default=None, metadata=declare("fr", Kind.OPT_TEXT))
    weight_versions: list[int] = field(default_factory=list, metadata=declare("wv", Kind.VERSIONS, required=True))
    """The engine's weight version of every engine call that produced this response."""
    rollout_log_probs: FloatArray | None = field(default=None, metadata=declare("lp", Kind.FLOATS, numpy=True))
    """Log-probs of the response tokens, as the engine computed them."""
    loss_mask: IntArray | None = field(default=None, metadata=declare("lm", Kind.MASK, length="response", numpy=True))
    """One ``0``/``1`` per response token (slime's and miles' convention: ``response_length`` long,
    ``1`` = trained on). The producer always fills it with ones; a trainer may replace it (groups
    from ``take()`` hold read-only views: copy before editing in place)."""
    error: str | None = field(default=None, metadata=declare("err", Kind.OPT_TEXT, since=2))
    """Why a FAILED sample failed (the engine's refusal), else None."""
    metadata: dict[str, Any] = field(default_factory=dict, metadata=declare("md", Kind.MAP, required=True))
    # --- what slime and miles train on beyond the above (all optional; unset costs nothing) ---
    routed_experts: Packed | None = field(default=None, metadata=declare(
        "re", Kind.PACKED, since=3, ndim=3, length="rows_or_media", framework="rollout_routed_experts", numpy=True))
    """MoE routing replay (R3): the experts every token was routed to, shape
    ``(len(tokens) - 1, layers, topk)``, from the engine (SGLang ``return_routed_experts``)."""
    indexer_topk: Packed | None = field(default=None, metadata=declare(
        "ix", Kind.PACKED, since=3, ndim=3, length="rows", framework="rollout_indexer_topk", numpy=True))
    """Indexer top-k replay of DSA models (miles ``rollout_indexer_topk``), shape
    ``(len(tokens) - 1, indexer_layers, index_topk)``."""
    top_p_token_ids: Packed | None = field(default=None, metadata=declare(
        "tpi", Kind.PACKED, since=3, pair="top_p_token_offsets", framework="rollout_top_p_token_ids", numpy=True))
    """Nucleus replay (slime ``rollout_top_p_token_ids``): for response token ``i`` the kept ids
    are ``top_p_token_ids[offsets[i]:offsets[i + 1]]``."""
    top_p_token_offsets: Packed | None = field(default=None, metadata=declare(
        "tpo", Kind.PACKED, since=3, length="offsets", pair="top_p_token_ids",
        framework="rollout_top_p_token_offsets", numpy=True))
    """``response_length + 1`` offsets into :attr:`top_p_token_ids`, starting at 0."""
    teacher_log_probs: FloatArray | None = field(default=None, metadata=declare(
        "tlp", Kind.FLOATS, since=3, length="response", framework="teacher_log_probs", numpy=True))
    """Log-probs of the response tokens under a teacher model (on-policy distillation)."""
    opd_reverse_kl: FloatArray | None = field(default=None, metadata=declare(
        "kl", Kind.FLOATS, since=3, length="response", framework="opd_reverse_kl", numpy=True))
    """Per-token reverse-KL estimate of on-policy distillation (miles), ``response_length`` long."""
    remove_sample: bool = field(default=False, metadata=declare("rm", Kind.FLAG, since=3, framework="remove_sample"))
    """Kept in the batch (its reward counts for the group baseline) but its loss is zeroed."""
    train_metadata: dict[str, Any] | None = field(default=None, metadata=declare(
        "tm", Kind.MAP, since=3, framework="train_metadata"))
    """Per-sample training options (e.g. which loss), handed to the trainer as ``metadata``."""
    rollout_id: int | None = field(default=None, metadata=declare("rid", Kind.GROUP_ID, since=3,
                                                                  framework="rollout_id"))
    """Shared by samples of one rollout execution (agent segments); None = one per sample."""
    spec_info: dict[str, int] | None = field(default=None, metadata=declare(
        "spec", Kind.COUNTERS, since=3, framework="spec_info", framework_type="SpecInfo"))
    """Speculative decoding counters (slime/miles ``SpecInfo``: spec_accept_token_num, ...)."""
    prefix_cache_info: dict[str, int] | None = field(default=None, metadata=declare(
        "pc", Kind.COUNTERS, since=3, framework="prefix_cache_info", framework_type="PrefixCacheInfo"))
    """Prefix-cache counters (``cached_tokens``, ``total_prompt_tokens``)."""
    non_generation_time: float = field(default=0.0, metadata=declare(
        "ngt", Kind.SECONDS, since=3, framework="non_generation_time"))
    """Seconds this sample spent outside the engine (tools, environment)."""
    adapter: Adapter | None = field(default=None, metadata=declare(
        "ad", Kind.ADAPTER, since=3, framework="adapter", framework_type="AdapterRef"))
    """The LoRA adapter of a multi-LoRA run (miles)."""
    multimodal_train_inputs: dict[str, Any] | None = field(default=None, metadata=declare(
        "mti", Kind.MEDIA, since=3, framework="multimodal_train_inputs"))
    """Processed media for the trainer (e.g. ``pixel_values``): plain data or :class:`Packed`."""
    weight_version_spans: list[tuple[int, int, int]] | None = field(
        default=None, metadata=declare("wvs", Kind.SPANS, since=2))
    """Optional per-token versions: ``(start, end, version)`` over the response tokens (offsets
    from ``prompt_length``, end exclusive), one span per engine call, in order; tokens of no span
    (tool observations) were not generated. Written by multi-turn episodes; None otherwise."""

    def __post_init__(self) -> None:
        _coerce(self)
        if self.prompt_length < 0:
            self.prompt_length = len(self.tokens) - self.response_length

    @property
    def oldest_version(self) -> int | None:
        """The oldest weight version of any engine call of this sample (the strict rule judges by it)."""
        return min(self.weight_versions) if self.weight_versions else None

    @property
    def newest_version(self) -> int | None:
        """The newest version that surely generated some of this sample's tokens (the default rule
        judges by it): the newest span's, else the newest call's. A call whose version moved while
        it ran, with nothing to say where (``weight_version_split: unknown``), counts as the older
        one: its tokens may all predate the update."""
        if not self.weight_versions:
            return None
        if self.weight_version_spans:
            return max(version for _, _, version in self.weight_version_spans)
        if self.metadata.get("weight_version_split") == "unknown":
            return min(self.weight_versions)
        return max(self.weight_versions)

    def token_versions(self) -> array[int]:
        """The weight version of each response token (``response_length`` ints): from
        :attr:`weight_version_spans`, else the one version of the sample; tokens of no span (tool
        observations) and samples whose split is unknown get the oldest version (never too new).
        Empty when the sample has no version."""
        length = self.response_length
        oldest = self.oldest_version
        if oldest is None:
            return array("i")
        versions = array("i", [oldest]) * length
        for start, end, version in self.weight_version_spans or ():
            start, end = max(0, start), min(length, end)
            if end > start:
                versions[start:end] = array("i", [version]) * (end - start)
        return versions

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
        return _values(self) == _values(other)


SAMPLE_FIELDS: tuple[SampleField, ...] = tuple(
    replace(f.metadata["sample_field"], name=f.name) for f in fields(Sample)
)
"""Every field of :class:`Sample`, declared once, in wire order (see :mod:`.sample_fields`)."""


def _adapter(value: Any) -> Adapter:
    return Adapter(str(value["name"]), int(value["slot"])) if isinstance(value, dict) else value


def _status(value: Any) -> Status:
    return value if type(value) is Status else Status(value)


def _packed_of(value: object) -> Packed:
    if isinstance(value, Packed | Unfetched):  # Unfetched: a placeholder until fetched
        return value  # type: ignore[return-value]
    return Packed.of(value)


_COERCE: dict[Kind, Callable[[Any], Any]] = {
    Kind.IDS: int_array, Kind.FLOATS: float_array, Kind.MASK: mask_array, Kind.PACKED: _packed_of,
    Kind.ADAPTER: _adapter, Kind.STATUS: _status,
}
"""What a field of each kind accepts on construction, made into its own type."""


def _write_coerce() -> Callable[[Sample], None]:
    """``_coerce(sample)``: every field of a kind in ``_COERCE`` made into its own type (a required
    one always, another unless None), written out from :data:`SAMPLE_FIELDS` once at import, as
    :mod:`dataclasses` writes ``__init__`` (a loop over the fields costs every sample more)."""
    env: dict[str, Any] = {}
    lines = ["def _coerce(sample):"]
    for i, f in enumerate(SAMPLE_FIELDS):
        if f.kind not in _COERCE:
            continue
        env[f"_c{i}"] = _COERCE[f.kind]
        if f.required:
            lines.append(f"    sample.{f.name} = _c{i}(sample.{f.name})")
        else:
            lines += [f"    if sample.{f.name} is not None:", f"        sample.{f.name} = _c{i}(sample.{f.name})"]
    exec(compile("\n".join(lines), "<rollstream.common.models: SAMPLE_FIELDS>", "exec"), env)
    coerce: Callable[[Sample], None] = env["_coerce"]
    return coerce


_coerce = _write_coerce()
_ALL_VALUES = attrgetter(*(f.name for f in SAMPLE_FIELDS))
_ARRAYS = tuple(i for i, f in enumerate(SAMPLE_FIELDS) if f.kind in BIN_CODES)
_TEXT = next(i for i, f in enumerate(SAMPLE_FIELDS) if f.name == "response")


def _values(sample: Sample) -> list[Any]:
    """The sample's values, packed arrays as lists (an array and a view of it compare equal)."""
    values = list(_ALL_VALUES(sample))
    for i in _ARRAYS:
        if values[i] is not None and not isinstance(values[i], Unfetched):  # a placeholder: itself
            values[i] = values[i].tolist()
    if isinstance(values[_TEXT], UnfetchedText):  # the text in the store: compared by where it is
        values[_TEXT] = (UnfetchedText, values[_TEXT].key, values[_TEXT].nbytes)
    return values


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
    source: str = ""
    """The named dataset source it was fed from (``rollstream feed NAME=PATH``); "" unnamed."""
    admitted_ms: int = 0
    """When a producer first admitted it (Unix ms; 0: not yet): kept across its attempts, so the
    trainer can tell how late it is trained (issue 38)."""
    payload: GroupPayload | None = None
    """Where the arrays of its ``partial`` samples that left the entry are (the payload store: the
    objects of the group it was recycled from, which its entry keeps held; None: all inline). Until
    the producer fetches them (:meth:`~.payload.refs.GroupPayload.attach`) those fields are unset."""

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
    source: str = ""
    """The dataset source of its prompt (carried over from the Prompt): the namespace's mix."""
    admitted_ms: int = 0
    """When its prompt was first admitted (Unix ms; 0: unknown), carried over from the Prompt."""
    generated_ms: int = 0
    """How long the attempt that made it took, admission to group (ms; 0: unknown)."""
    payload: GroupPayload | None = None
    """Where its arrays that left the entry are (the payload store; None: all in the entry). Until
    they are fetched (``Batch.fetch``, or any numpy view of the batch) those sample fields hold
    :class:`~.arrays.Unfetched` placeholders: their lengths are known, reading their values raises
    :class:`~.errors.PayloadNotFetched`."""

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

    def staleness(self, trainer_version: int, rule: str = "newest_token") -> int:
        """How many versions behind the trainer the group is (0 when no version is known).

        ``newest_token`` (the default, docs/staleness.md): from the newest version of any token,
        the version the group was finished under, so how long the group waited for the trainer
        once generated, whatever its length: a generation continued across weight updates, and
        the short samples of a group waiting for its longest, are not penalised (their older
        tokens carry their lag to the trainer instead). ``oldest_token``: from the oldest version
        of any sample (strict: grows with the generation's length)."""
        if rule == "oldest_token":
            since = self.min_version
        else:
            newest = [v for s in self.samples if (v := s.newest_version) is not None]
            since = max(newest) if newest else None
        return 0 if since is None else max(0, trainer_version - since)

    def token_lags(self, trainer_version: int) -> tuple[int, int, int]:
        """(sum, max, count) of the response tokens' version lags behind ``trainer_version``
        (generated tokens of samples that carry versions)."""
        total = worst = count = 0
        for sample in self.samples:
            oldest = sample.oldest_version
            if oldest is None:
                continue
            if not sample.weight_version_spans:
                lag, n = max(0, trainer_version - oldest), sample.response_length
                total, count, worst = total + lag * n, count + n, max(worst, lag if n else 0)
                continue
            for start, end, version in sample.weight_version_spans:
                lag, n = max(0, trainer_version - version), max(0, end - start)
                total, count, worst = total + lag * n, count + n, max(worst, lag if n else 0)
        return total, worst, count


MAX_HISTORY = 20
"""Recycle reasons a prompt keeps (the newest)."""


def retry_prompt(group: Group, reason: str, *, keep_partial: bool = False, uses_attempt: bool = True) -> Prompt:
    """The prompt of ``group`` for its next attempt: ``attempt + 1`` (unchanged when not
    ``uses_attempt``: a group recycled as stale is the pipeline's doing, not the prompt's),
    ``reason`` added to its history, the prompt ids of its samples kept (when the producer knew
    them, and fetched: a group whose tokens are still in the payload store gives none: the producer
    takes them from the fetched partial samples, or tokenizes the prompt again) and, with
    ``keep_partial``, the samples themselves (partial rollout continues them), their arrays in the
    payload store staying where they are (``payload``: the prompt's entry refers to the group's
    objects, no fetch and no copy).

    The one group -> prompt conversion: recycling and dead-lettering a group both use it."""
    first = group.samples[0] if group.samples else None
    input_ids = (  # tokens still in the payload store: the producer tokenizes the prompt again
        array("i", first.tokens[: first.prompt_length])
        if first is not None and first.prompt_length > 0 and not isinstance(first.tokens, Unfetched) else None
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
        source=group.source,
        admitted_ms=group.admitted_ms,
        payload=group.payload if keep_partial else None,
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


def multimodal_of(prompt: PromptContent, images: object = None) -> dict[str, Any] | None:
    """The ``multimodal_inputs`` of a dataset record: the chat prompt's images, else the record's
    own ``images`` list (slime's ``--multimodal-keys`` convention); None without images."""
    found = prompt_images(prompt)
    if not found and isinstance(images, list) and all(isinstance(i, str) for i in images):
        found = list(images)
    return {"images": found} if found else None


def as_prompt_content(value: object) -> PromptContent:
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
