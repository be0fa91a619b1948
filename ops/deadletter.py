"""Dead letters: list, requeue (as a fresh attempt) and drop entries of the dead-letter stream."""

from __future__ import annotations

import dataclasses
import logging

from redis.asyncio import Redis
from rollstream.common.codec import DEFAULT_LIMITS, decode_group_entry, decode_prompt_entry, prompt_fields
from rollstream.common.errors import ConfigError, DecodeError
from rollstream.common.keys import Keys
from rollstream.common.models import Prompt, retry_prompt
from rollstream.common.protocol import DeadLetters
from rollstream.common.redis_values import RawFields

from ._fields import as_int, text

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class DeadEntry:
    id: str
    source: str
    reason: str
    index: int | None
    attempt: int | None
    ts_ms: int | None
    prompt: Prompt | None
    """The prompt to requeue, or None when the entry's data decodes as neither prompt nor group."""
    error: str = ""


def dead_entry(entry_id: bytes | str, fields: RawFields) -> DeadEntry:
    """Decode one dead-letter entry: a prompt payload (this build writes only those) or, from
    entries written by older builds, a group payload turned into its prompt."""
    named = {text(k): v for k, v in fields.items()}
    prompt: Prompt | None = None
    error = ""
    try:
        prompt = decode_prompt_entry(fields, DEFAULT_LIMITS)
    except DecodeError as prompt_exc:
        try:
            group = decode_group_entry(fields, DEFAULT_LIMITS)
        except DecodeError as group_exc:
            error = f"not a prompt ({prompt_exc}) nor a group ({group_exc})"
        else:
            prompt = retry_prompt(group, text(named.get("reason", b"")))  # written by older builds
    index = prompt.index if prompt is not None else (as_int(named["index"]) if "index" in named else None)
    attempt = prompt.attempt if prompt is not None else (as_int(named["attempt"]) if "attempt" in named else None)
    return DeadEntry(
        id=text(entry_id),
        source=text(named.get("source", b"")),
        reason=text(named.get("reason", b"")),
        index=index,
        attempt=attempt,
        ts_ms=as_int(named["ts_ms"]) if "ts_ms" in named else None,
        prompt=prompt,
        error=error,
    )


async def dead_entries(
    redis: Redis, keys: Keys, *, ids: list[str] | None = None, count: int | None = None
) -> list[DeadEntry]:
    """Dead-letter entries, oldest first: the given ids (missing ones skipped) or the first ``count``."""
    if count is not None and count < 1:
        raise ConfigError(f"count must be positive, got {count!r}")
    rows = await DeadLetters(redis, keys).entries(ids=ids, count=count)
    return [dead_entry(entry_id, fields) for entry_id, fields in rows]


async def requeue_dead(redis: Redis, keys: Keys, entry: DeadEntry) -> str | None:
    """Move one dead entry back as a fresh attempt (to the retry stream, admitted first); the new
    prompt id, or None when it was already gone. Raises ValueError for entries that cannot be decoded."""
    if entry.prompt is None:
        raise ValueError(f"dead entry {entry.id} cannot be requeued: {entry.error}")
    fresh = dataclasses.replace(
        entry.prompt,
        attempt=0,
        partial=None,
        history=[*entry.prompt.history, f"requeued from dead-letter {entry.id}"][-20:],
    )
    result = await DeadLetters(redis, keys).requeue(entry.id, prompt_fields(fresh))
    if not result:
        return None
    logger.info("requeued dead entry %s (prompt %d) as %s", entry.id, fresh.index, text(result))
    return text(result)


async def drop_dead(redis: Redis, keys: Keys, ids: list[str]) -> int:
    """Delete these dead entries for good; the number that existed."""
    return await DeadLetters(redis, keys).drop(ids)
