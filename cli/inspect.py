"""``rollstream inspect``: is the pipeline healthy, and if not, where is it stuck?

One screen (or one JSON document) built from :func:`rollstream.ops.snapshot`. The exit
code is the verdict (0 healthy, 1 unhealthy), so ``inspect`` doubles as a liveness probe.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from rollstream.common.connection import connect
from rollstream.common.errors import ConfigError
from rollstream.common.heartbeat import COUNTER, TEXT, TIME, Stat, stats
from rollstream.common.imports import require_extra
from rollstream.common.keys import Keys
from rollstream.ops import DEFAULT_STALL_AFTER, DEFAULT_STUCK_AFTER, snapshot

if TYPE_CHECKING:
    from rich.console import RenderableType
    from rich.table import Table



def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _bytes_line(g: dict[str, Any]) -> str:
    """The group stream's bytes, against the byte budget when there is one."""
    held = _size(g.get("bytes", 0))
    budget = g.get("bytes_budget", 0)
    mean = _size(g.get("mean_group_bytes", 0))
    return f"bytes {held}" + (f" of {_size(budget)} budget" if budget else "") + f", mean group {mean}"

def register(sub: Any, base: list[argparse.ArgumentParser], with_redis: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("inspect", parents=with_redis, help="show a namespace's health at a glance")
    p.add_argument("--json", action="store_true", help="print one JSON document (schema in docs/operations.md)")
    p.add_argument(
        "--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
        help="refresh every SECONDS (default 2) until Ctrl-C",
    )
    p.add_argument(
        "--stuck-after", type=float, default=DEFAULT_STUCK_AFTER, metavar="SECONDS",
        help="seconds groups may wait with no take or commit before the pipeline is unhealthy (default: %(default)g)",
    )
    p.add_argument(
        "--stall-after", type=float, default=DEFAULT_STALL_AFTER, metavar="SECONDS",
        help="seconds with prompts queued, nothing ready and nothing admitted before it is an admission stall "
        "(default: %(default)g)",
    )
    p.add_argument("--events", type=int, default=5, help="error events to show (default 5)")
    p.set_defaults(func=cmd_inspect)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 120:
        return f"{seconds:.1f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def _secs(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}s"


def _stat_cell(s: Stat, value: Any, now_ms: int) -> str:
    if s.kind == TIME:
        return _age((now_ms - value) / 1000 if value else None)
    if isinstance(value, list):
        return ", ".join(str(v.get("url", v)) if isinstance(v, dict) else str(v) for v in value)[:60]
    if s.kind == TEXT:
        return str(value).splitlines()[0][:60] if value else ""
    return f"{value:g}" if isinstance(value, float) else str(value)


def _stats_table(snap: dict[str, Any], plain: bool) -> Table | None:
    """Every declared producer stat (:func:`rollstream.common.heartbeat.stats`) that a live
    producer reports as other than zero or empty: each producer's value, and a counter's total."""
    live = [row for row in snap["producers"] if row["alive"]]
    table = _table("producer stats (live producers, non-zero)", plain, "stat", "total", "by producer", "meaning")
    for s in stats():
        values = [(row["name"], row.get(s.name)) for row in live]
        if not any(v for _, v in values):
            continue
        total = _stat_cell(s, sum(v for _, v in values), 0) if s.kind == COUNTER else "-"
        by = " ".join(f"{name}={_stat_cell(s, v, snap['generated_ms'])}" for name, v in values)
        unit = f" ({s.unit})" if s.unit and s.kind != TIME else ""
        table.add_row(s.name + unit, total, by, s.meaning[:80])
    return table if table.row_count else None


def _table(title: str, plain: bool, *columns: str) -> Table:
    from rich import box
    from rich.table import Table

    table = Table(
        title=title, title_justify="left", box=None if plain else box.SIMPLE_HEAD,
        show_edge=False, pad_edge=False, title_style="bold",
    )
    for column in columns:
        table.add_column(column)
    return table


def render(snap: dict[str, Any], *, plain: bool) -> RenderableType:
    """The inspect screen; ``plain`` drops borders for logs and pipes."""
    from rich.console import Group
    from rich.text import Text

    health = snap["health"]
    parts: list[RenderableType] = []
    verdict = Text(f"namespace {snap['namespace']}: ", style="bold")
    verdict.append("HEALTHY" if health["ok"] else "UNHEALTHY", style="bold green" if health["ok"] else "bold red")
    verdict.append(time.strftime("  (%Y-%m-%d %H:%M:%S)", time.localtime(snap["generated_ms"] / 1000)))
    parts.append(verdict)
    for problem in health["problems"]:
        parts.append(Text(f"  PROBLEM: {problem}", style="red"))
    for warning in health["warnings"]:
        parts.append(Text(f"  warning: {warning}", style="yellow"))

    p, g, t = snap["prompts"], snap["groups"], snap["trainer"]
    streams = _table("streams", plain, "stream", "length", "detail")
    streams.add_row(
        "prompts", str(p["queued"]),
        f"waiting {p['waiting']}, in flight {p['in_flight']}, "
        f"oldest in flight added {_age(p['oldest_pending_age_s'])}, "
        f"max lease idle {_secs(p['max_pending_idle_s'])} of {p['lease_seconds']:.0f}s, "
        f"leases expiring {p['leases_expiring']}",
    )
    r = snap["retry"]
    streams.add_row(
        "retry", str(r["queued"]), f"waiting {r['waiting']}, in flight {r['in_flight']} (admitted before prompts)"
    )
    taken = ", ".join(f"{c['name']}={c['pending']}" for c in g["consumers"] if c["pending"]) or "none"
    streams.add_row(
        "groups", str(g["length"]),
        f"backlog {g['backlog']} (oldest waiting {_secs(g['oldest_waiting_age_s'])}), "
        f"taken uncommitted {g['taken_uncommitted']} ({taken}); {_bytes_line(g)}",
    )
    streams.add_row("dead", str(snap["dead"]["length"]), "dead-letter entries")
    a = snap.get("archive") or {}
    if a.get("bytes_budget") or a.get("length"):
        streams.add_row(
            "archive", str(a["length"]),
            f"fates unarchived, bytes {_size(a['bytes'])} of {_size(a['bytes_budget'])} budget; recorded "
            f"{a['recorded']}, archived {a['archived']}, archive_dropped {a['dropped']}; archiver last seen "
            f"{_age(a['archiver_seen_age_s'])}",
        )
    pl = snap.get("payload") or {}
    if pl.get("store") or pl.get("objects"):
        streams.add_row(
            "payload", str(pl["objects"]),
            f"objects held in {pl['store']}, {_size(pl['bytes'])}; being put {pl['intents']}, to free "
            f"{pl['to_free']}; orphans swept {pl['orphans_swept']}, freed {pl['freed']}, read failures "
            f"{pl['read_failures']}" + (f" (last: {pl['last_failure']})" if pl.get("last_failure") else ""),
        )
    parts.append(streams)
    if snap.get("limits"):
        limits = _table("namespace limits and rates", plain, "name", "kind", "size", "holders", "waiters",
                        "granted", "mean wait", "peak holders")
        for row in snap["limits"]:
            limits.add_row(row["name"], row["kind"], str(row["size"]), str(row["holders"]), str(row["waiters"]),
                           str(row["acquired"]), _secs(row["mean_wait_s"]), str(row["peak"]))
        parts.append(limits)
    ep = snap.get("episodes") or {}
    if ep.get("durable") or ep.get("journals"):
        parts.append(Text(
            f"durable episodes: {ep['journals']} journals, {_size(ep['journal_bytes'])}; "
            f"steps journaled {ep['journal_steps']}, resumes diverged {ep['resume_diverged']}, "
            f"orphan journals swept {ep.get('journals_swept', 0)}"
        ))

    producers = _table(
        f"producers ({snap['producers_alive']} alive of {len(snap['producers'])})", plain,
        "name", "host", "pid", "status", "in flight", "engine reqs", "leases", "groups/min", "published",
        "loop stalls", "versions from", "heartbeat",
    )
    for row in snap["producers"]:
        status = row["status"]
        style = "green" if row["alive"] else ("red" if status in ("dead", "failed", "unreadable") else "dim")
        shown = status.upper() if status in ("dead", "failed") else status
        conc = row.get("concurrency")
        producers.add_row(
            row["name"], str(row.get("host") or "-"), str(row.get("pid") or "-"), Text(shown, style=style),
            f"{row.get('in_flight_samples', 0)}/{conc if conc is not None else '?'}",
            str(row.get("engine_requests", 0)), str(row.get("leases_held", 0)),
            str(row.get("groups_last_minute", 0)), str(row.get("published", 0)),
            f"{row['loop_stalls']} (max {row['loop_stall_longest_s']:.1f}s)" if row.get("loop_stalls") else "0",
            str(row.get("weight_versions_from") or "-"), _age(row.get("heartbeat_age_s")),
        )
    parts.append(producers)
    if (stat_rows := _stats_table(snap, plain)) is not None:
        parts.append(stat_rows)

    engines = _table(
        "engines (per producer)", plain, "producer", "engine", "state", "in flight", "limit", "kv", "version",
        "errors", "tokens", "hit rate", "why",
    )
    shown_engines = 0
    for row in snap["producers"]:
        if not row["alive"]:
            continue
        for e in row.get("engine_fleet") or ():
            state = str(e.get("state", "?"))
            waiting = ("suspect", "draining", "joining")
            style = "green" if state == "healthy" else "yellow" if state in waiting else "red"
            rate = e.get("prefix_hit_rate")
            engines.add_row(
                row["name"], str(e.get("url", "?")), Text(state, style=style), str(e.get("in_flight", 0)),
                str(e.get("limit", "-")), "-" if e.get("kv_usage") is None else f"{e['kv_usage']:.0%}",
                str(e.get("version", "-")), str(e.get("errors", 0)), str(e.get("tokens", 0)),
                "-" if rate is None else f"{rate:.0%}", str(e.get("reason", ""))[:80],
            )
            shown_engines += 1
    if shown_engines:
        parts.append(engines)

    a = snap["admission"]
    if a.get("capacity") is not None:
        admission = _table(
            "admission" + ("" if a["enabled"] else " (staleness rule off)"), plain,
            "outstanding", "capacity", "c", "G", "K", "S", "B", "last admit", "refusals",
        )
        refusals = ", ".join(f"{k} {v:.0f}s" for k, v in sorted(a["refusals"].items())) or "none"
        admission.add_row(
            str(a["outstanding"]), str(a["capacity"]), str(a["c"]), str(a["groups_per_version"]),
            str(a["steps_per_version"]), str(a["max_staleness"]), str(a["batch_size"]),
            _age(a["last_admit_age_s"]), refusals,
        )
        parts.append(admission)

    trainer = _table("trainer", plain, "weight version", "paused", "last take", "last commit", "last publish")
    trainer.add_row(
        str(t["weight_version"]), "yes" if t["paused"] else "no",
        _age(t["last_take_age_s"]), _age(t["last_commit_age_s"]), _age(t["last_publish_age_s"]),
    )
    parts.append(trainer)

    if snap.get("sources"):
        sources = _table(
            "sources (the mix)", plain, "source", "weight", "target share", "committed share", "fed", "published",
            "committed", "recycled", "lost", "epoch", "position", "done",
        )
        for row in snap["sources"]:
            share = "-" if row["committed_share"] is None else f"{row['committed_share']:.3f}"
            target = "-" if row["target_share"] is None else f"{row['target_share']:.3f}"
            sources.add_row(
                row["name"], f"{row['weight']:g}", target, share, str(row["fed"]), str(row["published"]),
                str(row["committed"]), str(row["recycled"]), str(row["lost"]), str(row["epoch"]),
                str(row["position"]), "yes" if row["done"] else "no",
            )
        parts.append(sources)

    counters = _table("counters", plain, "counter", "value", "counter", "value", "counter", "value")
    items = list(snap["counters"].items())
    for i in range(0, len(items), 3):
        cells: list[str] = []
        for name, value in items[i : i + 3]:
            cells.extend([name, f"{value:g}" if isinstance(value, float) else str(value)])
        counters.add_row(*cells)
    parts.append(counters)

    late = snap.get("lateness") or {}
    if late.get("late_groups"):
        causes = ", ".join(f"{k} {v}" for k, v in late["by_cause"].items())
        parts.append(Text(
            f"late: {late['late_groups']} groups trained after admitted step + generation steps + 1 ({causes})",
            style="yellow",
        ))
    epochs = (snap.get("bias") or {}).get("epochs") or {}
    if epochs:
        newest = max(epochs, key=int)
        shares = _table(
            f"trained vs fed (epoch {newest}; flagged below {snap['bias']['warn_ratio']:g}x the fed share)", plain,
            "dimension", "bucket", "fed", "trained", "dead", "filtered", "late", "recycles", "fed share",
            "trained share",
        )
        for name, buckets in epochs[newest].items():
            for label, b in buckets.items():
                style = "yellow" if b["short"] else ""
                shares.add_row(
                    name, label, str(b["fed"]), str(b["trained"]), str(b["dead"]), str(b["filtered"]),
                    str(b["late"]), str(b["recycled"]), f"{b['fed_share']:.2f}",
                    Text(f"{b['trained_share']:.2f}", style=style),
                )
        parts.append(shares)

    if snap["events"]:
        parts.append(Text("recent errors", style="bold"))
        for event in snap["events"]:
            parts.append(
                Text(f"  [{event['kind']}] {event['source']} {_age(event['age_s'])}: {event['message']}",
                     style="red" if event["kind"] == "fatal" else "yellow")
            )
            for line in event["traceback_head"]:
                parts.append(Text(f"      {line}", style="dim"))
            if event["exception"] and event["exception"] not in event["traceback_head"]:
                parts.append(Text(f"      ... {event['exception']}", style="dim"))

    config = snap["config"]
    if config is not None:
        text = ", ".join(f"{k}={v}" for k, v in config.items())
        parts.append(Text(f"config: {text}", style="dim"))
    elif snap.get("config_error"):
        parts.append(Text(f"config: unreadable: {snap['config_error']}", style="red"))
    return Group(*parts)


async def _snap(args: argparse.Namespace, redis: Any, keys: Keys) -> dict[str, Any]:
    return await snapshot(
        redis, keys, stuck_after=args.stuck_after, events=args.events, stall_after=args.stall_after
    )


async def _run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    keys = Keys(args.ns)
    redis = connect(args.redis, name="rollstream-inspect")
    try:
        snap = await _snap(args, redis, keys)
        if args.json and args.watch is None:
            sys.stdout.write(json.dumps(snap, indent=2, sort_keys=True) + "\n")
            return 0 if snap["health"]["ok"] else 1
        console = Console()
        plain = not console.is_terminal
        if plain:  # logs and pipes: no wrapping at an imaginary 80 columns
            console = Console(width=200, no_color=True, highlight=False)
        if args.watch is None:
            console.print(render(snap, plain=plain))
            return 0 if snap["health"]["ok"] else 1
        if args.json or plain:
            while True:
                if args.json:
                    sys.stdout.write(json.dumps(snap, sort_keys=True) + "\n")
                else:
                    console.print(render(snap, plain=True))
                    console.print()
                sys.stdout.flush()
                await asyncio.sleep(args.watch)
                snap = await _snap(args, redis, keys)
        with Live(render(snap, plain=False), console=console, auto_refresh=False, screen=False) as live:
            while True:
                await asyncio.sleep(args.watch)
                snap = await _snap(args, redis, keys)
                live.update(render(snap, plain=False), refresh=True)
    finally:
        await redis.aclose()


def cmd_inspect(args: argparse.Namespace) -> int:
    require_extra("rich", "ops", "the inspect screen")
    if args.stuck_after <= 0 or args.stall_after <= 0:
        raise ConfigError("--stuck-after and --stall-after must be positive")
    if args.watch is not None and args.watch <= 0:
        raise ConfigError("--watch interval must be positive")
    try:
        return asyncio.run(_run(args))
    except KeyboardInterrupt:
        return 130
