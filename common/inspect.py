"""What ``rollstream inspect`` shows: one read-only snapshot of a namespace, as plain data.

The CLI renders it as a screen or prints it as JSON; the JSON keys are a stable interface
(documented in ``docs/operations.md``), so every field here is added, never renamed. The
snapshot also judges health, so the exit code of ``inspect`` and what an operator reads agree.
Everything is read with non-blocking commands (XLEN, XPENDING, XINFO, HGETALL, XREVRANGE).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from .codec import DEFAULT_LIMITS, decode_group_entry, decode_prompt_entry, prompt_fields
from .config import PipelineConfig
from .errors import ConfigError, DecodeError
from .events import FATAL, WARNING, now_ms, recent_events
from .keys import ALIVE_STATES, PREFIX, PRODUCERS_GROUP, TRAINER_GROUP, Keys, StateField, namespace_of
from .lua import Scripts
from .models import Prompt, retry_prompt

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
DEFAULT_STUCK_AFTER = 300.0
LEASE_WARNING_FRACTION = 0.8
"""A lease idle for more than this fraction of ``lease_seconds`` is about to be taken over."""
_PENDING_SCAN_LIMIT = 10_000
_TRACEBACK_LINES = 6


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _id_ms(entry_id: str | bytes) -> int:
    return int(_text(entry_id).split("-", 1)[0])


def _age_s(now: int, then_ms: int | None) -> float | None:
    return None if not then_ms else round(max(0, now - then_ms) / 1000, 3)


def _int(value: Any) -> int:
    try:
        return int(_text(value)) if value not in (None, b"", "") else 0
    except ValueError:
        return 0


async def _consumers(redis: Redis, stream: str, group: str) -> list[dict[str, Any]]:
    try:
        rows = await redis.xinfo_consumers(stream, group)
    except ResponseError:  # no stream or no group yet
        return []
    out = []
    for row in rows:
        item = {"name": _text(row["name"]), "pending": int(row["pending"]), "idle_s": round(row["idle"] / 1000, 3)}
        if "inactive" in row and row["inactive"] is not None and int(row["inactive"]) >= 0:
            item["inactive_s"] = round(int(row["inactive"]) / 1000, 3)  # Redis >= 7.2
        out.append(item)
    return out


async def _group_info(redis: Redis, stream: str, group: str) -> dict[str, Any] | None:
    try:
        groups = await redis.xinfo_groups(stream)
    except ResponseError:
        return None
    for row in groups:
        if _text(row["name"]) == group:
            return {k: row[k] for k in row}
    return None


async def _prompts_section(redis: Redis, keys: Keys, lease_s: float, now: int) -> dict[str, Any]:
    length = await redis.xlen(keys.prompts)
    section: dict[str, Any] = {
        "queued": length,
        "in_flight": 0,
        "waiting": length,
        "oldest_pending_age_s": None,
        "max_pending_idle_s": None,
        "leases_expiring": 0,
        "lease_seconds": lease_s,
        "consumers": [],
    }
    try:
        summary = await redis.xpending(keys.prompts, PRODUCERS_GROUP)
    except ResponseError:
        return section
    pending = int(summary["pending"])
    section["in_flight"] = pending
    section["waiting"] = max(0, length - pending)
    section["consumers"] = await _consumers(redis, keys.prompts, PRODUCERS_GROUP)
    if pending:
        section["oldest_pending_age_s"] = _age_s(now, _id_ms(summary["min"]))
        rows = await redis.xpending_range(keys.prompts, PRODUCERS_GROUP, min="-", max="+", count=_PENDING_SCAN_LIMIT)
        idles = [int(r["time_since_delivered"]) for r in rows]
        section["max_pending_idle_s"] = round(max(idles) / 1000, 3) if idles else None
        section["leases_expiring"] = sum(1 for i in idles if i > LEASE_WARNING_FRACTION * lease_s * 1000)
    return section


async def _groups_section(redis: Redis, keys: Keys, now: int) -> dict[str, Any]:
    length = await redis.xlen(keys.groups)
    section: dict[str, Any] = {
        "length": length,
        "backlog": length,
        "taken_uncommitted": 0,
        "oldest_waiting_age_s": None,
        "consumers": [],
    }
    info = await _group_info(redis, keys.groups, TRAINER_GROUP)
    if info is None:
        return section
    pending = int((await redis.xpending(keys.groups, TRAINER_GROUP))["pending"])
    section["taken_uncommitted"] = pending
    section["backlog"] = max(0, length - pending)
    section["consumers"] = await _consumers(redis, keys.groups, TRAINER_GROUP)
    last = _text(info.get("last-delivered-id") or "0-0")
    first = await redis.xrange(keys.groups, min=f"({last}", max="+", count=1)
    if first:
        section["oldest_waiting_age_s"] = _age_s(now, _id_ms(first[0][0]))
    return section


def _producer_rows(
    raw: dict[bytes, bytes], pending: dict[str, int], timeout_s: float, now: int
) -> list[dict[str, Any]]:
    rows = []
    for name_raw, value in raw.items():
        name = _text(name_raw)
        try:
            beat = json.loads(value)
            if not isinstance(beat, dict):
                raise ValueError("heartbeat is not an object")
        except ValueError:
            rows.append({"name": name, "status": "unreadable", "alive": False, "raw": _text(value)[:200]})
            continue
        last_seen = _int(beat.get("last_seen_ms"))
        state = str(beat.get("state", "unknown"))
        fresh = last_seen >= now - timeout_s * 1000
        alive = fresh and state in ALIVE_STATES
        status = state if (fresh or state not in ALIVE_STATES) else "dead"
        rows.append(
            {
                "name": name,
                "host": beat.get("host"),
                "pid": beat.get("pid"),
                "state": state,
                "status": status,
                "alive": alive,
                "in_flight_samples": beat.get("in_flight_samples", 0),
                "in_flight_prompts": beat.get("in_flight_prompts", 0),
                "concurrency": beat.get("concurrency"),
                "leases_held": pending.get(name, 0),
                "published": beat.get("published", 0),
                "groups_last_minute": beat.get("groups_last_minute", 0),
                "engine_retries": beat.get("engine_retries", 0),
                "last_seen_ms": last_seen,
                "heartbeat_age_s": _age_s(now, last_seen),
            }
        )
    rows.sort(key=lambda r: (not r["alive"], r["name"]))
    return rows


def _event_row(event: Any, now: int) -> dict[str, Any]:
    lines = [line for line in event.traceback.splitlines() if line.strip()]
    return {
        "id": event.id,
        "kind": event.kind,
        "source": event.source,
        "ts_ms": event.ts_ms,
        "age_s": _age_s(now, event.ts_ms),
        "message": event.message,
        "traceback_head": lines[:_TRACEBACK_LINES],
        "exception": lines[-1] if lines else "",
    }


def _judge(snap: dict[str, Any], stuck_after: float, now: int) -> dict[str, Any]:
    problems: list[str] = []
    warnings: list[str] = []
    if snap["config"] is None:
        problems.append(f"namespace {snap['namespace']!r} is not initialised (no config hash)")
    producers = snap["producers"]
    alive = [p for p in producers if p["alive"]]
    dead = [p for p in producers if p["status"] == "dead"]
    if not alive:
        detail = f" ({len(dead)} dead: {', '.join(p['name'] for p in dead)})" if dead else ""
        problems.append(f"no live producer{detail}")
    elif dead:
        warnings.append(f"{len(dead)} dead producer(s): {', '.join(p['name'] for p in dead)}")
    trainer = snap["trainer"]
    last_commit = trainer["last_commit_ms"] or 0
    fatal = [e for e in snap["events"] if e["kind"] == FATAL and e["ts_ms"] > last_commit]
    if fatal:
        newest = fatal[0]
        problems.append(
            f"fatal error in {newest['source']} {newest['age_s']:.0f} s ago, after the last commit: {newest['message']}"
        )
    groups = snap["groups"]
    last_trainer = max(trainer["last_take_ms"] or 0, last_commit)
    if groups["backlog"] > 0 and groups["oldest_waiting_age_s"] is not None:
        idle = min(groups["oldest_waiting_age_s"], (now - last_trainer) / 1000 if last_trainer else float("inf"))
        if idle > stuck_after:
            problems.append(
                f"backlog stuck: {groups['backlog']} groups waiting, no take or commit for {idle:.0f} s "
                f"(> {stuck_after:.0f} s)"
            )
    if groups["taken_uncommitted"] > 0 and last_trainer and (now - last_trainer) / 1000 > stuck_after:
        problems.append(
            f"trainer stuck: {groups['taken_uncommitted']} groups taken but not committed, no take or commit "
            f"for {(now - last_trainer) / 1000:.0f} s (> {stuck_after:.0f} s)"
        )
    prompts = snap["prompts"]
    if prompts["leases_expiring"]:
        warnings.append(
            f"{prompts['leases_expiring']} prompt lease(s) idle past {LEASE_WARNING_FRACTION:.0%} of "
            f"{prompts['lease_seconds']:.0f} s: their producer may be gone"
        )
    if snap["dead"]["length"]:
        warnings.append(f"{snap['dead']['length']} dead-letter entries (see `rollstream dead list`)")
    if trainer["paused"]:
        warnings.append("paused: producers admit nothing until `rollstream resume`")
    return {"ok": not problems, "problems": problems, "warnings": warnings}


async def snapshot(
    redis: Redis, keys: Keys, *, stuck_after: float = DEFAULT_STUCK_AFTER, events: int = 5
) -> dict[str, Any]:
    """Everything an operator needs about one namespace, with a health verdict."""
    if stuck_after <= 0:
        raise ValueError(f"stuck_after must be positive, got {stuck_after!r}")
    now = now_ms()
    raw_config = await redis.hgetall(keys.config)
    config: PipelineConfig | None = None
    config_error = None
    if raw_config:
        try:
            config = PipelineConfig.from_redis(raw_config)
        except ConfigError as exc:
            config_error = str(exc)
    defaults = {f.name: f.default for f in dataclasses.fields(PipelineConfig)}
    lease_s = float(config.lease_seconds if config else defaults["lease_seconds"])  # type: ignore[arg-type]
    timeout_s = float(config.heartbeat_timeout if config else defaults["heartbeat_timeout"])  # type: ignore[arg-type]
    state = {_text(k): _text(v) for k, v in (await redis.hgetall(keys.state)).items()}
    prompts = await _prompts_section(redis, keys, lease_s, now)
    pending_by_producer = {c["name"]: c["pending"] for c in prompts["consumers"]}
    producers = _producer_rows(await redis.hgetall(keys.producers), pending_by_producer, timeout_s, now)
    recent = await recent_events(redis, keys, count=50)
    errors = [_event_row(e, now) for e in recent if e.kind in (FATAL, WARNING)][:events]
    counters: dict[str, float] = {name: _int(state.get(name)) for name in (*StateField.COUNTERS, StateField.REQUEUED)}
    counters["admission_blocked_s"] = round(_int(state.get(StateField.ADMISSION_BLOCKED_MS)) / 1000, 3)

    def when(field: str) -> int | None:
        return _int(state.get(field)) or None

    trainer = {
        "weight_version": _int(state.get(StateField.WEIGHT_VERSION)),
        "paused": state.get(StateField.PAUSED) == "1",
        "last_take_ms": when(StateField.LAST_TAKE_MS),
        "last_commit_ms": when(StateField.LAST_COMMIT_MS),
        "last_publish_ms": when(StateField.LAST_PUBLISH_MS),
        "last_take_age_s": _age_s(now, when(StateField.LAST_TAKE_MS)),
        "last_commit_age_s": _age_s(now, when(StateField.LAST_COMMIT_MS)),
        "last_publish_age_s": _age_s(now, when(StateField.LAST_PUBLISH_MS)),
    }
    snap: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "namespace": keys.namespace,
        "generated_ms": now,
        "config": dataclasses.asdict(config) if config else None,
        "config_error": config_error,
        "prompts": prompts,
        "groups": await _groups_section(redis, keys, now),
        "dead": {"length": await redis.xlen(keys.dead)},
        "producers": producers,
        "producers_alive": sum(1 for p in producers if p["alive"]),
        "trainer": trainer,
        "counters": counters,
        "feeder": {
            "next_index": _int(state.get(StateField.FEED_NEXT_INDEX)),
            "epoch": _int(state.get(StateField.FEED_EPOCH)),
            "dataset": state.get(StateField.FEED_DATASET) or None,
        },
        "events": errors,
    }
    snap["health"] = _judge(snap, stuck_after, now)
    return snap


# -- namespaces ------------------------------------------------------------------------------


async def list_namespaces(redis: Redis) -> list[str]:
    """Namespaces with at least one key, found with SCAN (never KEYS: it blocks the server)."""
    found: set[str] = set()
    async for key in redis.scan_iter(match=f"{PREFIX}:{{*}}:*", count=1000):
        namespace = namespace_of(_text(key))
        if namespace is not None:
            found.add(namespace)
    return sorted(found)


async def delete_namespace(redis: Redis, keys: Keys) -> int:
    """Delete exactly this namespace's keys; the number of keys that existed."""
    return int(await redis.delete(*keys.all_keys()))


