"""The health rules: one rule set judging a namespace snapshot (plain data, no I/O).

``rollstream inspect`` (and ``ns show``) exit with this verdict. The rules read only the snapshot
dict, so any caller holding the same facts (e.g. ``take()``'s diagnostics) can apply them too.
"""

from __future__ import annotations

from typing import Any

from rollstream.common.admission import WRITE_ROOM, AdmissionTerms, admission_stall, memory_deadlock
from rollstream.common.events import FATAL, unrecovered

DEFAULT_STUCK_AFTER = 300.0
"""Groups waiting (or taken) with no take or commit for this long make a namespace unhealthy."""
LEASE_WARNING_FRACTION = 0.8
"""A lease idle for more than this fraction of ``lease_seconds`` is about to be taken over."""
MEMORY_WARNING_FRACTION = 0.9
"""Redis' ``used_memory`` above this fraction of ``maxmemory`` is a warning; at it, a problem."""


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _memory(memory: dict[str, Any] | None, problems: list[str], warnings: list[str]) -> None:
    """``maxmemory`` reached: Redis refuses writes (the feeder, heartbeats, events, version)."""
    if not memory or not memory.get("maxmemory"):
        return
    used, limit, policy = memory["used_memory"], memory["maxmemory"], memory.get("maxmemory_policy") or "?"
    if used >= limit - WRITE_ROOM:  # below by less than a write's arguments: refused all the same
        level = ">=" if used >= limit else f"less than {WRITE_ROOM // 1024} KiB below"
        problems.append(
            f"Redis is out of memory: used_memory {_mib(used)} {level} maxmemory {_mib(limit)} (maxmemory-policy "
            f"{policy}): it refuses writes, so the feeder, heartbeats (producers may show as dead) and events "
            "wait, backing off; the trainer's commits free memory. Raise maxmemory (CONFIG SET maxmemory), or "
            "lower max_backlog and the feeder --window (docs/operations.md)"
        )
    elif used >= MEMORY_WARNING_FRACTION * limit:
        warnings.append(
            f"Redis memory at {used / limit:.0%} of maxmemory ({_mib(used)} of {_mib(limit)}, policy {policy}): "
            "at maxmemory it refuses writes"
        )


