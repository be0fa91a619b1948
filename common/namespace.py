"""Creating a namespace and reading its config: shared by every process that joins one."""

from __future__ import annotations

import logging
import secrets

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from .config import PipelineConfig
from .errors import ConfigError, NamespaceNotInitialized
from .events import now_ms
from .keys import PRODUCERS_GROUP, Keys, StateField
from .protocol import Feed, Heartbeats, Keyspace
from .redis_errors import translate_errors
from .redis_values import int_or, text

logger = logging.getLogger(__name__)


@translate_errors
async def ensure_groups(redis: Redis, keys: Keys) -> None:
    """Create the work streams and their consumer groups, the eval lane's included (idempotent)."""
    for stream, group in (*keys.consumer_groups, (keys.eval_prompts, PRODUCERS_GROUP)):
        try:
            await redis.xgroup_create(stream, group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise


MEMORY_HEADROOM = 0.2
"""Share of ``maxmemory`` kept out of the byte budget: prompts, the retry and dead-letter streams,
stream overhead, client buffers, and what the budget admits in flight beyond the projection."""


def memory_problem(maxmemory: int, policy: str, used: int, held: int, budget: int) -> str | None:
    """Why this Redis cannot hold the pipeline safely, or None. ``used``: memory in use now,
    ``held``: of which this namespace's group data (re-init), ``budget``: ``max_backlog_bytes``."""
    if policy and policy != "noeviction":
        return (
            f"Redis maxmemory-policy is {policy!r}: an evicting policy deletes keys under memory pressure, "
            "and an evicted stream is silent loss of prompts and groups (DESIGN §4.12). Set "
            "`CONFIG SET maxmemory-policy noeviction` (and in redis.conf), then run init again"
        )
    if maxmemory > 0 and budget > 0:
        room = int(maxmemory * (1 - MEMORY_HEADROOM)) - max(0, used - held)
        if budget > room:
            return (
                f"max_backlog_bytes {budget} does not fit in Redis maxmemory {maxmemory}: {max(0, used - held)} bytes "
                f"are in use by other data and {int(maxmemory * MEMORY_HEADROOM)} kept as headroom, leaving {room}; "
                "lower --max-backlog-bytes or raise maxmemory"
            )
    return None


@translate_errors
async def check_memory(redis: Redis, keys: Keys, config: PipelineConfig) -> None:
    """Refuse a Redis that can evict keys, or whose ``maxmemory`` cannot hold the byte budget
    (``INFO memory``: also answered where ``CONFIG`` is disabled)."""
    try:
        info = await redis.info("memory")
    except ResponseError as exc:  # a proxy or server without INFO: nothing to compare with
        logger.warning("namespace %s: cannot read INFO memory (%s): maxmemory and maxmemory-policy not checked",
                       keys.namespace, exc)
        return
    held = int_or(await redis.hget(keys.state, StateField.GROUP_BYTES), 0)
    # With a payload store the budget counts mostly the store's bytes (docs/wire.md): Redis holds
    # the entries' own, a small part of it, so only the policy is checked against Redis.
    budget = 0 if config.payload_store else config.max_backlog_bytes
    problem = memory_problem(
        int(info.get("maxmemory", 0) or 0), str(info.get("maxmemory_policy", "") or ""),
        int(info.get("used_memory", 0) or 0), held, budget,
    )
    if problem is not None:
        raise ConfigError(problem)
    if int(info.get("maxmemory", 0) or 0) == 0 and config.max_backlog_bytes == 0:
        logger.info("namespace %s: no maxmemory and no max_backlog_bytes: Redis memory is bounded by "
                    "max_backlog groups only", keys.namespace)


@translate_errors
async def init_namespace(redis: Redis, keys: Keys, config: PipelineConfig, *, force: bool = False) -> bool:
    """Write the namespace config; True when written. An existing, different config is kept
    unless ``force``, and even then refused while a producer, a trainer or a feeder is alive:
    changing n or the batch size under running producers corrupts groups, and a new mix under a
    running feeder leaves sources unfed. The namespace id is kept across a
    ``--force`` (the state hash, with the feeder cursor, stays valid). A Redis that can evict
    keys, or cannot hold the byte budget, is refused (:func:`check_memory`)."""
    await check_memory(redis, keys, config)
    existing = await redis.hgetall(keys.config)
    namespace_id = text(existing.get(StateField.NAMESPACE_ID.encode())) or None
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
        await _refuse_while_alive(redis, keys, current.heartbeat_timeout if current else 15.0)
    fresh_id = namespace_id or secrets.token_hex(8)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(keys.config)
        pipe.hset(keys.config, mapping={**config.to_redis(), StateField.NAMESPACE_ID: fresh_id})
        if namespace_id is None:  # a new namespace: its state hash is this namespace's from now on
            pipe.hsetnx(keys.state, StateField.NAMESPACE_ID, fresh_id)
        pipe.hsetnx(keys.state, StateField.WEIGHT_VERSION, 0)
        pipe.hsetnx(keys.state, StateField.PAUSED, 0)
        await pipe.execute()
    await ensure_groups(redis, keys)
    return True


@translate_errors
async def _refuse_while_alive(redis: Redis, keys: Keys, heartbeat_timeout: float) -> None:
    alive = (await Heartbeats(redis, keys).fleet(now_ms(), heartbeat_timeout)).alive_names
    trainers = await Keyspace(redis, keys).trainer_names()
    feeder = await Feed(redis, keys).live_feeder()
    if alive or trainers or feeder:
        raise ConfigError(
            f"namespace {keys.namespace!r} is in use (live producers: {', '.join(alive) or 'none'}; "
            f"connected trainers: {', '.join(trainers) or 'none'}; a running feeder: {feeder or 'none'}): changing "
            "its config now would dead-letter the groups in flight, or leave the feeder feeding another mix. Stop "
            "them first (SIGTERM drains a producer, stops a feeder), then init --force"
        )


@translate_errors
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


@translate_errors
async def read_state(redis: Redis, keys: Keys) -> dict[str, str]:
    """The ``state`` hash as text (damaged bytes replaced, never raised on)."""
    raw = await redis.hgetall(keys.state)
    return {text(k): text(v) for k, v in raw.items()}


def state_int(state: dict[str, str], field: str) -> int:
    """An integer field of :func:`read_state`'s result; 0 when missing or damaged."""
    return int_or(state.get(field))
