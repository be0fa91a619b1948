"""slime's and miles' ``--eval-interval`` through rollstream's eval lane: the eval never blocks training.

When the framework asks for an eval at rollout ``k`` (``evaluation=True``), each eval dataset
(``--eval-prompt-data NAME PATH ...`` or ``--eval-config``, JSONL or Parquet, read with the run's
``--input-key`` / ``--label-key`` / ``--metadata-key``) is submitted to the eval lane as
``NAME@k`` with ``--n-samples-per-eval-prompt`` samples, ``--eval-max-response-len`` tokens,
``--eval-temperature`` and ``--eval-top-p`` (per dataset with ``--eval-config``; unset: the
producers'), and the call returns at once. Producers generate it ahead of training prompts while
training goes on. The framework gets the metrics of the evals finished since the last call, in
the shape its stock eval function returns (``RolloutFnEvalOutput(data={NAME: {"rewards",
"truncated", "samples"}}, metrics)``, the samples as the framework's ``Sample``), and rollstream's
labels under ``eval/NAME/rollstream/``: the rollout the eval was asked at, the
weight versions its samples ran on (min, max) and its lag in steps. A dataset whose previous eval
has not finished is not submitted again (the next call reports the one running).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from rollstream.common.datasets import RowFormat, open_dataset
from rollstream.common.errors import ConfigError
from rollstream.common.eval_lane import EvalResult
from rollstream.common.protocol import EvalLane

from .convert import to_framework

logger = logging.getLogger(__name__)

SEPARATOR = "@"
"""An eval's name in the lane: ``DATASET@ROLLOUT``."""


@dataclass(frozen=True, slots=True)
class EvalDataset:
    """One eval dataset of the run and its sampling, from the framework's flags."""

    name: str
    path: str
    n_samples: int
    max_new_tokens: int | None
    row_format: RowFormat
    temperature: float | None = None
    """None: the producers'."""
    top_p: float | None = None


def _first(obj: Any, *names: str) -> Any:
    for name in names:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return None


def eval_datasets(args: Any) -> list[EvalDataset]:
    """The run's eval datasets: slime's and miles' resolved ``args.eval_datasets`` (each with
    ``name``, ``path``, ``n_samples_per_eval_prompt``, ``max_response_len``, keys), else the
    ``--eval-prompt-data NAME PATH ...`` pairs with the run-wide eval flags; [] when none."""
    configs = getattr(args, "eval_datasets", None)
    out = []
    if configs:
        for cfg in configs:
            out.append(_dataset(args, str(cfg.name), str(cfg.path), cfg))
        return out
    values = list(getattr(args, "eval_prompt_data", None) or [])
    if len(values) == 1:
        values = ["aime", values[0]]  # slime's and miles' legacy single path
    if len(values) % 2:
        raise ConfigError("--eval-prompt-data must be NAME PATH pairs")
    return [_dataset(args, str(values[i]), str(values[i + 1]), None) for i in range(0, len(values), 2)]


def _dataset(args: Any, name: str, path: str, cfg: Any) -> EvalDataset:
    if not name or SEPARATOR in name or ":" in name:
        raise ConfigError(f"eval dataset name {name!r} must be non-empty, without {SEPARATOR!r} or ':'")
    n = _first(cfg, "n_samples_per_eval_prompt") or _first(args, "n_samples_per_eval_prompt", "n_samples_per_prompt")
    tokens = _first(cfg, "max_response_len") or _first(args, "eval_max_response_len", "rollout_max_response_len")
    label_key = _first(cfg, "label_key") or getattr(args, "label_key", None)
    as_chat = _first(cfg, "apply_chat_template")
    row_format = RowFormat(
        prompt_key=str(_first(cfg, "input_key") or getattr(args, "input_key", None) or "input"),
        label_key=None if label_key is None else str(label_key),
        metadata_key=_first(cfg, "metadata_key") or getattr(args, "metadata_key", None),
        tool_key=_first(cfg, "tool_key") or getattr(args, "tool_key", None),
        as_chat=bool(getattr(args, "apply_chat_template", False) if as_chat is None else as_chat),
    )
    temperature = _first(cfg, "temperature")
    temperature = _first(args, "eval_temperature") if temperature is None else temperature
    top_p = _first(cfg, "top_p")
    top_p = _first(args, "eval_top_p") if top_p is None else top_p
    return EvalDataset(
        name, path, int(n or 1), None if tokens is None else int(tokens), row_format,
        None if temperature is None else float(temperature), None if top_p is None else float(top_p),
    )


def read_items(dataset: EvalDataset) -> list[dict[str, Any]]:
    """The dataset's rows as eval items (``prompt``, ``label``, ``metadata``): JSONL or Parquet."""
    try:
        return [
            {"prompt": record.prompt, "label": record.label, "metadata": record.metadata}
            for record in open_dataset(dataset.path, dataset.row_format).records()
        ]
    except ConfigError as exc:
        raise ConfigError(f"eval dataset {dataset.name!r}: {exc}") from None