def assess(
    snap: dict[str, Any], stuck_after: float, now: int, *, terms: AdmissionTerms | None = None
) -> dict[str, Any]:
    """The verdict on one snapshot: problems make it unhealthy, warnings do not. ``terms``: the
    admission rule's terms, named in an "admission stalled" problem."""
    problems: list[str] = []
    warnings: list[str] = []
    if snap.get("config_error"):
        problems.append(f"the config hash is damaged: {snap['config_error']}")
    elif snap["config"] is None:
        problems.append(f"namespace {snap['namespace']!r} is not initialised (no config hash)")
    problems += [f"damaged value: {line}" for line in snap.get("damaged", [])]
    _memory(snap.get("redis_memory"), problems, warnings)
    for missing in snap.get("missing_groups", []):
        problems.append(
            f"consumer group {missing['group']!r} of {missing['stream']} is missing (XGROUP DESTROY?): its "
            f"{missing['length']} entries cannot be delivered. Restart the trainer and producers, or run "
            "`rollstream init` with the same config: it re-creates the group at id 0 (finished entries are deleted, "
            "so nothing finished is delivered again)"
        )
    archive = snap.get("archive") or {}
    if archive.get("dropped"):
        warnings.append(
            f"archive_dropped {archive['dropped']}: fate records were dropped unarchived at the archive_bytes "
            "budget (no `rollstream archive` running, or it falls behind)"
        )
    payload = snap.get("payload") or {}
    if payload.get("read_failures"):
        warnings.append(
            f"payload_read_failures {payload['read_failures']}: groups were recycled because an object could not be "
            f"read from the payload store {payload.get('store')} (last: {payload.get('last_failure')}); check the "
            "store (its processes, the directory every producer and trainer mounts)"
        )
    if payload.get("to_free", 0) > 10_000:
        warnings.append(
            f"payload store {payload.get('store')}: {payload['to_free']} released objects are not deleted yet "
            "(the store refuses or fails the deletes: they take store room until it confirms)"
        )
    for line in (snap.get("bias") or {}).get("short", []):
        warnings.append(f"the trainer does not see the dataset: {line}")
    ledger = snap.get("ledger")
    if ledger and ledger["vanished"]:
        problems.append(
            f"{ledger['vanished']} prompts / groups vanished from the streams: the counters (fed + requeued - "
            f"committed - filtered - dead-lettered) say {ledger['expected']} are unfinished, the streams hold "
            f"{ledger['held']} (an XTRIM, XDEL or DEL of a stream, or Redis lost data); they cannot be recovered"
        )
    if snap.get("lost_state"):
        problems.append(f"{snap['lost_state']}; `rollstream feed` refuses to start again")
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
    fatal = [e for e in snap["events"] if e["kind"] == FATAL and unrecovered(e["ts_ms"], trainer["last_publish_ms"])]
    if fatal:
        newest = fatal[0]
        problems.append(
            f"fatal error in {newest['source']} {newest['age_s']:.0f} s ago, no group published since: "
            f"{newest['message']}"
        )
    stale = snap.get("stale_recycling")
    if stale and stale["active"]:
        oldest, newest = stale["engine_version_oldest"], stale["engine_version_newest"]
        versions = str(oldest) if oldest == newest else f"{oldest}..{newest}"
        problems.append(
            f"groups are being recycled as stale: {stale['streak']} in a row (since {stale['since_age_s']:.0f} s ago), "
            f"no take() returned since; the engines generated them at weight version {versions} while the trainer "
            f"is at {stale['trainer_version']} (max_staleness {stale['max_staleness']}): do the new weights reach the "
            "engines? (the trainer's weight sync; engines that report no version stand in the version at admission)"
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
    retry = snap.get("retry") or {"waiting": 0, "in_flight": 0}
    config = snap["config"]
    deadlock = memory_deadlock(
        snap.get("redis_memory"),
        prompts_waiting=prompts["waiting"] + retry["waiting"],
        in_flight_prompts=prompts["in_flight"] + retry["in_flight"],
        groups_held=groups["backlog"] + groups["taken_uncommitted"],
        batch_size=config["batch_size"] if config else 1,
    )
    if deadlock is not None:
        problems.append(deadlock)
    admission = snap.get("admission")
    if admission is not None and alive:
        stall = admission_stall(
            producers_alive=len(alive),
            prompts_waiting=prompts["waiting"] + retry["waiting"],
            in_flight_prompts=prompts["in_flight"] + retry["in_flight"],
            ready=groups["backlog"],
            last_admit_age_s=admission["last_admit_age_s"],
            refusals=admission["refusals"],
            terms=terms,
            stall_after=admission["stall_after_s"],
        )
        if stall is not None:
            problems.append(stall)
    if prompts["leases_expiring"]:
        warnings.append(
            f"{prompts['leases_expiring']} prompt lease(s) idle past {LEASE_WARNING_FRACTION:.0%} of "
            f"{prompts['lease_seconds']:.0f} s: their producer may be gone"
        )
    for p in alive:
        if p.get("long_requests"):
            warnings.append(
                f"{p['name']}: {p['long_requests']} sample(s) with an engine request in flight for over "
                f"{p['long_request_s']:.0f} s (oldest {p['oldest_request_s']:.0f} s): a stuck engine or a very "
                "long generation"
            )
        if p.get("loop_stalls"):
            warnings.append(
                f"{p['name']}: event loop stalled {p['loop_stalls']} time(s), {p['loop_stall_s']:.1f} s in all; "
                f"longest {p['loop_stall_where']}: user code blocking the loop (a synchronous tool or reward) "
                "freezes every prompt of the producer; run it with asyncio.to_thread (docs/rollouts.md)"
            )
        for engine in p.get("engine_fleet") or ():
            state = engine.get("state")
            if state in ("joining", "ejected", "wedged", "behind", "draining"):
                warnings.append(f"{p['name']}: engine {engine.get('url')} {state}: {engine.get('reason', '')}")
    if snap["dead"]["length"]:
        warnings.append(f"{snap['dead']['length']} dead-letter entries (see `rollstream dead list`)")
    if trainer["paused"]:
        warnings.append("paused: producers admit nothing until `rollstream resume`")
    return {"ok": not problems, "problems": problems, "warnings": warnings}
