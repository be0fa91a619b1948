"""The eval lane's data: what an eval prompt carries, and what a finished eval reports.

``GroupConsumer.evaluate`` writes an eval set's prompts to the ``eval_prompts`` stream; each
carries its eval's name and sampling under ``metadata[EVAL_KEY]`` (read by the producer's rollout:
:func:`eval_settings`). ADMIT hands them out before any training prompt, and PUBLISH sends their
groups to ``eval_groups``, never to the training stream. ``GroupConsumer.eval_results`` folds
those groups into an :class:`EvalResult` once every prompt of the set has come back
(:func:`summarize`).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .checked import is_int, is_number
from .errors import ConfigError
from .models import Group, Prompt, Status

EVAL_KEY = "rollstream_eval"
"""The prompt metadata key of an eval prompt: ``{"name", "n_samples", "max_new_tokens"}``, and
``temperature`` / ``top_p`` when the eval sets them. Reserved: read only on entries of the eval
lane (``eval_prompts``), stripped from every other prompt (:func:`strip_eval_mark`)."""


@dataclass(frozen=True, slots=True)
class EvalSettings:
    """One eval set's name and sampling (checked on construction: ``ConfigError``)."""

    name: str
    n_samples: int = 1
    max_new_tokens: int | None = None
    temperature: float | None = None
    """None: the producer's."""
    top_p: float | None = None
    """None: the producer's."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or len(self.name) > 200 or ":" in self.name:
            raise ConfigError(f"an eval's name must be a non-empty string of at most 200 characters, no ':', "
                              f"got {self.name!r}")
        if not is_int(self.n_samples) or self.n_samples < 1:
            raise ConfigError(f"n_samples must be a positive integer, got {self.n_samples!r}")
        if self.max_new_tokens is not None and (
            not is_int(self.max_new_tokens)
            or self.max_new_tokens < 1
        ):
            raise ConfigError(f"max_new_tokens must be a positive integer or None, got {self.max_new_tokens!r}")
        if self.temperature is not None and (
            not is_number(self.temperature)
            or not 0 <= self.temperature < math.inf
        ):
            raise ConfigError(f"temperature must be a non-negative number or None, got {self.temperature!r}")
        if self.top_p is not None and (
            not is_number(self.top_p) or not 0 < self.top_p <= 1
        ):
            raise ConfigError(f"top_p must be within (0, 1] or None, got {self.top_p!r}")

    def as_metadata(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "n_samples": self.n_samples, "max_new_tokens": self.max_new_tokens}
        if self.temperature is not None:
            out["temperature"] = float(self.temperature)
        if self.top_p is not None:
            out["top_p"] = float(self.top_p)
        return out


def eval_settings(prompt: Prompt) -> EvalSettings | None:
    """The eval settings an eval prompt carries, else None (a training prompt, or a damaged mark)."""
    raw = prompt.metadata.get(EVAL_KEY) if isinstance(prompt.metadata, Mapping) else None
    if not isinstance(raw, Mapping):
        return None
    try:
        return EvalSettings(
            str(raw.get("name", "")), raw.get("n_samples", 1), raw.get("max_new_tokens"), raw.get("temperature"),
            raw.get("top_p"),
        )
    except ConfigError:
        return None


def strip_eval_mark(metadata: dict[str, Any]) -> bool:
    """Remove the reserved :data:`EVAL_KEY` from a training prompt's ``metadata`` (in place); True
    when it was there. Eval settings are honoured only on the eval lane's own entries: a dataset
    row carrying the key must not steer its sampling (the feeder strips it, and so does the
    producer for any prompt outside ``eval_prompts``)."""
    if EVAL_KEY not in metadata:
        return False
    del metadata[EVAL_KEY]
    return True


def eval_prompts(settings: EvalSettings, source: Iterable[Any]) -> list[Prompt]:
    """The eval set ``source`` as prompts (see :func:`eval_prompt`)."""
    out = [eval_prompt(settings, index, item) for index, item in enumerate(source)]
    if not out:
        raise ConfigError(f"eval {settings.name!r} has no prompts")
    return out


def eval_prompt(settings: EvalSettings, index: int, item: Any) -> Prompt:
    """Item ``index`` of an eval set as a prompt: a prompt (text or chat messages) or a mapping
    with ``prompt`` and optionally ``label`` and ``metadata``."""
    if isinstance(item, Mapping):
        if "prompt" not in item:
            raise ConfigError(f"eval {settings.name!r} item {index} has no 'prompt'")
        prompt, label, metadata = item["prompt"], item.get("label"), dict(item.get("metadata") or {})
    else:
        prompt, label, metadata = item, None, {}
    if not isinstance(prompt, str | list) or not prompt:
        raise ConfigError(f"eval {settings.name!r} item {index}: a prompt is text or chat messages, got {prompt!r}")
    metadata[EVAL_KEY] = settings.as_metadata()
    return Prompt(index=index, prompt=prompt, label=label, metadata=metadata)


@dataclass(frozen=True, slots=True)
class EvalResult:
    """A finished eval: its metrics, the weight versions its samples were generated at (with how
    many samples at each), and how many training steps were committed while it ran."""

    name: str
    prompts: int
    samples: int
    metrics: dict[str, float] = field(default_factory=dict)
    versions: dict[int, int] = field(default_factory=dict)
    lag_steps: int = 0
    submitted_step: int = 0
    finished_step: int = 0
    submitted_ms: int = 0
    finished_ms: int = 0
    rewards: list[float] = field(default_factory=list)
    """Every sample's reward (NaN: unscored), by prompt index then sample: what slime's and miles'
    eval loggers read (``eval/NAME``, pass rates by group)."""
    truncated: list[bool] = field(default_factory=list)
    """Whether each sample hit its token limit, in the order of :attr:`rewards`."""
    groups: list[Group] = field(default_factory=list, compare=False, repr=False)
    """The eval's groups by prompt index, only on the result returned by the call that finished
    it: those this consumer process collected (every one, unless it restarted while the eval ran;
    they are archived and deleted as they are collected; never stored with the result)."""

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "prompts": self.prompts, "samples": self.samples, "metrics": self.metrics,
            "versions": {str(k): v for k, v in self.versions.items()}, "lag_steps": self.lag_steps,
            "submitted_step": self.submitted_step, "finished_step": self.finished_step,
            "submitted_ms": self.submitted_ms, "finished_ms": self.finished_ms,
            "rewards": self.rewards, "truncated": self.truncated,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> EvalResult:
        return cls(
            name=str(raw["name"]), prompts=int(raw["prompts"]), samples=int(raw["samples"]),
            metrics={str(k): float(v) for k, v in raw.get("metrics", {}).items()},
            versions={int(k): int(v) for k, v in raw.get("versions", {}).items()},
            lag_steps=int(raw.get("lag_steps", 0)), submitted_step=int(raw.get("submitted_step", 0)),
            finished_step=int(raw.get("finished_step", 0)), submitted_ms=int(raw.get("submitted_ms", 0)),
            finished_ms=int(raw.get("finished_ms", 0)),
            rewards=[float(r) for r in raw.get("rewards", [])], truncated=[bool(t) for t in raw.get("truncated", [])],
        )


def eval_row(group: Group, step: int) -> str:
    """A collected eval group as kept until its eval finishes (``eval_rows``, JSON): per sample its
    reward (null: unscored), whether it was truncated, its oldest weight version and its length;
    the trainer step when it was published."""
    return json.dumps({
        "s": step,
        "r": [None if math.isnan(s.scalar_reward) else s.scalar_reward for s in group.samples],
        "t": [s.status is Status.TRUNCATED for s in group.samples],
        "v": [min(s.weight_versions) if s.weight_versions else None for s in group.samples],
        "l": [s.response_length for s in group.samples],
    }, separators=(",", ":"))


def summarize(
    name: str, rows: Mapping[int, str], *, submitted_step: int, submitted_ms: int, finished_ms: int,
    groups: Iterable[Group] = (),
) -> EvalResult:
    """The result of an eval from its rows (:func:`eval_row`, by prompt index); ``groups``: the
    ones to hand back with it (those this process collected)."""
    parsed = []
    for index in sorted(rows):
        try:
            row = json.loads(rows[index])
            parsed.append((int(row["s"]), [math.nan if r is None else float(r) for r in row["r"]],
                           [bool(t) for t in row["t"]], list(row["v"]), [int(n) for n in row["l"]]))
        except (ValueError, TypeError, KeyError):
            continue  # a damaged row: its prompt is left out
    rewards = [r for _, rs, _, _, _ in parsed for r in rs]
    scored = [r for r in rewards if not math.isnan(r)]
    versions: Counter[int] = Counter(int(v) for _, _, _, vs, _ in parsed for v in vs if v is not None)
    lengths = [n for _, _, _, _, ls in parsed for n in ls]
    finished_step = max((step for step, *_ in parsed), default=submitted_step)
    metrics = {
        "reward_mean": sum(scored) / len(scored) if scored else math.nan,
        "pass_rate": sum(1 for r in scored if r > 0) / len(scored) if scored else math.nan,
        "response_length_mean": sum(lengths) / len(lengths) if lengths else 0.0,
        "samples_unscored": float(len(rewards) - len(scored)),
    }
    return EvalResult(
        name=name, prompts=len(parsed), samples=len(rewards), metrics=metrics, versions=dict(sorted(versions.items())),
        lag_steps=max(0, finished_step - submitted_step), submitted_step=submitted_step, finished_step=finished_step,
        submitted_ms=submitted_ms, finished_ms=finished_ms, rewards=rewards,
        truncated=[t for _, _, ts, _, _ in parsed for t in ts], groups=sorted(groups, key=by_index),
    )


def by_index(group: Group) -> int:
    return group.index
