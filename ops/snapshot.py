"""What ``rollstream inspect`` shows: one read-only snapshot of a namespace, as plain data.

The CLI renders it as a screen or prints it as JSON; the JSON keys are a stable interface
(documented in ``docs/operations.md``), so every field here is added, never renamed. The
snapshot also assesses health, so the exit code of ``inspect`` and what an operator reads agree.
Everything is read with non-blocking commands (XLEN, XPENDING, XINFO, HGETALL, XREVRANGE).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from redis.asyncio import Redis
from rollstream.common import bias
from rollstream.common.admission import DEFAULT_STALL_AFTER
from rollstream.common.config import PipelineConfig
from rollstream.common.errors import ConfigError
from rollstream.common.events import FATAL, WARNING, now_ms
from rollstream.common.keys import ALIVE_STATES, PRODUCERS_GROUP, TRAINER_GROUP, Keys, SourceField, StateField
from rollstream.common.payload.store import redact_store_url
from rollstream.common.protocol import (
    EpisodeJournals,
    Fleet,
    Heartbeat,
    NamespaceLimits,
    StreamView,
    fold,
    state_mismatch,
)
from rollstream.common.protocol.objects import PayloadLedger
from rollstream.common.redis_values import damaged_fields

from ._fields import as_int as _int
from ._fields import text as _text
from .health import DEFAULT_STUCK_AFTER, LEASE_WARNING_FRACTION, assess

SCHEMA_VERSION = 1
_PENDING_SCAN_LIMIT = 10_000
_TRACEBACK_LINES = 6


def _id_ms(entry_id: str | bytes) -> int:
    return int(_text(entry_id).split("-", 1)[0])


def _age_s(now: int, then_ms: int | None) -> float | None:
    return None if not then_ms else round(max(0, now - then_ms) / 1000, 3)


async def _consumers(view: StreamView, stream: str, group: str) -> list[dict[str, Any]]:
    out = []
    for row in await view.consumers(stream, group):
        item = {"name": _text(row["name"]), "pending": int(row["pending"]), "idle_s": round(row["idle"] / 1000, 3)}
        if "inactive" in row and row["inactive"] is not None and int(row["inactive"]) >= 0:
            item["inactive_s"] = round(int(row["inactive"]) / 1000, 3)  # Redis >= 7.2
        out.append(item)
    return out


async def _prompts_section(view: StreamView, keys: Keys, lease_s: float, now: int) -> dict[str, Any]:
    length = await view.length(keys.prompts)
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
    summary = await view.pending_summary(keys.prompts, PRODUCERS_GROUP)
    if summary is None:
        return section
    pending = int(summary["pending"])
    section["in_flight"] = pending
    section["waiting"] = max(0, length - pending)
    section["consumers"] = await _consumers(view, keys.prompts, PRODUCERS_GROUP)
    if pending:
        section["oldest_pending_age_s"] = _age_s(now, _id_ms(summary["min"]))
        idles = await view.pending_idle_ms(keys.prompts, PRODUCERS_GROUP, _PENDING_SCAN_LIMIT)
        section["max_pending_idle_s"] = round(max(idles) / 1000, 3) if idles else None
        section["leases_expiring"] = sum(1 for i in idles if i > LEASE_WARNING_FRACTION * lease_s * 1000)
    return section


async def _retry_section(view: StreamView, keys: Keys) -> dict[str, Any]:
    """The retry stream: recycled, returned and requeued prompts, admitted before fresh ones."""
    length = await view.length(keys.retry)
    summary = await view.pending_summary(keys.retry, PRODUCERS_GROUP)
    pending = int(summary["pending"]) if summary is not None else 0
    return {"queued": length, "in_flight": pending, "waiting": max(0, length - pending)}


async def _groups_section(view: StreamView, keys: Keys, now: int) -> dict[str, Any]:
    length = await view.length(keys.groups)
    section: dict[str, Any] = {
        "length": length,
        "backlog": length,
        "taken_uncommitted": 0,
        "oldest_waiting_age_s": None,
        "consumers": [],
    }
    info = await view.group_info(keys.groups, TRAINER_GROUP)
    summary = await view.pending_summary(keys.groups, TRAINER_GROUP)
    if info is None or summary is None:
        return section
    pending = int(summary["pending"])
    section["taken_uncommitted"] = pending
    section["backlog"] = max(0, length - pending)
    section["consumers"] = await _consumers(view, keys.groups, TRAINER_GROUP)
    last = _text(info.get("last-delivered-id") or "0-0")
    first = await view.first_after(keys.groups, last)
    if first is not None:
        section["oldest_waiting_age_s"] = _age_s(now, _id_ms(first))
    return section


def _producer_rows(fleet: Fleet, pending: dict[str, int], now: int) -> list[dict[str, Any]]:
    rows = []
    for member in fleet.members:
        name, beat, alive = member.name, member.beat, member.alive
        if beat is None:
            rows.append({"name": name, "status": "unreadable", "alive": False,
                         "raw": _text(member.raw)[:200], "damage": member.error})
            continue
        status = beat.state if (member.fresh or beat.state not in ALIVE_STATES) else "dead"
        rows.append({
            "name": name,
            "status": status,
            "alive": alive,
            **dataclasses.asdict(beat),  # every declared stat (common/heartbeat.py), under its own name
            "leases_held": pending.get(name, 0),
            "heartbeat_age_s": _age_s(now, beat.last_seen_ms),
            "admission_refused_for_s": _age_s(now, beat.admission_since_ms) if beat.admission else None,
        })
    rows.sort(key=lambda r: (not r["alive"], r["name"]))
    return rows


def _ledger(raw_state: dict[bytes, bytes], held: int) -> dict[str, int]:
    """Entries the counters say are unfinished vs entries the work streams hold; ``vanished`` > 0
    means entries were removed behind rollstream's back (XTRIM, XDEL, DEL of a stream)."""
    def count(field: str) -> int:
        return _int(raw_state.get(field.encode()))

    expected = (count(StateField.FED) + count(StateField.REQUEUED) - count(StateField.COMMITTED)
                - count(StateField.FILTERED) - count(StateField.DEAD))
    return {"expected": expected, "held": held, "vanished": max(0, expected - held)}


