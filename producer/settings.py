"""The producer's per-process settings (the pipeline-wide ones live in the namespace config)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from rollstream.common.config import PipelineConfig
from rollstream.common.errors import ConfigError

from .episode import GenerateFunction
from .rollout import ENGINE_FAILURE_LIMIT, GENERATE_FAILURE_LIMIT, REWARD_FAILURE_LIMIT
from .session import EpisodeLimits

LONG_REQUEST_AFTER = 600.0
"""Default seconds after which an engine request in flight counts as long (heartbeat, inspect)."""


def default_producer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True, slots=True)
class ProducerSettings:
    """Per-process settings; the pipeline-wide ones live in the namespace config."""

    namespace: str
    concurrency: int
    """Samples (episodes) in flight at most (a prompt needs ``n_samples_per_prompt`` of them);
    engine requests are capped apart by ``limits.engine_concurrency``."""
    name: str = field(default_factory=default_producer_name)
    n_samples: int | None = None
    """When given, must match the namespace's ``n_samples_per_prompt``."""
    heartbeat_interval: float = 2.0
    engines_from_registry: bool = False
    """Follow the namespace's engine registry (``rollstream engines``), read every heartbeat."""
    drain_timeout: float = 30.0
    renew_interval: float | None = None
    """Default: a third of the lease."""
    loop_stall_after: float | None = None
    """Seconds of event-loop lag that count as a stall (logged with the code that held the loop,
    counted in the heartbeat); default a fifth of the lease, at most 5 s."""
    reclaim_interval: float | None = None
    """Default: a quarter of the lease, at most 5 s."""
    tokenize_prompts: bool = True
    """Ask the engine's ``/tokenize`` for prompt ids, so samples carry prompt + response ids."""
    reward_failure_limit: int = REWARD_FAILURE_LIMIT
    """The reward failed on this many distinct prompts in a row (none scored between): fatal."""
    engine_failure_limit: int = ENGINE_FAILURE_LIMIT
    """An engine (or all engines) gave no usable reply on this many distinct prompts in a row: fatal."""
    long_request_after: float = LONG_REQUEST_AFTER
    """Engine requests in flight longer than this (seconds) are reported in the heartbeat
    (``long_requests``) and shown by ``inspect`` as a warning."""
    generate: GenerateFunction | None = None
    """The rollout plug-in (``--generate module:function``); None: the single-turn rollout."""
    limits: EpisodeLimits = field(default_factory=EpisodeLimits)
    """Episode caps: engine requests in flight, named limits, episode deadline, context budget."""
    generate_failure_limit: int = GENERATE_FAILURE_LIMIT
    """The generate function failed on this many distinct prompts in a row: fatal."""

    def __post_init__(self) -> None:
        if isinstance(self.concurrency, bool) or not isinstance(self.concurrency, int) or self.concurrency < 1:
            raise ConfigError(f"concurrency must be a positive integer, got {self.concurrency!r}")
        if not self.name or any(c.isspace() for c in self.name):
            raise ConfigError(f"producer name must be non-empty without spaces, got {self.name!r}")
        for name in ("heartbeat_interval", "drain_timeout", "long_request_after"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.loop_stall_after is not None and not self.loop_stall_after > 0:
            raise ConfigError(f"loop_stall_after must be positive, got {self.loop_stall_after!r}")
        for limit in ("reward_failure_limit", "generate_failure_limit", "engine_failure_limit"):
            if getattr(self, limit) < 1:
                raise ConfigError(f"{limit} must be at least 1, got {getattr(self, limit)!r}")

    def check(self, config: PipelineConfig) -> None:
        config.check_matches(n_samples_per_prompt=self.n_samples)
        if self.concurrency < config.n_samples_per_prompt:
            raise ConfigError(
                f"concurrency {self.concurrency} is below n_samples_per_prompt "
                f"{config.n_samples_per_prompt}: one prompt needs that many samples in flight"
            )
