"""The producer side of rollstream: the worker process, the engine client, rewards, the feeder.

Run it with ``rollstream produce``; use :class:`Producer` to embed it in another process.
"""

from .engine import EngineClient, EngineSettings
from .feeder import Feeder, FeedSettings, feed, load_jsonl
from .rewards import RewardFunction, load_reward
from .worker import Producer, ProducerSettings

__all__ = [
    "EngineClient",
    "EngineSettings",
    "FeedSettings",
    "Feeder",
    "Producer",
    "ProducerSettings",
    "RewardFunction",
    "feed",
    "load_jsonl",
    "load_reward",
]