def _bias_section(state: dict[str, str]) -> dict[str, Any]:
    """The bias ledger (:mod:`rollstream.common.bias`) of the epochs kept: per dimension and
    bucket, the counts, the shares and whether it is under-trained; ``short``: those lines."""
    found = bias.ledger({k: _int(v) for k, v in state.items() if k.startswith(bias.PREFIX)})
    epochs: dict[str, Any] = {}
    short: list[str] = []
    for epoch in sorted(found):
        dimensions = found[epoch]
        total = bias.trained_total(dimensions)
        epochs[str(epoch)] = {
            name: {
                label: {**dataclasses.asdict(b), "late": b.late, "fed_share": round(b.fed_share, 4),
                        "trained_share": round(b.trained_share, 4), "short": b.short(total)}
                for label, b in sorted(buckets.items())
            }
            for name, buckets in dimensions.items()
        }
        short += bias.short_buckets(epoch, dimensions)
    return {"epochs": epochs, "short": short, "warn_ratio": bias.WARN_RATIO}


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


def _sources_section(config: PipelineConfig | None, state: dict[str, str]) -> list[dict[str, Any]]:
    """One row per named source: its weight and share of what was committed, its counters and cursor."""
    weights = config.weights if config is not None else {}
    names = list(weights) + sorted(
        {k.split(":", 1)[0] for k in state if ":" in k and not k.startswith("base:")} - weights.keys()
    )
    total_weight = sum(weights.values())
    committed = {name: _int(state.get(SourceField.of(name, "committed"))) for name in names}
    all_committed = sum(committed.values())
    rows = []
    for name in names:
        row: dict[str, Any] = {
            "name": name,
            "weight": weights.get(name, 0.0),
            "target_share": round(weights.get(name, 0.0) / total_weight, 4) if total_weight else None,
            "committed_share": round(committed[name] / all_committed, 4) if all_committed else None,
            "done": state.get(SourceField.of(name, "done")) == "1",
            "dataset": state.get(SourceField.of(name, "dataset")),
        }
        for kind in (*SourceField.COUNTS, "epoch", "position"):
            row[kind] = _int(state.get(SourceField.of(name, kind)))
        rows.append(row)
    return rows


