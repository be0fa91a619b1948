"""rollstream ``Group``/``Sample`` <-> the framework's ``Sample``, shared by slime and miles.

The framework is never imported when rollstream is: its ``Sample`` class and output types are
looked up at call time (:meth:`Framework.sample_class`), so neither slime nor miles is a
dependency and a missing one is a clear :class:`ConfigError`.

A rollstream group of ``n`` samples becomes ``n`` framework samples with every field the
framework's training path reads:

* ``tokens`` = prompt ids + response ids, ``response_length``, ``response``;
* ``loss_mask`` and ``rollout_log_probs`` of length ``response_length`` (the mask is all ones
  when the producer sent none);
* ``status`` mapped by value (COMPLETED, TRUNCATED, ABORTED, FAILED), ``weight_versions`` as
  strings, ``reward``, ``label``, ``prompt``;
* ``group_index`` = the prompt's index, ``index`` = ``group_index * n + position`` (unique in the
  run, like slime's data source) and ``rollout_id`` = ``index`` (one training sample per rollout
  execution, what slime's default path assumes);
* ``metadata`` = the group's metadata updated with the sample's, plus a ``"rollstream"`` entry
  holding what the framework has no field for (epoch, attempt, producer, history, the finish
  reason, the position in the group, and the values of rollstream fields this framework lacks,
  e.g. miles' indexer replay on slime), so :func:`from_framework` restores the group exactly;
* the training fields of wire format v3, where the framework has them (docs/integrations.md has
  the table): ``rollout_routed_experts`` and ``rollout_indexer_topk`` as ``int32`` numpy arrays of
  shape ``(len(tokens) - 1, layers, topk)`` (the frameworks' dtype: a ``uint8`` tensor would index
  as a mask), ``rollout_top_p_token_ids`` / ``_offsets`` as ``int32`` arrays, ``teacher_log_probs``
  and ``opd_reverse_kl`` as lists, ``remove_sample``, ``train_metadata``, ``rollout_id`` (shared by
  siblings: ``group_index * n + rollout_id``), ``spec_info`` / ``prefix_cache_info`` as the
  framework's own classes, ``non_generation_time``, ``adapter`` (miles' ``AdapterRef``),
  ``multimodal_inputs`` (the group's) and ``multimodal_train_inputs`` (packed values as numpy).

The way back of those declared fields, one rule per kind (:func:`framework_fields`), serves both
:func:`from_framework` and the samples a slime/miles generate function returns on a producer
(:mod:`.generate`), so a new field is converted both ways from its declaration.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import operator
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rollstream.common.arrays import Packed, float_array, int_array, mask_array
from rollstream.common.checked import is_int
from rollstream.common.errors import ConfigError
from rollstream.common.imports import require_extra
from rollstream.common.models import SAMPLE_FIELDS, Adapter, Group, Sample, Status
from rollstream.common.sample_fields import Kind, SampleField

INFO_KEY = "rollstream"
"""Key of the framework sample's ``metadata`` entry that carries rollstream's own fields."""


@dataclass(frozen=True, slots=True)
class Framework:
    """Where one framework keeps its ``Sample`` and rollout output types."""

    name: str
    sample_module: str
    types_module: str

    def _import(self, module: str) -> Any:
        try:
            return importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(
                f"the {self.name} package is not importable in this process ({module}: {exc}); "
                f"rollstream.integrations.{self.name} runs where {self.name} is installed"
            ) from exc

    def sample_class(self) -> Any:
        return self._import(self.sample_module).Sample

    def train_output(self, samples: list[list[Any]], metrics: dict[str, Any]) -> Any:
        return self._import(self.types_module).RolloutFnTrainOutput(samples=samples, metrics=metrics)

    def eval_output_class(self) -> Any:
        return self._import(self.types_module).RolloutFnEvalOutput

    def train_output_class(self) -> Any:
        return self._import(self.types_module).RolloutFnTrainOutput


SLIME = Framework("slime", "slime.utils.types", "slime.rollout.base_types")
MILES = Framework("miles", "miles.utils.types", "miles.rollout.base_types")


def _response_mask(sample: Sample) -> tuple[list[int], bool]:
    """The loss mask over the response tokens, and whether it was filled in (none was sent)."""
    n = sample.response_length
    mask = sample.loss_mask
    if mask is None:
        return [1] * n, True
    if len(mask) == n:
        return list(mask), False
    if len(mask) == len(sample.tokens):  # a mask over prompt + response: keep the response part
        return list(mask[len(mask) - n :]), False
    raise ValueError(
        f"sample {sample.index}: loss_mask has {len(mask)} entries for a response of {n} tokens"
    )


_FRAMEWORK_FIELDS = tuple(f for f in SAMPLE_FIELDS if f.framework is not None)
"""The fields converted from their declaration (``SampleField.framework``); the others, which
every framework sample has, are converted by :func:`to_framework` / :func:`from_framework`."""
_CANNOT = object()
"""What a rule returns when the framework has no way to hold the value (no class for it)."""


def _field_names(sample_cls: Any) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(sample_cls))


def _int32(packed: Packed) -> Any:
    np = require_extra("numpy", "numpy", "routing / top-p replay for slime and miles")
    return packed.numpy().astype(np.int32)


def _framework_class(sample_cls: Any, name: str) -> Any:
    """A class beside ``sample_cls`` (``Sample.SpecInfo``, miles' ``AdapterRef``), or None."""
    nested = getattr(sample_cls, name, None)
    if nested is not None:
        return nested
    return getattr(sys.modules.get(sample_cls.__module__), name, None)


def _counters(cls: Any, values: dict[str, int] | None) -> Any:
    if cls is None or values is None:
        return None
    from_dict = getattr(cls, "from_dict", None)
    return from_dict(values) if from_dict is not None else cls(**values)


def _adapter_ref(value: Adapter, f: SampleField, sample_cls: Any, base: int) -> Any:
    ref = _framework_class(sample_cls, str(f.framework_type))
    return _CANNOT if ref is None else ref(name=value.name, slot=value.slot)


def _counters_to(value: dict[str, int], f: SampleField, sample_cls: Any, base: int) -> Any:
    counters = _counters(_framework_class(sample_cls, str(f.framework_type)), value)
    return _CANNOT if counters is None else counters


def _media_to(value: dict[str, Any], f: SampleField, sample_cls: Any, base: int) -> dict[str, Any]:
    return {k: v.numpy().copy() if isinstance(v, Packed) else v for k, v in value.items()}


ToFramework = Callable[[Any, SampleField, Any, int], Any]
_TO_FRAMEWORK: dict[Kind, ToFramework] = {
    Kind.PACKED: lambda value, f, cls, base: _int32(value),
    Kind.FLOATS: lambda value, f, cls, base: list(value),
    Kind.FLAG: lambda value, f, cls, base: value,
    Kind.MAP: lambda value, f, cls, base: value,
    Kind.SECONDS: lambda value, f, cls, base: value,
    Kind.GROUP_ID: lambda value, f, cls, base: base + value,  # unique in the run, shared by siblings
    Kind.COUNTERS: _counters_to,
    Kind.ADAPTER: _adapter_ref,
    Kind.MEDIA: _media_to,
}
"""A set field of each kind as the framework's field (``base`` = ``group_index * n``)."""
_TO_INFO: dict[Kind, Callable[[Any], Any]] = {
    Kind.PACKED: lambda p: [p.typecode, list(p.shape), p.data.tolist()],
    Kind.FLOATS: list,
    Kind.ADAPTER: lambda a: [a.name, a.slot],
    Kind.MEDIA: lambda m: {k: _TO_INFO[Kind.PACKED](v) if isinstance(v, Packed) else [None, v] for k, v in m.items()},
}
"""A field of each kind as plain data, kept in the metadata when the framework has no such field
(other kinds are kept as they are)."""
_FROM_INFO: dict[Kind, Callable[[Any], Any]] = {
    Kind.PACKED: lambda v: Packed.of(v[2], v[1], floats=v[0] == "f"),
    Kind.ADAPTER: lambda v: Adapter(str(v[0]), int(v[1])),
    Kind.MEDIA: lambda m: {k: v[1] if v[0] is None else _FROM_INFO[Kind.PACKED](v) for k, v in m.items()},
}


def _v3_kwargs(
    sample: Sample, group: Group, sample_cls: Any, names: frozenset[str], replays: bool = True
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The framework keyword arguments of ``sample``'s declared fields (``_FRAMEWORK_FIELDS``),
    the values of those the framework has no field for (the rollstream metadata entry's
    ``fields``) and the GROUP_ID values the framework renumbers (kept in that entry by name)."""
    base = group.index * len(group.samples)
    kwargs: dict[str, Any] = {}
    missing: dict[str, Any] = {}
    renumbered: dict[str, Any] = {}
    for f in _FRAMEWORK_FIELDS:
        value = getattr(sample, f.name)
        if f.kind is Kind.GROUP_ID:  # every framework sample has one: its position when unset
            if value is not None:
                renumbered[f.name] = value
            value = sample.index if value is None else value
        elif not f.is_set(value) or (f.kind is Kind.PACKED and not replays):
            continue
        theirs = _TO_FRAMEWORK[f.kind](value, f, sample_cls, base) if f.framework in names else _CANNOT
        if theirs is not _CANNOT:
            kwargs[str(f.framework)] = theirs
        elif f.kind is not Kind.GROUP_ID:
            missing[f.name] = _TO_INFO.get(f.kind, _same)(value)
    if group.multimodal_inputs is not None and "multimodal_inputs" in names:
        kwargs["multimodal_inputs"] = group.multimodal_inputs
    return kwargs, missing, renumbered


def _same(value: Any) -> Any:
    return value


def to_framework(group: Group, sample_cls: Any, *, for_training: bool = False, replays: bool = True) -> list[Any]:
    """The group's samples as framework samples (``sample_cls`` is the framework's ``Sample``).

    ``for_training`` refuses samples whose prompt ids are unknown: their ``tokens`` would hold
    the response alone and the trainer would learn without the prompt. ``replays=False`` leaves
    the routing, indexer and top-p replays out (a reward function: no int32 copies, no numpy).
    """
    n = len(group.samples)
    names = _field_names(sample_cls)
    out = []
    for sample in group.samples:
        prompt_length = len(sample.tokens) - sample.response_length
        if prompt_length < 0:
            raise ValueError(
                f"group {group.index} sample {sample.index}: response_length {sample.response_length} "
                f"exceeds the {len(sample.tokens)} tokens"
            )
        if for_training and (prompt_length == 0 or sample.metadata.get("prompt_ids") == "unknown"):
            raise ConfigError(
                f"group {group.index} (producer {group.producer or '?'}) has no prompt token ids, so "
                f"tokens would not be prompt + response: run the producers with --tokenizer (or feed "
                f"tokenised prompts)"
            )
        mask, filled = _response_mask(sample)
        log_probs = None
        if sample.rollout_log_probs is not None:
            log_probs = list(sample.rollout_log_probs)
            if len(log_probs) != sample.response_length:
                raise ValueError(
                    f"group {group.index} sample {sample.index}: {len(log_probs)} rollout log-probs "
                    f"for a response of {sample.response_length} tokens"
                )
        info = {
            "position": sample.index,
            "finish_reason": sample.finish_reason,
            "epoch": group.epoch,
            "attempt": group.attempt,
            "producer": group.producer,
            "history": list(group.history),
            "group_metadata": dict(group.metadata),
            "sample_metadata_keys": list(sample.metadata),
            "loss_mask_filled": filled,
        }
        kwargs, missing, renumbered = _v3_kwargs(sample, group, sample_cls, names, replays)
        if missing:
            info["fields"] = missing
        info.update(renumbered)
        index = group.index * n + sample.index
        out.append(
            sample_cls(
                group_index=group.index,
                index=index,
                prompt=group.prompt,
                tokens=list(sample.tokens),
                response=sample.response,
                response_length=sample.response_length,
                label=group.label,
                reward=sample.reward,
                loss_mask=mask,
                weight_versions=[str(v) for v in sample.weight_versions],
                rollout_log_probs=log_probs,
                status=sample_cls.Status(sample.status.value),
                metadata={**group.metadata, **sample.metadata, INFO_KEY: info},
                **kwargs,
            )
        )
    return out


def _packed_back(value: Any, f: SampleField, base: int) -> Packed | None:
    if value is None:
        return None
    packed = Packed.of(value)
    if len(packed.shape) != f.ndim:
        raise ValueError(f"shape {packed.shape}, not {f.ndim} dimensions")
    return packed


def _floats_back(value: Any, f: SampleField, base: int) -> list[float] | None:
    if value is None:
        return None
    if hasattr(value, "tolist"):
        value = value.tolist()
    return [float(v) for v in value]


def _map_back(value: Any, f: SampleField, base: int) -> dict[str, Any] | None:
    if value is not None and not isinstance(value, dict):
        raise TypeError(f"a {type(value).__name__}, not a dict")
    return value


def _seconds_back(value: Any, f: SampleField, base: int) -> float:
    seconds = float(value or 0.0)
    if not math.isfinite(seconds):
        raise ValueError(f"{seconds!r}, not a finite number of seconds")
    return seconds


def _counters_back(value: Any, f: SampleField, base: int) -> dict[str, int] | None:
    """The framework's SpecInfo / PrefixCacheInfo as a dict; None when all zero (its default)."""
    if value is None:
        return None
    values = value.to_dict() if hasattr(value, "to_dict") else dict(value)
    if not all(is_int(v) for v in values.values()):
        raise TypeError(f"not int counters: {values!r}")
    return values if any(values.values()) else None


def _group_id_back(value: Any, f: SampleField, base: int) -> int | None:
    """The inverse of ``base + value`` (the frameworks number it within the run), so the trainer
    sees the id the framework sample had, whatever the function numbered it (``sample.index``,
    ``group_index``, ...; exact while the group holds its ``n`` samples, as ``index`` is)."""
    return None if value is None else operator.index(value) - base


def _adapter_back(value: Any, f: SampleField, base: int) -> Adapter | None:
    return None if value is None else Adapter(str(value.name), int(value.slot))


def _media_back(value: Any, f: SampleField, base: int) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"a {type(value).__name__}, not a dict")
    return {k: Packed.of(v) if hasattr(v, "shape") and hasattr(v, "dtype") else v for k, v in value.items()}


