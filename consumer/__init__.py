"""The trainer's side of rollstream: ``GroupConsumer`` (asyncio) and ``SyncGroupConsumer``,
``ArchiveReplay`` (recorded batches from an archive, the same ``take``/``commit``),
their options (``ConsumerOptions``) and the pure rule that routes each group (``judge``).

Every error a trainer can meet is exported here; all derive from :class:`RollstreamError`
(``ConfigError`` and ``DecodeError`` are also ``ValueError``). Redis connection problems
surface as redis-py's ``redis.exceptions.ConnectionError``.
"""

from rollstream.common.errors import (
    AllGroupsStale,
    ConfigError,
    ConsumerNameInUse,
    DecodeError,
    NamespaceGone,
    NamespaceNotInitialized,
    PipelineError,
    PipelineStalled,
    ProducerFailed,
    RedisDataLost,
    ReplayExhausted,
    RollstreamError,
)
from rollstream.common.models import Group, Sample, Status

from .archive_replay import ArchiveReplay
from .batch import Batch
from .filters import KeepFilter, rejection_reason, reward_variance
from .group_consumer import Connecting, GroupConsumer
from .options import ConsumerOptions
from .sync import SyncGroupConsumer
from .verdict import Cause, Route, Verdict, judge

__all__ = [
    "AllGroupsStale",
    "ArchiveReplay",
    "Batch",
    "Cause",
    "ConfigError",
    "Connecting",
    "ConsumerNameInUse",
    "ConsumerOptions",
    "DecodeError",
    "Group",
    "GroupConsumer",
    "KeepFilter",
    "NamespaceGone",
    "NamespaceNotInitialized",
    "PipelineError",
    "PipelineStalled",
    "ProducerFailed",
    "RedisDataLost",
    "ReplayExhausted",
    "RollstreamError",
    "Route",
    "Sample",
    "Status",
    "SyncGroupConsumer",
    "Verdict",
    "judge",
    "rejection_reason",
    "reward_variance",
]
