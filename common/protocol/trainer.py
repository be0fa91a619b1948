"""What a ``take()`` reads and records beside its groups."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from ..admission import AdmissionTerms, admission_capacity
from ..config import PipelineConfig
from ..events import now_ms
from ..keys import PRODUCERS_GROUP, TRAINER_GROUP, Keys, StateField
from ..parse import int_or
from ..redis_errors import is_oom, translate_errors
from .control import TAKEN_MESSAGE

# -- views -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TakeStats:
    """What a ``take()`` reports beside its groups, read in one round trip."""

    groups_length: int
    groups_pending: int
    prompts_pending: int
    """In flight: pending in the prompt and retry streams."""
    admission_blocked_ms: int
    heartbeats: dict[bytes, bytes]


@translate_errors
async def mark_take(redis: Redis, keys: Keys) -> TakeStats:
    """Record the time of a ``take()`` (not when Redis is out of memory) and read its statistics
    (one round trip), then announce it: producers refused for a full backlog retry at once instead
    of polling ADMIT every 0.2 s (docs/scale.md). The PUBLISH is a command of its own: a Redis
    Cluster pipeline cannot route it."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hset(keys.state, StateField.LAST_TAKE_MS, now_ms())
        pipe.xlen(keys.groups)
        pipe.xpending(keys.groups, TRAINER_GROUP)
        pipe.xpending(keys.prompts, PRODUCERS_GROUP)
        pipe.xpending(keys.retry, PRODUCERS_GROUP)
        pipe.hget(keys.state, StateField.ADMISSION_BLOCKED_MS)
        pipe.hgetall(keys.producers)
        replies = await pipe.execute(raise_on_error=False)
    # The time of the take is a statistic: Redis refuses it at maxmemory, and take() goes on.
    if isinstance(replies[0], Exception) and not is_oom(replies[0]):
        raise replies[0]
    for reply in replies[1:]:
        if isinstance(reply, Exception):
            raise reply
    _, groups_len, groups_pending, prompts_pending, retry_pending, blocked_raw, beats = replies
    await redis.publish(keys.control, TAKEN_MESSAGE)
    return TakeStats(
        groups_length=int(groups_len),
        groups_pending=int(groups_pending["pending"]),
        prompts_pending=int(prompts_pending["pending"]) + int(retry_pending["pending"]),
        admission_blocked_ms=int_or(blocked_raw),
        heartbeats=dict(beats),
    )


@translate_errors
async def record_stale_streak(redis: Redis, keys: Keys, values: Mapping[str, int]) -> None:
    """Write a trainer's stale-recycling diagnosis (the ``StateField.STALE`` fields) for ``inspect``."""
    await redis.hset(keys.state, mapping={name: int(values[name]) for name in StateField.STALE})


@translate_errors
async def read_admission_terms(redis: Redis, keys: Keys, config: PipelineConfig) -> AdmissionTerms:
    """The admission rule's terms now (what ADMIT would compute), read in one round trip; a
    stream or group that does not exist counts as empty."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.xpending(keys.prompts, PRODUCERS_GROUP)
        pipe.xpending(keys.retry, PRODUCERS_GROUP)
        pipe.xlen(keys.groups)
        pipe.xpending(keys.groups, TRAINER_GROUP)
        pipe.hmget(
            keys.state,
            [StateField.COMMITTED, StateField.VERSION_START_CONSUMED, StateField.PREV_VERSION_CONSUMED],
        )
        replies = await pipe.execute(raise_on_error=False)

    def pending(reply: Any) -> int:
        return int(reply["pending"]) if isinstance(reply, dict) else 0

    committed, start, prev = (int_or(v) for v in replies[4])
    return admission_capacity(
        prompts_pending=pending(replies[0]),
        retry_pending=pending(replies[1]),
        groups_length=int_or(replies[2]),
        groups_pending=pending(replies[3]),
        committed=committed,
        version_start_consumed=start,
        prev_version_consumed=prev,
        steps_per_version=config.steps_per_version,
        max_staleness=config.max_staleness or 0,
        batch_size=config.batch_size,
    )


@translate_errors
async def stream_lengths(redis: Redis, keys: Keys) -> tuple[int, int]:
    """(entries in the group stream, entries in the prompt and retry streams)."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.xlen(keys.groups)
        pipe.xlen(keys.prompts)
        pipe.xlen(keys.retry)
        groups, prompts, retry = await pipe.execute()
    return int(groups), int(prompts) + int(retry)


@translate_errors
async def waiting_groups(redis: Redis, keys: Keys) -> int:
    """Groups in the group stream not delivered to any trainer consumer yet."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.xlen(keys.groups)
        pipe.xpending(keys.groups, TRAINER_GROUP)
        length, pending = await pipe.execute()
    return max(0, int(length) - int(pending["pending"]))
