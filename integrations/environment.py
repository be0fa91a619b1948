"""Configuration of the framework integrations, read from environment variables.

The frameworks' argument parsers are left untouched: what rollstream needs on the trainer side
comes from ``ROLLSTREAM_*`` variables, checked when the data source is built, so a missing or
malformed one fails the run at start with an error that names the variable. Without
``ROLLSTREAM_REDIS_URL`` the data source first starts the run's own pipeline
(:mod:`rollstream.integrations.pipeline`) and fills in the URL, the namespace (the framework's
name) and the consumer name (``trainer``) before these settings are read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rollstream.common.errors import ConfigError
from rollstream.common.keys import validate_namespace

REDIS_URL = "ROLLSTREAM_REDIS_URL"
NAMESPACE = "ROLLSTREAM_NAMESPACE"
CONSUMER_NAME = "ROLLSTREAM_CONSUMER_NAME"
EVAL_FUNCTION = "ROLLSTREAM_EVAL_FUNCTION"
ENGINE_URL = "ROLLSTREAM_ENGINE_URL"
TAKE_TIMEOUT = "ROLLSTREAM_TAKE_TIMEOUT"
KEEP_CHECKPOINTS = "ROLLSTREAM_KEEP_CHECKPOINTS"
ALLOW_JOURNAL_GAP = "ROLLSTREAM_ALLOW_JOURNAL_GAP"
KEEP_FILTER = "ROLLSTREAM_KEEP_FILTER"
REPLAY_ARCHIVE = "ROLLSTREAM_REPLAY_ARCHIVE"
"""An archive folder (``rollstream archive --out``): train on its recorded batches, in order, with
no Redis, producers or engines (slime's ``--load-debug-rollout-data`` for rollstream)."""

_URL_SCHEMES = ("redis://", "rediss://", "unix://")


@dataclass(frozen=True, slots=True)
class Settings:
    redis_url: str
    namespace: str
    consumer_name: str
    eval_function: str | None = None
    """Import path of the function (or, for miles, class) that serves ``evaluation=True``."""
    engine_url: str | None = None
    """slime: where to ask the engines for their weight version (default: slime's router)."""
    take_timeout: float | None = None
    """Seconds one rollout may wait for its groups; None waits (take() still raises on a dead pipeline)."""
    keep_checkpoints: int = 2
    """How many saved checkpoints the journal can resume from (see docs/integrations.md)."""
    allow_journal_gap: bool = False
    """Resume from a checkpoint older than the journal covers (losing the rollouts in between)."""
    keep_filter: str | None = None
    """Import path ``module:function`` of the dynamic-sampling filter given to ``take()``."""
    replay_archive: str | None = None
    """An archive folder whose trained batches are replayed instead of taking from Redis."""

    @classmethod
    def replaying(cls, framework: str, environ: Mapping[str, str] | None = None) -> Settings | None:
        """The settings of a replay run when ``ROLLSTREAM_REPLAY_ARCHIVE`` is set, else None: no
        Redis variable is needed (``ROLLSTREAM_CONSUMER_NAME``, when set, picks that trainer's
        batches in an archive several trained into)."""
        env = os.environ if environ is None else environ
        folder = env.get(REPLAY_ARCHIVE, "").strip()
        if not folder:
            return None
        if not os.path.isdir(folder):
            raise ConfigError(f"environment variable {REPLAY_ARCHIVE}={folder!r} is not a folder")
        return cls(
            redis_url="", namespace=env.get(NAMESPACE, "").strip() or framework,
            consumer_name=env.get(CONSUMER_NAME, "").strip(), eval_function=env.get(EVAL_FUNCTION, "").strip() or None,
            replay_archive=folder,
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ

        def required(name: str, what: str) -> str:
            value = env.get(name, "").strip()
            if not value:
                raise ConfigError(f"environment variable {name} is not set: it must name {what}")
            return value

        def optional(name: str) -> str | None:
            value = env.get(name, "").strip()
            return value or None

        url = required(REDIS_URL, "the Redis server of the rollstream pipeline, e.g. redis://host:6379/0")
        if not url.startswith(_URL_SCHEMES):
            raise ConfigError(f"environment variable {REDIS_URL}={url!r} is not a redis://, rediss:// or unix:// URL")
        namespace = required(NAMESPACE, "the namespace given to `rollstream init --ns`")
        try:
            validate_namespace(namespace)
        except ValueError as exc:
            raise ConfigError(f"environment variable {NAMESPACE}: {exc}") from None
        consumer = required(CONSUMER_NAME, "this trainer's consumer name (keep it across restarts), e.g. trainer-0")

        take_timeout: float | None = None
        if (raw := optional(TAKE_TIMEOUT)) is not None:
            try:
                take_timeout = float(raw)
            except ValueError:
                take_timeout = -1.0
            if not take_timeout > 0:
                raise ConfigError(f"environment variable {TAKE_TIMEOUT}={raw!r} must be a positive number of seconds")

        keep = 2
        if (raw := optional(KEEP_CHECKPOINTS)) is not None:
            if not raw.isdigit() or int(raw) < 1:
                raise ConfigError(f"environment variable {KEEP_CHECKPOINTS}={raw!r} must be an integer >= 1")
            keep = int(raw)

        allow_gap = False
        if (raw := optional(ALLOW_JOURNAL_GAP)) is not None:
            if raw not in ("0", "1"):
                raise ConfigError(f"environment variable {ALLOW_JOURNAL_GAP}={raw!r} must be 0 or 1")
            allow_gap = raw == "1"

        return cls(
            redis_url=url,
            namespace=namespace,
            consumer_name=consumer,
            eval_function=optional(EVAL_FUNCTION),
            engine_url=optional(ENGINE_URL),
            take_timeout=take_timeout,
            keep_checkpoints=keep,
            allow_journal_gap=allow_gap,
            keep_filter=optional(KEEP_FILTER),
        )


def args_from_env(name: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The JSON object of argument names to values in the environment variable ``name`` (``{}``
    when unset): the ``args`` overrides of framework rewards and generate functions."""
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return {}
    try:
        values = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"environment variable {name} is not valid JSON: {exc}") from None
    if not isinstance(values, dict) or not all(isinstance(k, str) and k.isidentifier() for k in values):
        raise ConfigError(f"environment variable {name} must be a JSON object of argument names to values")
    return values
