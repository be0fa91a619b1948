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
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollstream.common.errors import ConfigError
from rollstream.common.imports import require_extra
from rollstream.common.models import Adapter, Group, Packed, Sample, Status

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


_ARRAY_FIELDS = {
    # rollstream field -> framework field; packed arrays go to the framework as int32 numpy
    "routed_experts": "rollout_routed_experts",
    "indexer_topk": "rollout_indexer_topk",
    "top_p_token_ids": "rollout_top_p_token_ids",
    "top_p_token_offsets": "rollout_top_p_token_offsets",
}
_LIST_FIELDS = {"teacher_log_probs": "teacher_log_probs", "opd_reverse_kl": "opd_reverse_kl"}
_PLAIN_FIELDS = ("remove_sample", "train_metadata", "non_generation_time")


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


def _v3_kwargs(
    sample: Sample, group: Group, sample_cls: Any, names: frozenset[str], replays: bool = True
) -> tuple[dict[str, Any], dict]:
    """The framework keyword arguments of ``sample``'s version-3 fields, and the values of those
    the framework has no field for (kept in the rollstream metadata entry)."""
    n = len(group.samples)
    kwargs: dict[str, Any] = {}
    missing: dict[str, Any] = {}
    for ours, theirs in _ARRAY_FIELDS.items():
        packed = getattr(sample, ours)
        if packed is None or not replays:
            continue
        if theirs in names:
            kwargs[theirs] = _int32(packed)
        else:
            missing[ours] = [packed.typecode, list(packed.shape), packed.data.tolist()]
    for ours, theirs in _LIST_FIELDS.items():
        values = getattr(sample, ours)
        if values is None:
            continue
        if theirs in names:
            kwargs[theirs] = list(values)
        else:
            missing[ours] = list(values)
    for name in _PLAIN_FIELDS:
        kwargs[name] = getattr(sample, name)
    if sample.rollout_id is not None:
        kwargs["rollout_id"] = group.index * n + sample.rollout_id
    for ours, cls_name in (("spec_info", "SpecInfo"), ("prefix_cache_info", "PrefixCacheInfo")):
        values = getattr(sample, ours)
        counters = _counters(_framework_class(sample_cls, cls_name), values)
        if counters is not None and ours in names:
            kwargs[ours] = counters
        elif values is not None:
            missing[ours] = values
    if sample.adapter is not None:
        ref = _framework_class(sample_cls, "AdapterRef")
        if "adapter" in names and ref is not None:
            kwargs["adapter"] = ref(name=sample.adapter.name, slot=sample.adapter.slot)
        else:
            missing["adapter"] = [sample.adapter.name, sample.adapter.slot]
    if sample.multimodal_train_inputs is not None:
        kwargs["multimodal_train_inputs"] = {
            k: v.numpy().copy() if isinstance(v, Packed) else v for k, v in sample.multimodal_train_inputs.items()
        }
    if group.multimodal_inputs is not None:
        kwargs["multimodal_inputs"] = group.multimodal_inputs
    return {k: v for k, v in kwargs.items() if k in names}, missing


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
        v3, missing = _v3_kwargs(sample, group, sample_cls, names, replays)
        if missing:
            info["fields"] = missing
        if sample.rollout_id is not None:
            info["rollout_id"] = sample.rollout_id
        index = group.index * n + sample.index
        kwargs = {"rollout_id": index, **v3}
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


def _packed_or_none(value: Any) -> Packed | None:
    return None if value is None else Packed.of(value)


def _floats(value: Any) -> list[float] | None:
    if value is None:
        return None
    if hasattr(value, "tolist"):
        value = value.tolist()
    return [float(v) for v in value]


def _counters_back(value: Any) -> dict[str, int] | None:
    """The framework's SpecInfo / PrefixCacheInfo as a dict; None when all zero (its default)."""
    if value is None:
        return None
    values = value.to_dict() if hasattr(value, "to_dict") else dict(value)
    return values if any(values.values()) else None


def _v3_fields(fw: Any, info: dict[str, Any]) -> dict[str, Any]:
    """The rollstream version-3 fields of a framework sample (plus those kept in ``info``)."""
    out: dict[str, Any] = {}
    for ours, theirs in _ARRAY_FIELDS.items():
        out[ours] = _packed_or_none(getattr(fw, theirs, None))
    for ours, theirs in _LIST_FIELDS.items():
        out[ours] = _floats(getattr(fw, theirs, None))
    out["remove_sample"] = bool(getattr(fw, "remove_sample", False))
    out["train_metadata"] = getattr(fw, "train_metadata", None)
    out["non_generation_time"] = float(getattr(fw, "non_generation_time", 0.0) or 0.0)
    out["rollout_id"] = info.get("rollout_id")
    out["spec_info"] = _counters_back(getattr(fw, "spec_info", None))
    out["prefix_cache_info"] = _counters_back(getattr(fw, "prefix_cache_info", None))
    adapter = getattr(fw, "adapter", None)
    out["adapter"] = None if adapter is None else Adapter(str(adapter.name), int(adapter.slot))
    mm = getattr(fw, "multimodal_train_inputs", None)
    if mm is not None:
        out["multimodal_train_inputs"] = {
            k: Packed.of(v) if hasattr(v, "shape") and hasattr(v, "dtype") else v for k, v in mm.items()
        }
    for name, value in info.get("fields", {}).items():
        if name in _ARRAY_FIELDS:
            code, shape, flat = value
            out[name] = Packed.of(flat, shape, floats=code == "f")
        elif name == "adapter":
            out[name] = Adapter(str(value[0]), int(value[1]))
        else:
            out[name] = value
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
                tokens=list(fw.tokens),
                response=fw.response,
                response_length=fw.response_length,
                reward=fw.reward,
                status=_status(fw.status),
                finish_reason=info.get("finish_reason"),
                weight_versions=[int(v) for v in fw.weight_versions],
                rollout_log_probs=None if fw.rollout_log_probs is None else list(fw.rollout_log_probs),
                loss_mask=None if filled or fw.loss_mask is None else list(fw.loss_mask),
                metadata=metadata,
                **_v3_fields(fw, info),
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
