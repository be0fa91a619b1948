"""The producer's per-process settings (the pipeline-wide ones live in the namespace config).

One tree, each field declared once with its flag, help and default (:mod:`rollstream.common.settings_fields`):
:class:`ProducerSettings` holds the producer's own fields and its :class:`EpisodeSettings`
(what the rollout needs: the plug-in, its caps, what counts as broken), which hold the
:class:`~.session.EpisodeLimits`; the engine's are :class:`~.engine.EngineSettings`. ``rollstream
produce``'s flags are derived from the tree (``rollstream.cli.produce``)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from rollstream.common.checked import is_int
from rollstream.common.config import PipelineConfig
from rollstream.common.errors import ConfigError
from rollstream.common.settings_fields import branch, option, set_by

from .episode import GenerateFunction
from .episode_runtime import EpisodeLimits

LONG_REQUEST_AFTER = 600.0
"""Default seconds after which an engine request in flight counts as long (heartbeat, inspect)."""
FAILURE_LIMIT = 8
"""Default of the failure limits: failing on this many distinct prompts in a row is broken (fatal)."""


def default_producer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True, slots=True)
class EpisodeSettings:
    """What the rollout needs of its producer: the plug-in, its caps, the failure limits.

    A part that keeps failing is broken (fatal) rather than unlucky when it failed on a limit's
    number of distinct prompts in a row, with no success in between."""

    generate: GenerateFunction | None = set_by("the --generate spec, loaded (ProduceOptions.generate)", None)
    """The rollout plug-in; None: the single-turn rollout."""
    limits: EpisodeLimits = branch(EpisodeLimits)
    tokenize_prompts: bool = option(
        True, help="ask the engine's /tokenize for prompt ids, so samples carry prompt + response ids")
    reward_failure_limit: int = option(
        FAILURE_LIMIT, help="the reward failing on this many distinct prompts in a row is fatal (a broken reward)")
    generate_failure_limit: int = option(
        FAILURE_LIMIT, help="the generate function failing on this many distinct prompts in a row is fatal")
    engine_failure_limit: int = option(
        FAILURE_LIMIT, help="an engine (or all engines) refusing or answering unusable replies on this many "
                            "distinct prompts in a row is fatal (a broken engine)")

    def __post_init__(self) -> None:
        for limit in ("reward_failure_limit", "generate_failure_limit", "engine_failure_limit"):
            if getattr(self, limit) < 1:
                raise ConfigError(f"{limit} must be at least 1, got {getattr(self, limit)!r}")


@dataclass(frozen=True, slots=True)
class ProducerSettings:
    """Per-process settings; the pipeline-wide ones live in the namespace config."""

    namespace: str = set_by("--ns")
    concurrency: int = option(stored=True, parse=int, help="samples (episodes) in flight at most")
    """A prompt needs ``n_samples_per_prompt`` of them; engine requests are capped apart by
    ``episodes.limits.engine_concurrency``."""
    name: str = option(factory=default_producer_name, parse=str, help="producer id (default host-pid)")
    n_samples: int | None = option(None, parse=int, help="must match the namespace config")
    heartbeat_interval: float = option(2.0, help="seconds between heartbeats")
    engines_from_registry: bool = option(
        False, help="use the namespace's engine registry (`rollstream engines add|drain|remove`), re-read "
                    "every heartbeat, alone or beside the --engine URLs")
    drain_timeout: float = option(
        30.0, help="seconds the groups in flight may take to finish after SIGTERM before they are returned")
    renew_interval: float | None = option(None, parse=float, help="seconds between lease renewals "
                                                                  "(default: a third of the lease)")
    loop_stall_after: float | None = option(
        None, parse=float, metavar="SECONDS",
        help="event-loop lag that counts as a stall, logged with the code that blocked the loop "
             "(default: a fifth of the lease, at most 5 s)")
    reclaim_interval: float | None = option(
        None, parse=float, help="seconds between reclaim passes over expired leases "
                                "(default: a quarter of the lease, at most 5 s)")
    long_request_after: float = option(
        LONG_REQUEST_AFTER, help="seconds after which an engine request in flight is reported as long (inspect warns)")
    warm: int = option(
        0, parse=int, metavar="K",
        help="prompts admitted beyond --concurrency so the generate function's prepare(info) hook (a sandbox) "
             "runs while they wait for room (warm pools, docs/rollouts.md); 0: prepare runs at admission")
    episodes: EpisodeSettings = branch(EpisodeSettings)

    def __post_init__(self) -> None:
        if not is_int(self.warm) or self.warm < 0:
            raise ConfigError(f"warm must be a non-negative integer, got {self.warm!r}")
        if not is_int(self.concurrency) or self.concurrency < 1:
            raise ConfigError(f"concurrency must be a positive integer, got {self.concurrency!r}")
        if not self.name or any(c.isspace() for c in self.name):
            raise ConfigError(f"producer name must be non-empty without spaces, got {self.name!r}")
        for name in ("heartbeat_interval", "drain_timeout", "long_request_after"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        for name in ("loop_stall_after", "renew_interval", "reclaim_interval"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be positive, got {value!r}")

    def check(self, config: PipelineConfig) -> None:
        config.check_matches(n_samples_per_prompt=self.n_samples)
        if self.concurrency < config.n_samples_per_prompt:
            raise ConfigError(
                f"concurrency {self.concurrency} is below n_samples_per_prompt "
                f"{config.n_samples_per_prompt}: one prompt needs that many samples in flight"
            )
