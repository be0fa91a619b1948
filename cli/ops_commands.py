"""Operator commands: ``rollstream dead list|requeue|drop`` and ``rollstream ns list|show|delete``.

Everything destructive asks for confirmation (``--yes`` skips it) and touches only the named
namespace's keys: namespaces are found with SCAN, never KEYS, and never FLUSHDB/FLUSHALL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from redis.asyncio import Redis
from rollstream.common.connection import connect
from rollstream.common.errors import ConfigError
from rollstream.common.imports import require_extra
from rollstream.common.keys import Keys
from rollstream.ops import (
    DEFAULT_STUCK_AFTER,
    DeadEntry,
    dead_entries,
    delete_namespace,
    delete_payload_objects,
    drop_dead,
    existing_keys,
    list_namespaces,
    requeue_dead,
    snapshot,
)

from .inspect import render
from .shared_options import add_redis_url

if TYPE_CHECKING:
    pass

T = TypeVar("T")


def register(sub: Any, base: list[argparse.ArgumentParser], with_redis: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("dead", parents=with_redis, help="list, requeue or drop dead-letter entries")
    p.add_argument("action", choices=["list", "requeue", "drop"])
    p.add_argument("--id", action="append", default=[], metavar="ID", help="a dead entry id (repeatable)")
    p.add_argument("--all", action="store_true", help="every dead entry (requeue/drop)")
    p.add_argument("--count", type=int, default=None, help="at most this many, oldest first")
    p.add_argument("--json", action="store_true", help="list: one JSON object per entry")
    p.add_argument("--yes", action="store_true", help="drop without asking")
    p.set_defaults(func=cmd_dead)

    redis_only = argparse.ArgumentParser(add_help=False)
    add_redis_url(redis_only)
    redis_only.add_argument("--ns", default=None, metavar="NAME", help="namespace (show, delete)")
    p = sub.add_parser("ns", parents=[*base, redis_only], help="list, show or delete namespaces")
    p.add_argument("action", choices=["list", "show", "delete"])
    p.add_argument("--yes", action="store_true", help="delete without asking")
    p.add_argument("--stuck-after", type=float, default=DEFAULT_STUCK_AFTER,
                   help="seconds groups may wait with no take or commit before the pipeline is unhealthy, as for "
                        "inspect (default: %(default)g)")
    p.set_defaults(func=cmd_ns)


def _out(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _confirm(question: str, expected: str = "yes") -> bool:
    """Ask on the terminal; a closed stdin (scripts) never confirms."""
    sys.stdout.write(f"{question} [type {expected!r} to confirm]: ")
    sys.stdout.flush()
    answer = sys.stdin.readline()
    return answer.strip() == expected


def _run(url: str, work: Callable[[Redis], Awaitable[T]]) -> T:
    async def main() -> T:
        redis = connect(url, name="rollstream-ops")
        try:
            return await work(redis)
        finally:
            await redis.aclose()

    return asyncio.run(main())


# -- dead ------------------------------------------------------------------------------------


def _when(ts_ms: int | None) -> str:
    return "-" if not ts_ms else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts_ms / 1000))


def _list_line(entry: DeadEntry) -> str:
    requeue = "yes" if entry.prompt is not None else "NO (undecodable)"
    return (
        f"{entry.id}  source={entry.source or '-'}  index={entry.index if entry.index is not None else '-'}  "
        f"attempt={entry.attempt if entry.attempt is not None else '-'}  at={_when(entry.ts_ms)}  "
        f"requeueable={requeue}\n    reason: {entry.reason}"
    )


def cmd_dead(args: argparse.Namespace) -> int:
    keys = Keys(args.ns)
    if args.count is not None and args.count < 1:
        raise ConfigError("--count must be positive")
    if args.action != "list" and not args.id and not args.all:
        raise ConfigError(f"dead {args.action} needs --id ID (repeatable) or --all")
    if args.id and args.all:
        raise ConfigError("give either --id or --all, not both")

    async def select(redis: Redis) -> list[DeadEntry]:
        return await dead_entries(redis, keys, ids=args.id or None, count=args.count)

    entries = _run(args.redis, select)
    if args.id:
        missing = set(args.id) - {e.id for e in entries}
        for entry_id in sorted(missing):
            _out(f"{entry_id}: no such dead entry")
    if args.action == "list":
        for entry in entries:
            if args.json:
                _out(json.dumps({
                    "id": entry.id, "source": entry.source, "reason": entry.reason, "index": entry.index,
                    "attempt": entry.attempt, "ts_ms": entry.ts_ms, "requeueable": entry.prompt is not None,
                }))
            else:
                _out(_list_line(entry))
        if not args.json:
            _out(f"{len(entries)} dead entries")
        return 0
    if args.action == "requeue":
        return _requeue(args, keys, entries)
    if not entries:
        _out("nothing to drop")
        return 0
    if not args.yes and not _confirm(f"drop {len(entries)} dead entries of namespace {args.ns!r} for good?"):
        _out("not confirmed; nothing dropped")
        return 1
    dropped = _run(args.redis, lambda r: drop_dead(r, keys, [e.id for e in entries]))
    _out(f"dropped {dropped} dead entries")
    return 0


def _requeue(args: argparse.Namespace, keys: Keys, entries: list[DeadEntry]) -> int:
    async def work(redis: Redis) -> tuple[int, int]:
        done = refused = 0
        for entry in entries:
            if entry.prompt is None:
                refused += 1
                _out(f"{entry.id}: cannot requeue, the entry is undecodable ({entry.error}); `dead drop` it")
                continue
            new_id = await requeue_dead(redis, keys, entry)
            if new_id is None:
                _out(f"{entry.id}: already gone (requeued or dropped meanwhile)")
            else:
                done += 1
                _out(f"{entry.id}: prompt {entry.prompt.index} requeued as {new_id} (attempt reset to 0)")
        return done, refused

    done, refused = _run(args.redis, work)
    _out(f"requeued {done} of {len(entries)} dead entries")
    return 1 if refused else 0


# -- ns --------------------------------------------------------------------------------------


def cmd_ns(args: argparse.Namespace) -> int:
    if args.action == "list":
        names = _run(args.redis, list_namespaces)
        for name in names:
            _out(name)
        return 0
    if not args.ns:
        raise ConfigError(f"ns {args.action} needs --ns NAME")
    keys = Keys(args.ns)
    if args.action == "show":
        require_extra("rich", "ops", "ns show")
        from rich.console import Console

        snap = _run(args.redis, lambda r: snapshot(r, keys, stuck_after=args.stuck_after))
        console = Console()
        if not console.is_terminal:
            console = Console(width=200, no_color=True, highlight=False)
        console.print(render(snap, plain=not console.is_terminal))
        return 0 if snap["health"]["ok"] else 1

    existing = _run(args.redis, lambda r: existing_keys(r, keys))
    if not existing:
        _out(f"namespace {args.ns!r} has no keys; nothing to delete")
        return 0
    if not args.yes:
        _out(f"this deletes {len(existing)} keys of namespace {args.ns!r}: {', '.join(existing)}")
        if not _confirm("type the namespace name to confirm", expected=args.ns):
            _out("not confirmed; nothing deleted")
            return 1
    objects = _run(args.redis, lambda r: delete_payload_objects(r, keys))
    if objects:
        _out(f"deleted {objects} payload store objects of namespace {args.ns!r}")
    deleted = _run(args.redis, lambda r: delete_namespace(r, keys))
    _out(f"deleted {deleted} keys of namespace {args.ns!r}")
    return 0
