"""slime drop-in: ``--rollout-function-path rollstream.integrations.slime.generate_rollout`` with
``--data-source-path rollstream.integrations.slime.RollstreamDataSource``.

``generate_rollout(args, rollout_id, data_source, evaluation=False)`` returns exactly
``args.rollout_batch_size`` groups of slime ``Sample`` objects taken from rollstream, with
rollstream's batch metrics under ``rollout/rollstream/...``. With ``evaluation=True`` and eval
datasets (``--eval-prompt-data`` / ``--eval-config``) it goes through rollstream's eval lane and
returns at once (:mod:`rollstream.integrations.eval_calls`: metrics arrive at a later call); with
``ROLLSTREAM_EVAL_FUNCTION`` set, or no eval dataset, it calls that function (default slime's stock
``slime.rollout.sglang_rollout.generate_rollout``), which blocks while it generates.

The weight version: slime never tells the rollout function its version. Before each take this
module asks the engines (``ROLLSTREAM_ENGINE_URL``, default slime's router at
``http://{--sglang-router-ip}:{--sglang-router-port}``): ``GET /get_weight_version``, then
``/get_model_info``, ``/model_info``, 2 s each, the ``weight_version`` of the first valid reply.
The engines hold exactly what the trainer last pushed (``weight_version=str(n)`` on every update),
and it is the same number producers stamp on every sample, so staleness compares like with like.
When no engine answers, it falls back to counting updates:
``1 + (rollout_id - first rollout of this process) // --update-weights-interval``
(slime pushes weights once before the first rollout, then every interval).
"""

from __future__ import annotations

import logging
import math
from typing import Any, ClassVar

from rollstream.common.errors import ConfigError
from rollstream.common.imports import import_object
from rollstream.common.versions import version_of
from rollstream.producer.engine.discovery import engine_version

from .convert import SLIME, Framework, to_framework
from .eval_calls import lane_eval
from .source import RollstreamDataSourceBase, prefixed

logger = logging.getLogger(__name__)

DEFAULT_EVAL_FUNCTION = "slime.rollout.sglang_rollout.generate_rollout"
VERSION_ENDPOINTS = ("/get_weight_version", "/get_model_info", "/model_info")
VERSION_TIMEOUT = 2.0


class RollstreamDataSource(RollstreamDataSourceBase):
    """slime's ``--data-source-path``: owns the rollstream session and ties commits to checkpoints."""

    framework: ClassVar[Framework] = SLIME
    path: ClassVar[str] = "rollstream.integrations.slime.RollstreamDataSource"


parse_weight_version = version_of
"""The integer ``weight_version`` of an engine reply, or None when absent or malformed."""


async def query_engine_version(url: str, request_timeout: float = VERSION_TIMEOUT) -> int | None:
    """Best effort: the engines' weight version, or None (any failure or malformed reply)."""
    return await engine_version(url, VERSION_ENDPOINTS, request_timeout)


def engine_url(args: Any, source: RollstreamDataSourceBase) -> str | None:
    if source.settings.engine_url:
        return source.settings.engine_url
    ip, port = getattr(args, "sglang_router_ip", None), getattr(args, "sglang_router_port", None)
    return f"http://{ip}:{port}" if ip and port else None


def counted_version(args: Any, source: RollstreamDataSourceBase, rollout_id: int) -> int:
    """The version slime's update cadence implies for ``rollout_id`` (see the module docstring)."""
    if source.session.loaded_from is not None:
        start = source.session.loaded_from + 1
    else:
        start = source.first_rollout_id if source.first_rollout_id is not None else rollout_id
    interval = max(1, int(getattr(args, "update_weights_interval", 1) or 1))
    base = int(getattr(args, "update_weight_start_version", 0) or 0)
    return base + 1 + max(0, rollout_id - start) // interval


def trainer_version(args: Any, source: RollstreamDataSourceBase, rollout_id: int) -> tuple[int, bool]:
    """(version, whether the engines said it)."""
    url = engine_url(args, source)
    if url is not None:
        version = source.session.run(query_engine_version(url))
        if version is not None:
            return version, True
        logger.warning("no engine at %s reported its weight_version; counting updates instead", url)
    return counted_version(args, source, rollout_id), False


def _evaluate(args: Any, rollout_id: int, data_source: Any) -> Any:
    if isinstance(data_source, RollstreamDataSourceBase) and (
        lane := lane_eval(data_source, args, rollout_id, missing_reward=math.nan, sample_class=SLIME.sample_class())
    ) is not None:
        data, metrics = lane
        return SLIME.eval_output_class()(data=data, metrics=metrics)
    path = DEFAULT_EVAL_FUNCTION
    if isinstance(data_source, RollstreamDataSourceBase) and data_source.settings.eval_function:
        path = data_source.settings.eval_function
    fn = import_object(path, "ROLLSTREAM_EVAL_FUNCTION", dotted=True)
    if fn is generate_rollout:
        raise ConfigError(
            "ROLLSTREAM_EVAL_FUNCTION names rollstream's own generate_rollout: name the function that "
            f"serves evaluation (default {DEFAULT_EVAL_FUNCTION})"
        )
    return fn(args, rollout_id, data_source, evaluation=True)


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """slime's rollout function: ``args.rollout_batch_size`` groups from rollstream (or an eval)."""
    if evaluation:
        return _evaluate(args, rollout_id, data_source)
    source = RollstreamDataSource.require(data_source)
    if not getattr(args, "rollout_global_dataset", True):
        raise ConfigError(
            "slime calls the data source's save() only with its global dataset on, and rollstream ties "
            "commits to those saves: drop --disable-rollout-global-dataset"
        )
    if source.first_rollout_id is None:
        source.first_rollout_id = rollout_id
    source.ensure_pipeline()
    version, from_engine = (None, False) if source.replaying else trainer_version(args, source, rollout_id)
    batch = source.session.train_batch(
        rollout_id,
        n_samples=args.n_samples_per_prompt,
        batch_size=args.rollout_batch_size,
        weight_version=version,
    )
    sample_cls = SLIME.sample_class()
    samples = [to_framework(group, sample_cls, for_training=True) for group in batch.groups]
    metrics = prefixed({**batch.metrics, "weight_version_from_engine": 1.0 if from_engine else 0.0})
    return SLIME.train_output(samples, metrics)
