"""The trainer's side of rollstream: ``GroupConsumer`` (asyncio) and ``SyncGroupConsumer``.

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
    RollstreamError,
)
from rollstream.common.models import Group, Sample, Status

from .consumer import Batch, Connecting, GroupConsumer, SyncGroupConsumer
from .filters import KeepFilter, rejection_reason, reward_variance

__all__ = [
    "AllGroupsStale",
    "Batch",
    "ConfigError",
    "Connecting",
    "ConsumerNameInUse",
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
    "RollstreamError",
    "Sample",
    "Status",
    "SyncGroupConsumer",
    "rejection_reason",
    "reward_variance",
]
