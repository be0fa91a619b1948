"""The producer side of rollstream: the worker process, the engine client, rewards, the feeder.

Run it with ``rollstream produce``; use :class:`Producer` to embed it in another process, or
:class:`Rollout` alone to turn prompts into scored groups without Redis.
"""

from .engine import EngineClient, EngineSettings
from .episode import Episode, GenerateFunction
from .feeder import Feeder, FeedSettings, feed, load_jsonl
from .rewards import RewardFunction, load_reward
from .rollout import Rollout
from .session import EpisodeLimits
from .settings import EpisodeSettings, ProducerSettings
from .telemetry import Metrics
from .worker import Producer

__all__ = [
    "EngineClient",
    "EngineSettings",
    "Episode",
    "EpisodeLimits",
    "EpisodeSettings",
    "FeedSettings",
    "Feeder",
    "GenerateFunction",
    "Metrics",
    "Producer",
    "ProducerSettings",
    "RewardFunction",
    "Rollout",
    "feed",
    "load_jsonl",
    "load_reward",
]