FromFramework = Callable[[Any, SampleField, int], Any]
_FROM_FRAMEWORK: dict[Kind, FromFramework] = {
    Kind.PACKED: _packed_back,
    Kind.FLOATS: _floats_back,
    Kind.FLAG: lambda value, f, base: bool(value),
    Kind.MAP: _map_back,
    Kind.SECONDS: _seconds_back,
    Kind.GROUP_ID: _group_id_back,
    Kind.COUNTERS: _counters_back,
    Kind.ADAPTER: _adapter_back,
    Kind.MEDIA: _media_back,
}
"""A framework field of each kind back as ours, the inverse of :data:`_TO_FRAMEWORK` (None: the
framework's value is its default; ``base`` = ``group_index * n``); ValueError or TypeError when
the value cannot be ours."""


def framework_fields(fw: Any, base: int, info: dict[str, Any] | None = None) -> dict[str, Any]:
    """The declared fields (``SampleField.framework``) of framework sample ``fw`` as ours, each by
    its kind's rule; a field the framework lacks is unset. With ``info`` (the rollstream metadata
    entry :func:`to_framework` writes) the GROUP_IDs and the fields the framework lacks come from
    it. ValueError naming the framework field when a value cannot be ours."""
    out: dict[str, Any] = {}
    for f in _FRAMEWORK_FIELDS:
        if info is not None and f.kind is Kind.GROUP_ID:
            out[f.name] = info.get(f.name)
            continue
        value = getattr(fw, str(f.framework), None)
        try:
            out[f.name] = _FROM_FRAMEWORK[f.kind](value, f, base)
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{f.framework}: {exc}") from exc
    by_name = {f.name: f for f in _FRAMEWORK_FIELDS}
    for name, value in (info or {}).get("fields", {}).items():
        out[name] = _FROM_INFO.get(by_name[name].kind, _same)(value)
    return out


