"""The trainer's side of rollstream: ``GroupConsumer`` (asyncio) and ``SyncGroupConsumer``."""

from rollstream.common.errors import PipelineStalled, ProducerFailed
from rollstream.common.models import Group, Sample, Status

from .consumer import Batch, GroupConsumer, KeepFilter, SyncGroupConsumer
from .filters import reward_variance

__all__ = [
    "Batch",
    "Group",
    "GroupConsumer",
    "KeepFilter",
    "PipelineStalled",
    "ProducerFailed",
    "Sample",
    "Status",
    "SyncGroupConsumer",
    "reward_variance",
]