def split_name(eval_name: str) -> tuple[str, int] | None:
    """(dataset, rollout) of a lane eval's name, None for an eval this module did not submit."""
    dataset, sep, rollout = eval_name.rpartition(SEPARATOR)
    return (dataset, int(rollout)) if sep and dataset and rollout.isdigit() else None


class LaneEvals:
    """The eval calls of one run: submits, and hands each finished eval to the framework once."""

    def __init__(
        self, args: Any, datasets: list[EvalDataset], *, missing_reward: float | None, sample_class: Any = None
    ) -> None:
        self.args = args
        self.sample_class = sample_class
        """The framework's ``Sample``: a reported eval carries its samples (``data[NAME]["samples"]``)."""
        self.datasets = datasets
        self.missing_reward = missing_reward
        """What an unscored sample's reward becomes (slime sums floats: NaN; miles counts None)."""
        self._items: dict[str, list[dict[str, Any]]] = {}
        self._reported: set[str] | None = None

    async def step(self, consumer: Any, rollout_id: int) -> tuple[dict[str, dict[str, Any]], dict[str, float]]:
        """Submit this rollout's evals; (data, metrics) of the evals finished since the last call."""
        finished = [r for r in await consumer.eval_results() if split_name(r.name)]
        if self._reported is None:  # a restarted trainer: what finished before this call was reported then
            self._reported = {r.name for r in finished if not r.groups}
        lane = EvalLane(consumer.redis, consumer.keys)
        submitted = await lane.submitted()
        running = {split[0] for name, meta in submitted.items() if "result" not in meta and (split := split_name(name))}
        for dataset in self.datasets:
            name = f"{dataset.name}{SEPARATOR}{rollout_id}"
            if name in submitted and not submitted[name].get("submitting"):
                continue  # a restarted trainer asking again for the same rollout
            if name not in submitted and dataset.name in running:  # (one cut short mid-submit resumes)
                logger.warning("eval %s: the one asked earlier is still running; not submitting %s", dataset.name, name)
                continue
            if dataset.name not in self._items:
                self._items[dataset.name] = read_items(dataset)
            await consumer.evaluate(
                name, self._items[dataset.name], n_samples=dataset.n_samples, max_new_tokens=dataset.max_new_tokens,
                temperature=dataset.temperature, top_p=dataset.top_p,
            )
        data: dict[str, dict[str, Any]] = {}
        metrics: dict[str, float] = {}
        for result in finished:
            split = split_name(result.name)
            if result.name in self._reported or split is None or split[0] in data:
                continue  # at most one per dataset per call (the framework keys its data by dataset)
            self._reported.add(result.name)
            data[split[0]] = self._data(result)
            metrics |= labels(split[0], split[1], result)
        return data, metrics

    def _data(self, result: EvalResult) -> dict[str, Any]:
        rewards = [self.missing_reward if math.isnan(r) else r for r in result.rewards]
        out: dict[str, Any] = {"rewards": rewards, "truncated": list(result.truncated)}
        if result.groups and self.sample_class is not None:
            out["samples"] = [s for g in result.groups for s in to_framework(g, self.sample_class)]
        return out


def labels(dataset: str, rollout_id: int, result: EvalResult) -> dict[str, float]:
    """rollstream's labels of a finished eval: when it was asked, the versions it ran on, its lag."""
    prefix = f"eval/{dataset}/rollstream/"
    out = {
        f"{prefix}rollout_id": float(rollout_id),
        f"{prefix}lag_steps": float(result.lag_steps),
        f"{prefix}samples": float(result.samples),
        f"{prefix}reward_mean": result.metrics.get("reward_mean", math.nan),
    }
    if result.versions:
        out[f"{prefix}weight_version_min"] = float(min(result.versions))
        out[f"{prefix}weight_version_max"] = float(max(result.versions))
    return out


def lane_eval(
    source: Any, args: Any, rollout_id: int, *, missing_reward: float | None, sample_class: Any = None
) -> Any | None:
    """(data, metrics) of the framework's eval call through the lane, or None when the run does
    not use it: ``ROLLSTREAM_EVAL_FUNCTION`` set (that function serves evals, blocking), a replay,
    or no eval dataset."""
    if source.settings.eval_function or source.replaying:
        return None
    if source.lane_evals is None:
        datasets = eval_datasets(args)
        if not datasets:
            return None
        source.lane_evals = LaneEvals(args, datasets, missing_reward=missing_reward, sample_class=sample_class)
    source.ensure_pipeline()
    return source.session.eval_step(source.lane_evals, rollout_id)
