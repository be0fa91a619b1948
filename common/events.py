"""The events stream: lifecycle and error reports that the trainer and operators read.

Entries are plain fields (``kind``, ``producer``, ``ts_ms``, ``message``, ``traceback``), so
``redis-cli XREVRANGE rollstream:{ns}:events + - COUNT 5`` shows the last errors as text.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from .keys import EVENTS_MAXLEN, Keys
from .redis_errors import translate_errors
from .redis_values import parse_int, text

logger = logging.getLogger(__name__)

FATAL = "fatal"
START = "start"
STOP = "stop"
DRAIN = "drain"
WARNING = "warning"


def now_ms() -> int:
    return int(time.time() * 1000)


@translate_errors
async def record_event(
    redis: Redis,
    keys: Keys,
    kind: str,
    *,
    source: str,
    message: str = "",
    traceback: str = "",
) -> None:
    """Append an event; the stream is a capped log (approximate MAXLEN), not a work queue."""
    fields = {"kind": kind, "producer": source, "ts_ms": now_ms(), "message": message[:4000]}
    if traceback:
        fields["traceback"] = traceback[-16000:]
    await redis.xadd(keys.events, fields, maxlen=EVENTS_MAXLEN, approximate=True)


def unrecovered(fatal_ts_ms: int, last_publish_ms: int | None) -> bool:
    """The one rule for a producer's fatal event, used by ``take()`` and by the operators' health:
    it is unrecovered while no group was published after it (once any producer publishes again,
    the pipeline goes on without the failed one)."""
    return fatal_ts_ms > (last_publish_ms or 0)


@dataclass(frozen=True, slots=True)
class Event:
    id: str
    kind: str
    source: str
    ts_ms: int
    message: str
    traceback: str
    damaged: str = ""
    """What is wrong with the entry (a ``ts_ms`` that is not an integer: then ``ts_ms`` is 0 and the
    event never counts as an unrecovered failure), else empty."""


def _text(fields: dict[bytes, bytes], key: str) -> str:
    return text(fields.get(key.encode()))


@translate_errors
async def recent_events(redis: Redis, keys: Keys, count: int = 20, kind: str | None = None) -> list[Event]:
    """The newest events first, optionally of one kind."""
    return parse_events(await redis.xrevrange(keys.events, count=events_to_read(count, kind)), keys, count, kind)


def events_to_read(count: int, kind: str | None) -> int:
    """How many entries :func:`recent_events` reads to find ``count`` events of ``kind``."""
    return count if kind is None else count * 20


def parse_events(raw: list[Any], keys: Keys, count: int, kind: str | None) -> list[Event]:
    """The first ``count`` events (of ``kind``) of an XREVRANGE reply on the events stream: pure,
    for a caller that reads it in a pipeline."""
    events = []
    for entry_id, fields in raw:
        ts_raw = fields.get(b"ts_ms")
        ts_ms = parse_int(ts_raw)
        event = Event(
            id=text(entry_id),
            kind=_text(fields, "kind"),
            source=_text(fields, "producer"),
            ts_ms=ts_ms or 0,
            message=_text(fields, "message"),
            traceback=_text(fields, "traceback"),
            damaged="" if ts_ms is not None else (
                f"{keys.events} entry {text(entry_id)}: ts_ms = {text(ts_raw)[:60]!r} is not an integer"
            ),
        )
        if kind is None or event.kind == kind:
            events.append(event)
        if len(events) >= count:
            break
    return events