# -- dead letters ----------------------------------------------------------------------------

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


def dead_entry(entry_id: bytes | str, fields: Mapping[bytes | str, Any]) -> DeadEntry:
    """Decode one dead-letter entry: a prompt payload (this build writes only those) or, from
    entries written by older builds, a group payload turned into its prompt."""
    text = {_text(k): v for k, v in fields.items()}
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
            prompt = retry_prompt(group, _text(text.get("reason", b"")))  # written by older builds
    index = prompt.index if prompt is not None else (_int(text["index"]) if "index" in text else None)
    attempt = prompt.attempt if prompt is not None else (_int(text["attempt"]) if "attempt" in text else None)
    return DeadEntry(
        id=_text(entry_id),
        source=_text(text.get("source", b"")),
        reason=_text(text.get("reason", b"")),
        index=index,
        attempt=attempt,
        ts_ms=_int(text["ts_ms"]) if "ts_ms" in text else None,
        prompt=prompt,
        error=error,
    )


async def dead_entries(
    redis: Redis, keys: Keys, *, ids: list[str] | None = None, count: int | None = None
) -> list[DeadEntry]:
    """Dead-letter entries, oldest first: the given ids (missing ones skipped) or the first ``count``."""
    if count is not None and count < 1:
        raise ValueError(f"count must be positive, got {count!r}")
    if ids:
        rows = []
        for entry_id in ids:
            rows.extend(await redis.xrange(keys.dead, min=entry_id, max=entry_id))
    else:
        rows = await redis.xrange(keys.dead, count=count)
    return [dead_entry(entry_id, fields) for entry_id, fields in rows]


async def requeue_dead(redis: Redis, keys: Keys, entry: DeadEntry) -> str | None:
    """Move one dead entry back to the prompt stream as a fresh attempt; the new prompt id,
    or None when it was already gone. Raises ValueError for entries that cannot be decoded."""
    if entry.prompt is None:
        raise ValueError(f"dead entry {entry.id} cannot be requeued: {entry.error}")
    fresh = dataclasses.replace(
        entry.prompt,
        attempt=0,
        partial=None,
        history=[*entry.prompt.history, f"requeued from dead-letter {entry.id}"][-20:],
    )
    result = await Scripts(redis, keys).requeue(entry.id, prompt_fields(fresh))
    if not result:
        return None
    logger.info("requeued dead entry %s (prompt %d) as %s", entry.id, fresh.index, _text(result))
    return _text(result)


async def drop_dead(redis: Redis, keys: Keys, ids: list[str]) -> int:
    if not ids:
        return 0
    return int(await redis.xdel(keys.dead, *ids))
