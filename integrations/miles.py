"""miles drop-in: ``--rollout-function-path rollstream.integrations.miles.RollstreamRolloutFn`` with
``--data-source-path rollstream.integrations.miles.RollstreamDataSource`` (on ``train_async.py``,
without ``--fully-async``, which refuses a rollout function path).

miles builds the class once with ``RolloutFnConstructorInput(args, data_source)`` and calls it
with ``RolloutFnTrainInput(rollout_id, weight_version)`` or ``RolloutFnEvalInput(...)``. Training
calls record miles' own weight version as the trainer's (so rollstream's staleness filter and
admission control see what miles sees) and return exactly ``args.rollout_batch_size`` groups;
``--max-weight-staleness`` must equal the namespace's ``max_staleness``. Eval calls with eval
datasets (``--eval-prompt-data`` / ``--eval-config``) go through rollstream's eval lane and return
at once (:mod:`rollstream.integrations.eval_calls`); with ``ROLLSTREAM_EVAL_FUNCTION`` set, or no
eval dataset, they go to that function (default miles' stock ``InferenceRolloutFn``), built with
the same constructor input; its result, coroutine or not, is returned as it is.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

from rollstream.common.errors import ConfigError
from rollstream.common.imports import import_object

from .convert import MILES, Framework, to_framework
from .eval_calls import lane_eval
from .source import RollstreamDataSourceBase, prefixed

DEFAULT_EVAL_FUNCTION = "miles.rollout.inference_rollout.inference_rollout_common.InferenceRolloutFn"


class RollstreamDataSource(RollstreamDataSourceBase):
    """miles' ``--data-source-path``: owns the rollstream session and ties commits to checkpoints."""

    framework: ClassVar[Framework] = MILES
    path: ClassVar[str] = "rollstream.integrations.miles.RollstreamDataSource"


def _version(raw: Any) -> int | None:
    if raw is None:
        return None
    if isinstance(raw, bool):
        raise ValueError(f"weight version {raw!r} is not an integer")
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"miles passed weight version {raw!r}, which is not an integer") from None


class RollstreamRolloutFn:
    """miles' class-based rollout function backed by rollstream."""

    def __init__(self, input: Any) -> None:
        self.constructor_input = input
        self.args = input.args
        self.source = RollstreamDataSource.require(input.data_source)
        self._eval_fn: Any = None

    def __call__(self, input: Any) -> Any:
        if input.evaluation:
            return self._evaluate(input)
        self.source.ensure_pipeline()
        staleness = getattr(self.args, "max_weight_staleness", None)
        batch = self.source.session.train_batch(
            input.rollout_id,
            n_samples=self.args.n_samples_per_prompt,
            batch_size=self.args.rollout_batch_size,
            weight_version=_version(getattr(input, "weight_version", None)),
            max_staleness=staleness,
        )
        sample_cls = MILES.sample_class()
        samples = [to_framework(group, sample_cls, for_training=True) for group in batch.groups]
        return MILES.train_output(samples, prefixed(batch.metrics))

    def _evaluate(self, input: Any) -> Any:
        if (lane := lane_eval(
            self.source, self.args, input.rollout_id, missing_reward=None, sample_class=MILES.sample_class()
        )) is not None:
            data, metrics = lane
            return MILES.eval_output_class()(data=data, metrics=metrics)
        if self._eval_fn is None:
            path = self.source.settings.eval_function or DEFAULT_EVAL_FUNCTION
            target: Any = import_object(path, "ROLLSTREAM_EVAL_FUNCTION", dotted=True)
            if target is RollstreamRolloutFn:
                raise ConfigError(
                    "ROLLSTREAM_EVAL_FUNCTION names RollstreamRolloutFn itself: name the class or function "
                    f"that serves evaluation (default {DEFAULT_EVAL_FUNCTION})"
                )
            if inspect.isclass(target):
                factory: Any = target
                self._eval_fn = factory(self.constructor_input)
            else:
                self._eval_fn = _LegacyEval(target, self.args, self.source)
        return self._eval_fn(input)


class _LegacyEval:
    """A function-style eval ``fn(args, rollout_id, data_source, evaluation=True)``."""

    def __init__(self, fn: Any, args: Any, data_source: Any) -> None:
        self.fn, self.args, self.data_source = fn, args, data_source

    def __call__(self, input: Any) -> Any:
        output = self.fn(self.args, input.rollout_id, self.data_source, evaluation=True)
        eval_output = MILES.eval_output_class()
        if inspect.iscoroutine(output) or isinstance(output, eval_output):
            return output
        return eval_output(data=output)