async def snapshot(
    redis: Redis,
    keys: Keys,
    *,
    stuck_after: float = DEFAULT_STUCK_AFTER,
    events: int = 5,
    stall_after: float = DEFAULT_STALL_AFTER,
) -> dict[str, Any]:
    """Everything an operator needs about one namespace, with a health verdict."""
    if stuck_after <= 0 or stall_after <= 0:
        raise ConfigError(f"stuck_after and stall_after must be positive, got {stuck_after!r}, {stall_after!r}")
    now = now_ms()
    view = StreamView(redis, keys)
    raw_config = await view.config_hash()
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
    raw_state, held = await view.ledger()
    state = {_text(k): _text(v) for k, v in raw_state.items()}
    prompts = await _prompts_section(view, keys, lease_s, now)
    pending_by_producer = {c["name"]: c["pending"] for c in prompts["consumers"]}
    raw_beats = await view.heartbeats()
    fleet = fold(raw_beats, now, timeout_s)
    producers = _producer_rows(fleet, pending_by_producer, now)
    recent = await view.events(50)
    integer_prefixes = (StateField.FILTERED_PREFIX, bias.PREFIX, StateField.LATE_PREFIX)
    damaged = damaged_fields(keys.state, raw_state, StateField.INTEGERS, integer_prefixes)
    for name, value in raw_beats.items():
        if (what := Heartbeat.damage(value)) is not None:
            damaged.append(f"{keys.producers} field {_text(name)!r}: {what}")
    damaged += [e.damaged for e in recent if e.damaged]
    id_field = StateField.NAMESPACE_ID.encode()
    lost_state = state_mismatch(keys, raw_config.get(id_field), raw_state.get(id_field)) if raw_config else None
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
    reported = when(StateField.STALE_REPORTED_MS)
    last_take = trainer["last_take_ms"] or 0
    stale_recycling = {
        "recycled_stale": counters[StateField.RECYCLED_STALE],
        "active": bool(reported and reported > last_take and _int(state.get(StateField.STALE_STREAK))),
        "streak": _int(state.get(StateField.STALE_STREAK)),
        "since_age_s": _age_s(now, when(StateField.STALE_SINCE_MS)),
        "reported_age_s": _age_s(now, reported),
        "engine_version_oldest": _int(state.get(StateField.STALE_ENGINE_OLDEST)),
        "engine_version_newest": _int(state.get(StateField.STALE_ENGINE_NEWEST)),
        "trainer_version": _int(state.get(StateField.STALE_TRAINER_VERSION)),
        "max_staleness": config.max_staleness if config else None,
    }
    snap: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "namespace": keys.namespace,
        "generated_ms": now,
        "config": dataclasses.asdict(config) if config else None,
        "config_error": config_error,
        "prompts": prompts,
        "retry": await _retry_section(view, keys),
        "groups": await _groups_section(view, keys, now),
        "dead": {"length": await view.length(keys.dead)},
        "archive": {
            "length": await view.length(keys.archive),
            "bytes": _int(state.get(StateField.ARCHIVE_BYTES)),
            "bytes_budget": config.archive_bytes if config else 0,
            "recorded": _int(state.get(StateField.ARCHIVE_RECORDED)),
            "archived": _int(state.get(StateField.ARCHIVED)),
            "dropped": _int(state.get(StateField.ARCHIVE_DROPPED)),
            "cursor": state.get(StateField.ARCHIVE_CURSOR) or None,
            "archiver_seen_age_s": _age_s(now, when(StateField.ARCHIVE_SEEN_MS)),
        },
        "producers": producers,
        "producers_alive": sum(1 for p in producers if p["alive"]),
        "trainer": trainer,
        "counters": counters,
        "stale_recycling": stale_recycling,
        "bias": _bias_section(state),
        "lateness": {
            "late_groups": _int(state.get(StateField.LATE_GROUPS)),
            "by_cause": {k[len(StateField.LATE_PREFIX):]: _int(v) for k, v in sorted(state.items())
                         if k.startswith(StateField.LATE_PREFIX)},
        },
        "feeder": {
            "next_index": _int(state.get(StateField.FEED_NEXT_INDEX)),
            "epoch": _int(state.get(StateField.FEED_EPOCH)),
            "dataset": state.get(StateField.FEED_DATASET) or None,
        },
        "sources": _sources_section(config, {_text(k): _text(v) for k, v in (await view.sources_hash()).items()}),
        "events": errors,
        "damaged": damaged,
        "lost_state": lost_state,
        "missing_groups": [],
        "ledger": _ledger(raw_state, held) if raw_config and lost_state is None else None,
    }
    if raw_config:
        for stream, group in keys.consumer_groups:
            if await view.group_info(stream, group) is None:
                snap["missing_groups"].append({"stream": stream, "group": group, "length": await view.length(stream)})
    published = _int(state.get(StateField.PUBLISHED))
    snap["groups"]["bytes"] = _int(state.get(StateField.GROUP_BYTES))
    snap["groups"]["bytes_budget"] = config.max_backlog_bytes if config else 0
    snap["groups"]["mean_group_bytes"] = _int(state.get(StateField.PUBLISHED_BYTES)) // published if published else 0
    journal_bytes = _int(state.get(StateField.JOURNAL_BYTES))
    durable = bool(config and config.durable_episodes)
    snap["episodes"] = {
        "durable": durable,
        "journals": await EpisodeJournals(redis, keys, "inspect").count() if durable or journal_bytes else 0,
        "journal_bytes": journal_bytes,
        "journal_steps": _int(state.get(StateField.JOURNAL_STEPS)),
        "resume_diverged": _int(state.get(StateField.RESUME_DIVERGED)),
        "journals_swept": _int(state.get(StateField.JOURNALS_SWEPT)),
    }
    store = config.payload_store if config else ""
    payload = await PayloadLedger(redis, keys).held()
    snap["payload"] = {
        "store": redact_store_url(store) if store else None,
        "min_bytes": config.payload_min_bytes if config else 0,
        "objects": payload.objects,
        "bytes": payload.bytes,
        "intents": payload.intents,
        "to_free": payload.to_free,
        "orphans_swept": payload.swept,
        "freed": payload.freed,
        "read_failures": payload.read_failures,
        "last_failure": payload.last_failure or None,
    }
    snap["limits"] = [v.as_dict() for v in await NamespaceLimits(redis, keys).views()]
    terms = await view.admission_terms(config) if config is not None else None
    snap["admission"] = {
        "enabled": bool(config and config.admission_enabled),
        **(terms.as_dict() if terms is not None else {}),
        "last_admit_ms": when(StateField.LAST_ADMIT_MS),
        "last_admit_age_s": _age_s(now, when(StateField.LAST_ADMIT_MS)),
        "refusals": fleet.refusals,
        "stall_after_s": stall_after,
    }
    memory = await view.memory()
    if memory is not None:
        limit = memory["maxmemory"]
        memory["used_fraction"] = round(memory["used_memory"] / limit, 4) if limit else None
    snap["redis_memory"] = memory
    snap["health"] = assess(snap, stuck_after, now, terms=terms)
    return snap
