"""The scale benchmark's Redis-side accounting (``bench.scale``): which command is whose (the
slowlog attributes EVALSHA calls to their script by sha, every command to ADMIT / PUBLISH /
heartbeat / renew / reclaim / take / commit / ...), and the meter connection that reads
``INFO commandstats``, memory and the Redis process' CPU without being counted itself."""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from typing import Any

import psutil
from rollstream.common import lua
from rollstream.common.connection import connect

from bench.worker import ADMIT_BEFORE

# -- Redis-side accounting ------------------------------------------------------------------

_SCRIPTS = {hashlib.sha1(s.source.encode()).hexdigest().encode(): s.name for s in (*lua.SCRIPTS, ADMIT_BEFORE)}
_SCRIPT_KIND = {"PUBLISH": "publish", "ADMIT": "admit", "RENEW": "renew", "ACK_DELETE": "commit",
                "SET_VERSION": "version", "MOVE": "move", "FEED": "feed", "LEASE": "trainer lease",
                "RELEASE": "trainer lease", "REQUEUE": "requeue", "RECLAIM_TURN": "reclaim"}
KINDS = ("admit", "publish", "heartbeat", "renew", "reclaim", "wait for prompts", "take", "commit", "version",
         "trainer lease", "other")
METER = "rsscale-meter"


def classify(args: list[bytes], client: bytes) -> str | None:
    """The kind of one logged command (None: the meter's own, or a command run inside a script)."""
    name = client.decode(errors="replace")
    if name == METER:
        return None
    cmd = args[0].upper() if args else b""
    key = args[1] if len(args) > 1 else b""
    if cmd == b"EVALSHA":
        return _SCRIPT_KIND.get(_SCRIPTS.get(key, ""), "other")
    trainer = name.startswith("rollstream-consumer")
    if cmd == b"HSET" and key.endswith(b":producers"):
        return "heartbeat"
    if cmd == b"HINCRBY" and len(args) > 2:
        return {b"admission_blocked_ms": "heartbeat", b"reclaimed": "reclaim"}.get(args[2], "other")
    if cmd == b"HSET" and len(args) > 2 and args[2] == b"reclaim_due_ms":
        return "reclaim"  # the producer that found idle prompts tells the others
    if cmd in (b"XAUTOCLAIM", b"XCLAIM") or (cmd == b"XPENDING" and b"IDLE" in (a.upper() for a in args)):
        return "reclaim"
    if cmd == b"HGET" and len(args) > 2 and args[2] == b"paused":
        return "reclaim"  # the reclaim loop's check before it looks for idle prompts
    if cmd == b"XREAD":
        return "wait for prompts"
    if trainer:
        return "take"  # XREADGROUP, and take()'s statistics (XLEN, XPENDING, HGETALL producers, ...)
    return "other"


def _parse_info(raw: Any) -> dict[str, Any]:
    """INFO as a dict (redis-py parses it already; raw text is parsed here)."""
    out: dict[str, Any] = {}
    if isinstance(raw, dict):
        for k, v in raw.items():
            if k.startswith("cmdstat_"):
                out[k[8:]] = {"calls": int(v["calls"]), "usec": int(v["usec"])}
            else:
                out[k] = v
        return out
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    for line in text.splitlines():
        if ":" not in line or line.startswith("#"):
            continue
        k, _, v = line.partition(":")
        if k.startswith("cmdstat_"):
            fields = dict(part.split("=", 1) for part in v.split(","))
            out[k[8:]] = {"calls": int(fields["calls"]), "usec": int(fields["usec"])}
        else:
            out[k] = v
    return out


class Meter:
    """The driver's own client (named, so its commands are left out of the accounting)."""

    def __init__(self, url: str) -> None:
        self.redis = connect(url, name=METER)

    async def info(self, section: str) -> dict[str, Any]:
        return _parse_info(await self.redis.execute_command("INFO", section))

    async def mark(self) -> dict[str, Any]:
        stats = await self.info("commandstats")
        mem = await self.info("memory")
        clients = await self.info("clients")
        cpu = await self.info("cpu")  # getrusage with microseconds (psutil counts 10 ms ticks)
        host = psutil.cpu_times()
        return {
            "t": time.monotonic(), "cmd": stats, "used_memory": int(mem["used_memory"]),
            "clients": int(clients["connected_clients"]),
            "redis_cpu": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
            "host_idle": host.idle, "host_total": sum(host),
        }

    async def slowlog_on(self, max_len: int) -> None:
        await self.redis.config_set("slowlog-max-len", max_len)
        await self.redis.execute_command("SLOWLOG", "RESET")
        await self.redis.config_set("slowlog-log-slower-than", 0)

    async def slowlog_off(self) -> list[Any]:
        await self.redis.config_set("slowlog-log-slower-than", 10_000)
        entries = list(await self.redis.execute_command("SLOWLOG", "GET", 10**7))
        await self.redis.execute_command("SLOWLOG", "RESET")
        await self.redis.config_set("slowlog-max-len", 128)
        return entries


def command_delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, dict[str, int]]:
    out = {}
    for name, now in b["cmd"].items():
        before = a["cmd"].get(name, {"calls": 0, "usec": 0})
        calls, usec = now["calls"] - before["calls"], now["usec"] - before["usec"]
        if calls and name not in ("info", "slowlog", "config"):
            out[name] = {"calls": calls, "usec": usec}
    return out


def slowlog_breakdown(entries: list[Any]) -> tuple[dict[str, dict[str, float]], bool]:
    """Per kind: calls and microseconds, from the slowlog window; and whether it is complete
    (no entry dropped: the ids are consecutive)."""
    kinds: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0, "usec": 0})
    ids = [int(e[0]) for e in entries]
    complete = not ids or max(ids) - min(ids) + 1 == len(ids)
    for entry in entries:
        _, _, duration, args, addr = entry[:5]
        client = entry[5] if len(entry) > 5 else b""
        if addr == b"?:0":  # a command inside a script: counted in its EVALSHA
            continue
        kind = classify(list(args), client)
        if kind is None:
            continue
        kinds[kind]["calls"] += 1
        kinds[kind]["usec"] += int(duration)
    return dict(kinds), complete
