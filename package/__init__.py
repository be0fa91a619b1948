"""rollstream: a fully-async rollout pipeline for LLM reinforcement learning on Redis Streams.

The user-facing types are importable from here, the one documented place
(``from rollstream import Episode, GroupConsumer, Sample``): the data model, the trainer's
consumer and its batch, the rollout plug-in contract, the trainer's weight update, and the
errors a user handles. Each is imported on first use, so ``import rollstream`` (which every
subpackage does first) stays light. The packages themselves: ``rollstream.consumer`` (the
trainer), ``rollstream.producer`` (producers), both on ``rollstream.common``;
``rollstream.ops`` holds the operator functions, ``rollstream.runtime`` the embedded Redis and
the supervisor of a one-machine run, ``rollstream.testing`` the simulator and test doubles,
``rollstream.cli`` the ``rollstream`` command. Each package's docstring lists its modules.
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("rollstream")
    """The installed distribution's version: pyproject.toml is the single source."""
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ imports each on first use
    from rollstream.common.errors import (
        AllGroupsStale,
        ConfigError,
        DecodeError,
        EpisodeAborted,
        GenerateBroken,
        PipelineStalled,
        ProducerFailed,
        RollstreamError,
    )
    from rollstream.common.models import Group, Prompt, Sample, Status
    from rollstream.consumer import Batch, ConsumerOptions, GroupConsumer, SyncGroupConsumer
    from rollstream.producer.episode import (
        Episode,
        EpisodeInfo,
        GenerateFunction,
        SamplingParams,
        Trajectory,
        Turn,
    )
    from rollstream.weight_sync import WeightSync, WeightSyncError

_EXPORTS = {
    **dict.fromkeys(("Group", "Prompt", "Sample", "Status"), "rollstream.common.models"),
    **dict.fromkeys(("Batch", "ConsumerOptions", "GroupConsumer", "SyncGroupConsumer"), "rollstream.consumer"),
    **dict.fromkeys(
        ("Episode", "EpisodeInfo", "GenerateFunction", "SamplingParams", "Trajectory", "Turn"),
        "rollstream.producer.episode",
    ),
    **dict.fromkeys(("WeightSync", "WeightSyncError"), "rollstream.weight_sync"),
    **dict.fromkeys(
        ("AllGroupsStale", "ConfigError", "DecodeError", "EpisodeAborted", "GenerateBroken", "PipelineStalled",
         "ProducerFailed", "RollstreamError"),
        "rollstream.common.errors",
    ),
}
"""Each exported name and the module that defines it (``tests/test_layers.py`` keeps this, the
``TYPE_CHECKING`` imports and ``__all__`` equal)."""

__all__ = [
    "AllGroupsStale",
    "Batch",
    "ConfigError",
    "ConsumerOptions",
    "DecodeError",
    "Episode",
    "EpisodeAborted",
    "EpisodeInfo",
    "GenerateBroken",
    "GenerateFunction",
    "Group",
    "GroupConsumer",
    "PipelineStalled",
    "ProducerFailed",
    "Prompt",
    "RollstreamError",
    "Sample",
    "SamplingParams",
    "Status",
    "SyncGroupConsumer",
    "Trajectory",
    "Turn",
    "WeightSync",
    "WeightSyncError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rollstream' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # once: the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
