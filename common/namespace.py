"""Creating a namespace and reading its config: shared by every process that joins one."""

from __future__ import annotations

import logging

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from .config import PipelineConfig
from .errors import ConfigError, NamespaceNotInitialized
from .keys import PRODUCERS_GROUP, TRAINER_GROUP, Keys, StateField
from .parse import int_or, text

logger = logging.getLogger(__name__)


async def ensure_groups(redis: Redis, keys: Keys) -> None:
    """Create the work streams and their consumer groups (idempotent)."""
    for stream, group in ((keys.prompts, PRODUCERS_GROUP), (keys.retry, PRODUCERS_GROUP), (keys.groups, TRAINER_GROUP)):
        try:
            await redis.xgroup_create(stream, group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise


async def init_namespace(redis: Redis, keys: Keys, config: PipelineConfig, *, force: bool = False) -> bool:
    """Write the namespace config; True when written. An existing, different config is kept
    unless ``force``: changing n or the batch size under running producers corrupts groups."""
    existing = await redis.hgetall(keys.config)
    if existing:
        try:
            current = PipelineConfig.from_redis(existing)
        except ConfigError:
            current = None
        if current == config:
            await ensure_groups(redis, keys)
            return False
        if not force:
            raise ConfigError(
                f"namespace {keys.namespace!r} already has a different config ({current}); "
                "pass --force to overwrite it"
            )
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(keys.config)
        pipe.hset(keys.config, mapping=config.to_redis())
        pipe.hsetnx(keys.state, StateField.WEIGHT_VERSION, 0)
        pipe.hsetnx(keys.state, StateField.PAUSED, 0)
        await pipe.execute()
    await ensure_groups(redis, keys)
    return True


async def load_config(redis: Redis, keys: Keys) -> PipelineConfig:
    raw = await redis.hgetall(keys.config)
    if not raw:
        raise NamespaceNotInitialized(keys.namespace)
    config = PipelineConfig.from_redis(raw)
    if raw.get(b"keep"):
        logger.warning(
            "namespace %s: its config names a keep filter (%r, written by an older `rollstream init --keep`); "
            "code is never loaded from Redis: pass keep= to GroupConsumer.connect instead",
            keys.namespace, raw[b"keep"][:200],
        )
    await ensure_groups(redis, keys)
    return config


async def read_state(redis: Redis, keys: Keys) -> dict[str, str]:
    """The ``state`` hash as text (damaged bytes replaced, never raised on)."""
    raw = await redis.hgetall(keys.state)
    return {text(k): text(v) for k, v in raw.items()}


def state_int(state: dict[str, str], field: str) -> int:
    """An integer field of :func:`read_state`'s result; 0 when missing or damaged."""
    return int_or(state.get(field))