def _status(value: Any) -> Status:
    raw = getattr(value, "value", value)
    try:
        return Status(raw)
    except ValueError:
        raise ValueError(f"framework status {raw!r} has no rollstream equivalent (not generated yet?)") from None


def from_framework(samples: Sequence[Any]) -> Group:
    """The rollstream group of framework samples made by :func:`to_framework` (or by the framework)."""
    if not samples:
        raise ValueError("a group needs at least one sample")
    first = samples[0]
    first_info = (first.metadata or {}).get(INFO_KEY, {})
    base = int(first.group_index or 0) * len(samples)
    converted = []
    for position, fw in enumerate(samples):
        metadata = dict(fw.metadata or {})
        info = metadata.pop(INFO_KEY, {})
        keys = info.get("sample_metadata_keys")
        if keys is not None:
            metadata = {k: metadata[k] for k in keys if k in metadata}
        filled = bool(info.get("loss_mask_filled", False))
        converted.append(
            Sample(
                index=int(info.get("position", position)),
                tokens=int_array(list(fw.tokens)),
                response=fw.response,
                response_length=fw.response_length,
                reward=fw.reward,
                status=_status(fw.status),
                finish_reason=info.get("finish_reason"),
                weight_versions=[int(v) for v in fw.weight_versions],
                rollout_log_probs=None if fw.rollout_log_probs is None else float_array(list(fw.rollout_log_probs)),
                loss_mask=None if filled or fw.loss_mask is None else mask_array(list(fw.loss_mask)),
                metadata=metadata,
                **framework_fields(fw, base, info),
            )
        )
    return Group(
        index=int(first.group_index if first.group_index is not None else 0),
        prompt=first.prompt,
        samples=converted,
        label=first.label,
        epoch=int(first_info.get("epoch", 0)),
        attempt=int(first_info.get("attempt", 0)),
        metadata=dict(first_info.get("group_metadata", {})),
        producer=str(first_info.get("producer", "")),
        history=list(first_info.get("history", [])),
        multimodal_inputs=getattr(first, "multimodal_inputs", None),
    )
