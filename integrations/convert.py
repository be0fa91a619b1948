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
  reason, the position in the group), so :func:`from_framework` restores the group exactly.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollstream.common.errors import ConfigError
from rollstream.common.models import Group, Sample, Status

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


def load_object(path: str, what: str) -> Any:
    """The object named by ``pkg.module.attr`` (the frameworks' style) or ``pkg.module:attr``."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{what} {path!r} must look like 'package.module.name' or 'package.module:name'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{what} {path!r}: cannot import {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{what} {path!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


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


def to_framework(group: Group, sample_cls: Any, *, for_training: bool = False) -> list[Any]:
    """The group's samples as framework samples (``sample_cls`` is the framework's ``Sample``).

    ``for_training`` refuses samples whose prompt ids are unknown: their ``tokens`` would hold
    the response alone and the trainer would learn without the prompt.
    """
    n = len(group.samples)
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
        index = group.index * n + sample.index
        out.append(
            sample_cls(
                group_index=group.index,
                index=index,
                rollout_id=index,
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
            )
        )
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
    )
