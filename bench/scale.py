"""Scale: 8 -> 32 -> 128 producer processes on >= 8 network-namespace hosts against one Redis.

``python -m bench scale`` (root and ``ip`` needed: see bench/netns.py). Every host is a network
namespace on one bridge: Redis on one, the trainer (this driver) on another, the producers
spread round-robin over the producer hosts, each host with its own engine simulator on its own
loopback. The simulator answers after a fixed ``LATENCY`` seconds (sigma 0, few tokens), so a
producer spends almost all its time waiting: latency-bound, not CPU-bound (checked and printed:
producer CPU per process against wall time, and the host's idle share).

Per step (one fresh namespace, a fixed number of prompts, so the step ends by itself):

1. warm-up batches; then a **measured window** (groups/s, Redis process CPU per group,
   ``INFO commandstats`` deltas, memory, connections, CPU of every process, take() times);
2. a **slowlog window**: ``slowlog-log-slower-than 0`` records every command with its duration,
   arguments and client, so EVALSHA calls are attributed to their script by sha and every
   command to ADMIT / PUBLISH / heartbeat / renew / reclaim / take / commit / ...;
3. one ``inspect`` (``ops.snapshot``) timed;
4. SIGKILL of 25 % of the producers mid-run; the time until none of their prompts is pending
   under their names any more (taken over by the others);
5. the rest of the prompts to the end, then **exact accounting**: every prompt index committed
   exactly once, counters and streams agree, nothing pending.

Then, on the idle Redis, the cost of one group by size (8 x 1k, 8 x 8k, 16 x 32k tokens): the
PUBLISH script, the trainer's read and commit, each alone (commandstats deltas and Redis
process CPU), bytes on the wire and Redis memory per group: the inputs of the ceiling in
docs/scale.md.

The driver runs inside the trainer's namespace (``python -m bench.scale drive``); the parent
builds and tears down the hosts and turns the result into tables and plots.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
from rollstream.common import lua
from rollstream.common.codec import group_fields
from rollstream.common.config import PipelineConfig
from rollstream.common.connection import connect
from rollstream.common.keys import PRODUCERS_GROUP, Keys
from rollstream.common.protocol import GroupQueue, PromptQueue
from rollstream.consumer import GroupConsumer
from rollstream.ops.namespaces import delete_namespace
from rollstream.ops.snapshot import snapshot
from rollstream.testing.server import find_redis_server

from bench import netns
from bench.common import OUT, ROOT, Table, add_prompts, init_ns, make_group, percentile
from bench.worker import ADMIT_BEFORE

N = 8
"""Samples per prompt."""


@dataclass
class Spec:
    """One benchmark run: the producer counts of its steps and everything they share."""

    producers: list[int]
    hosts: int = 8
    concurrency: int = 16
    """Samples in flight per producer: ``concurrency // N`` groups."""
    latency: float = 4.0
    """Seconds per engine request (the simulator's base latency, sigma 0)."""
    tokens: int = 32
    lease: float = 10.0
    max_staleness: int = 2
    warmup_batches: int = 2
    measured_batches: int = 6
    slowlog_batches: int = 2
    tail_batches: int = 6
    """Batches after the SIGKILL (the reclaim happens while they are taken)."""
    kill_fraction: float = 0.25
    full_backlog_s: float = 5.0
    """Each of the two windows with the trainer holding off and the backlog full."""
    sizes: list[list[int]] = field(default_factory=lambda: [[8, 1024], [8, 8192], [16, 32768]])
    size_repeats: int = 24
    admit_consumers: list[int] = field(default_factory=lambda: [8, 32, 128, 512, 2048])
    pending_sizes: list[int] = field(default_factory=lambda: [256, 4096, 32768])
    variants: list[str] = field(default_factory=lambda: [""])
    """Producer variants ("" = this code; others: bench.worker ``--variant``), side by side in one run."""
    variant_producers: list[int] = field(default_factory=list)
    """The steps (producer counts) that run every variant; the others run this code only."""
    timeout: float = 1500.0
    """The whole run's deadline (seconds): the driver is killed past it."""

    def batch(self, producers: int) -> int:
        """Groups per batch: one round of every producer's groups in flight."""
        return producers * (self.concurrency // N)

    def batches(self) -> int:
        return self.warmup_batches + self.measured_batches + self.slowlog_batches + self.tail_batches


BIG = Spec(producers=[8, 32, 128], variants=["", "before"], variant_producers=[128])
QUICK = Spec(producers=[8], hosts=2, measured_batches=3, tail_batches=4, sizes=[[8, 1024]], size_repeats=8,
             admit_consumers=[8, 128], pending_sizes=[256, 4096])

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


def _command_delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, dict[str, int]]:
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


# -- one step ---------------------------------------------------------------------------------


@dataclass
class Taken:
    t: float
    wall: float
    lag_ms: float
    groups: list[tuple[int, str]]


class Trainer:
    """Takes every batch of the step, commits it, keeps the records. The weight version stands
    still (the simulator reports 0): admission control runs in every ADMIT and never binds."""

    def __init__(self, consumer: GroupConsumer, batch: int, batches: int) -> None:
        self.consumer = consumer
        self.batch = batch
        self.batches = batches
        self.taken: list[Taken] = []
        self.changed = asyncio.Event()
        self.go = asyncio.Event()
        """Cleared: the trainer holds off (trains), so the backlog fills."""
        self.go.set()

    async def run(self) -> None:
        for _ in range(self.batches):
            await self.go.wait()
            started = time.monotonic()
            async with asyncio.timeout(300):
                batch = await self.consumer.take(self.batch)
            done = time.monotonic()
            newest = max(int(g_id.split(b"-")[0]) for g_id in batch.entry_ids)
            lag = time.time() * 1000 - newest
            self.taken.append(Taken(done, done - started, lag, [(g.index, g.producer) for g in batch.groups]))
            await self.consumer.commit(batch)
            self.changed.set()

    async def until(self, count: int) -> None:
        while len(self.taken) < count:
            self.changed.clear()
            await self.changed.wait()


async def _wait(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(0.25)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def _cpu(pid: int) -> float:
    try:
        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)
    except psutil.Error:
        return float("nan")


async def _pending_of(meter: Meter, keys: Keys, names: set[str]) -> int:
    held = 0
    for stream in (keys.retry, keys.prompts):
        with contextlib.suppress(Exception):
            rows = await meter.redis.xinfo_consumers(stream, PRODUCERS_GROUP)
            held += sum(int(r["pending"]) for r in rows if (r["name"].decode() if isinstance(r["name"], bytes)
                                                            else r["name"]) in names)
    return held


async def step(spec: Spec, hosts: netns.Hosts, url: str, meter: Meter, sims: list[int], producers: int,
               variant: str, logs: Path) -> dict[str, Any]:
    batch = spec.batch(producers)
    total = batch * spec.batches()
    ns = f"scale{producers}{variant}-{time.monotonic_ns() % 10**9}"
    redis = connect(url)
    keys = await init_ns(redis, ns, n_samples_per_prompt=N, batch_size=batch, max_backlog=2 * batch,
                         max_staleness=spec.max_staleness, lease_seconds=spec.lease, heartbeat_timeout=15.0)
    for start in range(0, total, 1000):
        await add_prompts(redis, keys, start, min(1000, total - start))
    procs: dict[str, subprocess.Popen[bytes]] = {}
    result: dict[str, Any] = {"producers": producers, "variant": variant or "this code", "batch": batch,
                              "prompts": total, "hosts": len(hosts.producer_hosts)}
    try:
        for i in range(producers):
            host = hosts.producer_hosts[i % len(hosts.producer_hosts)]
            name = f"{host}-p{i}"
            args = [sys.executable, "-m", "bench.worker", "produce", "--redis", url, "--ns", ns,
                    "--engine", "http://127.0.0.1:30000", "--concurrency", str(spec.concurrency), "--name", name,
                    "--max-new-tokens", str(4 * spec.tokens)]
            if variant:
                args += ["--variant", variant]
            procs[name] = hosts.start(host, args, logs / f"{ns}-{name}.log", cwd=ROOT)
        started = time.monotonic()
        await _wait(lambda: _beats(meter, keys, producers), 60 + producers * 2.0, f"{producers} producer heartbeats")
        result["start_s"] = time.monotonic() - started
        async with await GroupConsumer.connect(url, ns, "trainer", stall_timeout=120) as consumer:
            trainer = Trainer(consumer, batch, spec.batches())
            task = asyncio.create_task(trainer.run(), name="trainer")
            try:
                await _phases(spec, meter, keys, trainer, task, procs, sims, result)
                async with asyncio.timeout(600):
                    await task
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        result["accounting"] = await _accounting(meter, keys, trainer, total)
    finally:
        for child in procs.values():
            if child.poll() is None:
                child.terminate()
        for child in procs.values():
            try:
                child.wait(20)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        with contextlib.suppress(Exception):
            await delete_namespace(redis, keys)
        await redis.aclose()
    return result


async def _beats(meter: Meter, keys: Keys, count: int) -> bool:
    return bool(await meter.redis.hlen(keys.producers) >= count)


async def _phases(spec: Spec, meter: Meter, keys: Keys, trainer: Trainer, task: asyncio.Task[None],
                  procs: dict[str, subprocess.Popen[bytes]], sims: list[int], result: dict[str, Any]) -> None:
    async def until(count: int) -> None:
        waiter = asyncio.create_task(trainer.until(count))
        done, _ = await asyncio.wait([waiter, task], return_when=asyncio.FIRST_COMPLETED, timeout=600)
        if waiter not in done:
            waiter.cancel()
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
            raise RuntimeError(f"the trainer did not reach batch {count}")

    pids = {name: p.pid for name, p in procs.items()}
    await until(spec.warmup_batches)
    a = await meter.mark()
    cpu0 = {name: _cpu(pid) for name, pid in pids.items()}
    sim0 = sum(_cpu(p) for p in sims)
    first = len(trainer.taken)
    await until(first + spec.measured_batches)
    b = await meter.mark()
    cpu1 = {name: _cpu(pid) for name, pid in pids.items()}
    sim1 = sum(_cpu(p) for p in sims)
    window = trainer.taken[first:first + spec.measured_batches]
    wall = b["t"] - a["t"]
    groups = sum(len(t.groups) for t in window)
    per_proc = [(cpu1[n] - cpu0[n]) / wall for n in pids]
    by_producer = Counter(p for t in window for _, p in t.groups)
    spread = [by_producer.get(n, 0) for n in pids]
    result.update({
        "window_s": wall, "groups": groups, "groups_per_s": groups / wall,
        "ideal_groups_per_s": len(pids) * (spec.concurrency // N) / spec.latency,
        "redis_cpu_us_per_group": (b["redis_cpu"] - a["redis_cpu"]) / groups * 1e6,
        "redis_cpu_share": (b["redis_cpu"] - a["redis_cpu"]) / wall,
        "commands": _command_delta(a, b),
        "used_memory_mb": b["used_memory"] / 2**20, "clients": b["clients"],
        "producer_cpu_mean": sum(per_proc) / len(per_proc), "producer_cpu_max": max(per_proc),
        "sim_cpu": (sim1 - sim0) / wall,
        "host_idle": (b["host_idle"] - a["host_idle"]) / max(1e-9, b["host_total"] - a["host_total"]),
        "take_wall_p50_ms": percentile([t.wall * 1e3 for t in window], 50),
        "take_wall_p99_ms": percentile([t.wall * 1e3 for t in window], 99),
        "take_lag_p50_ms": percentile([t.lag_ms for t in window], 50),
        "take_lag_p99_ms": percentile([t.lag_ms for t in window], 99),
        "spread_min": min(spread), "spread_max": max(spread), "spread_mean": sum(spread) / len(spread),
        "starved": sum(1 for s in spread if s == 0),
    })

    # Slowlog window: every command with its duration and client.
    await meter.slowlog_on(400_000)
    s0 = len(trainer.taken)
    t0 = time.monotonic()
    await until(s0 + spec.slowlog_batches)
    entries = await meter.slowlog_off()
    kinds, complete = slowlog_breakdown(entries)
    slow_groups = sum(len(t.groups) for t in trainer.taken[s0:s0 + spec.slowlog_batches])
    result["slowlog"] = {"groups": slow_groups, "seconds": time.monotonic() - t0, "complete": complete,
                         "entries": len(entries), "kinds": kinds}
    result["command_us_per_group"] = sum(k["usec"] for k in kinds.values()) / max(1, slow_groups)

    # One inspect.
    t = time.perf_counter()
    await snapshot(meter.redis, keys)
    result["inspect_ms"] = (time.perf_counter() - t) * 1e3

    # The trainer holds off until the backlog is full: what refused producers cost.
    result["full_backlog"] = await _full_backlog(spec, meter, keys, trainer, len(procs))

    # SIGKILL a quarter of the producers; time until their prompts are all taken over.
    names = sorted(procs)
    victims = set(names[:: max(1, round(1 / spec.kill_fraction))][: max(1, int(len(names) * spec.kill_fraction))])
    # Back to flowing first: after the full backlog the producers hold nothing (a kill then
    # would take over nothing).
    await until(len(trainer.taken) + 1)

    async def holding() -> bool:
        return await _pending_of(meter, keys, victims) >= len(victims)

    await _wait(holding, 60 + 10 * spec.latency, "the producers to be killed to hold prompts")
    held = await _pending_of(meter, keys, victims)
    killed_at = time.monotonic()
    for name in victims:
        procs[name].send_signal(signal.SIGKILL)
    for name in victims:
        procs[name].wait(10)

    async def released() -> bool:
        return await _pending_of(meter, keys, victims) == 0

    await _wait(released, 10 * spec.lease + 120, "the killed producers' prompts to be taken over")
    result["kill"] = {"killed": len(victims), "held_at_kill": held, "reclaim_s": time.monotonic() - killed_at,
                      "lease_s": spec.lease}


async def _full_backlog(spec: Spec, meter: Meter, keys: Keys, trainer: Trainer, producers: int) -> dict[str, Any]:
    """Hold the trainer until the ready backlog is at its cap, then measure the refused
    producers: Redis CPU share (a plain window), then ADMIT calls per producer and second (a
    slowlog window); then let the trainer go on."""
    cap = 2 * spec.batch(producers)

    async def full() -> bool:
        length = int(await meter.redis.xlen(keys.groups))
        taken = int((await meter.redis.xpending(keys.groups, "trainer"))["pending"])
        return length - taken >= cap

    trainer.go.clear()
    try:
        await _wait(full, 120 + 10 * spec.latency, "the backlog to fill")
        a = await meter.mark()
        await asyncio.sleep(spec.full_backlog_s)
        b = await meter.mark()
        await meter.slowlog_on(400_000)
        t0 = time.monotonic()
        await asyncio.sleep(spec.full_backlog_s)
        entries = await meter.slowlog_off()
        seconds = time.monotonic() - t0
    finally:
        trainer.go.set()
    kinds, complete = slowlog_breakdown(entries)
    admit = kinds.get("admit", {"calls": 0, "usec": 0})
    return {
        "redis_cpu_share": (b["redis_cpu"] - a["redis_cpu"]) / (b["t"] - a["t"]),
        "admit_per_producer_s": admit["calls"] / seconds / producers,
        "admit_us_per_call": admit["usec"] / admit["calls"] if admit["calls"] else 0.0,
        "kinds": kinds, "complete": complete, "seconds": seconds,
    }


async def _accounting(meter: Meter, keys: Keys, trainer: Trainer, total: int) -> dict[str, Any]:
    indexes = Counter(i for t in trainer.taken for i, _ in t.groups)
    state = {k.decode(): v.decode() for k, v in (await meter.redis.hgetall(keys.state)).items()}
    lengths = {s: int(await meter.redis.xlen(s)) for s in (keys.prompts, keys.retry, keys.groups, keys.dead)}
    pending = 0
    for stream, group in keys.consumer_groups:
        pending += int((await meter.redis.xpending(stream, group))["pending"])
    lost = sorted(set(range(total)) - set(indexes))
    doubled = sorted(i for i, c in indexes.items() if c > 1)
    return {
        "prompts": total, "committed_groups": sum(indexes.values()), "distinct": len(indexes),
        "lost": len(lost), "doubled": len(doubled), "unexpected": len(set(indexes) - set(range(total))),
        "state_committed": int(state.get("committed", 0)), "state_published": int(state.get("published", 0)),
        "duplicates_discarded": int(state.get("duplicates_discarded", 0)), "reclaimed": int(state.get("reclaimed", 0)),
        "left_in_streams": sum(lengths.values()), "pending": pending,
    }


# -- the cost of one group by size -------------------------------------------------------------


async def sizes(spec: Spec, url: str, meter: Meter) -> list[dict[str, Any]]:
    out = []
    for n, tokens in spec.sizes:
        redis = connect(url)
        ns = f"scalesize-{n}x{tokens}"
        keys = await init_ns(redis, ns, n_samples_per_prompt=n, batch_size=spec.size_repeats, max_backlog=10**6)
        reps = spec.size_repeats if n * tokens <= 8 * 8192 else max(4, spec.size_repeats // 3)
        await add_prompts(redis, keys, 0, reps)
        queue = PromptQueue(redis, keys, "sizer")
        admitted = await queue.admit(PipelineConfig(n_samples_per_prompt=n, batch_size=reps, max_backlog=10**6), reps)
        fields = group_fields(make_group(n, tokens))
        wire = sum(len(str(k)) + len(v if isinstance(v, bytes) else str(v)) for k, v in fields.items())
        phases: dict[str, dict[str, float]] = {}
        a = await meter.mark()
        for item in admitted.entries:
            await queue.publish(item.stream, item.entry_id, fields)
        b = await meter.mark()
        phases["publish"] = _phase(a, b, len(admitted.entries), "evalsha")
        blocking = connect(url, block_ms=2000)
        groups = GroupQueue(redis, keys, "sizer")
        a = await meter.mark()
        got: list[Any] = []
        while len(got) < len(admitted.entries):
            got += await groups.read(blocking, len(admitted.entries) - len(got), 1000)
        b = await meter.mark()
        phases["take"] = _phase(a, b, len(got), "xreadgroup")
        memory_per_group = (a["used_memory"] - phases["publish"]["memory_before"]) / len(got)
        a = await meter.mark()
        await groups.commit([eid for eid, _ in got])
        b = await meter.mark()
        phases["commit"] = _phase(a, b, len(got), "evalsha")
        await blocking.aclose()
        await delete_namespace(redis, keys)
        await redis.aclose()
        out.append({"n": n, "tokens": tokens, "groups": len(got), "wire_bytes": wire,
                    "memory_bytes": memory_per_group, **{k: v for k, v in phases.items()}})
    return out


def _phase(a: dict[str, Any], b: dict[str, Any], count: int, command: str) -> dict[str, float]:
    delta = _command_delta(a, b)
    return {
        "cpu_us": (b["redis_cpu"] - a["redis_cpu"]) / count * 1e6,
        "command_us": delta.get(command, {"usec": 0})["usec"] / count,
        "memory_before": a["used_memory"],
    }


# -- ADMIT against the number of producers; the reclaim check against the pending list ---------


async def admit_costs(spec: Spec, url: str, meter: Meter) -> list[dict[str, Any]]:
    """ADMIT's Redis cost with C producers known to the consumer group (each holding one
    prompt, as in a run), this code against the code before the fix, side by side."""
    out = []
    calls = 100
    for consumers in spec.admit_consumers:
        redis = connect(url)
        keys = await init_ns(redis, f"scaleadmit-{consumers}", n_samples_per_prompt=N, batch_size=64,
                             max_backlog=10**6, max_staleness=10**6)
        await add_prompts(redis, keys, 0, consumers + 2 * calls + 8, with_ids=False)
        async with redis.pipeline(transaction=False) as pipe:
            for c in range(consumers):
                pipe.xreadgroup(PRODUCERS_GROUP, f"p{c}", {keys.prompts: ">"}, count=1)
                pipe.xreadgroup(PRODUCERS_GROUP, f"p{c}", {keys.retry: ">"}, count=1)
            await pipe.execute()
        row: dict[str, Any] = {"consumers": consumers}
        for label, declared in (("before", ADMIT_BEFORE), ("this code", lua.ADMIT)):
            script = redis.register_script(declared.source)
            script_keys, args = declared.lists(keys, {
                "consumer": "admitter", "max_backlog": 10**6, "admission": 1, "max_staleness": 10**6, "batch_size": 64,
                "steps_per_version": 1, "count": 1, "now_ms": 0, "max_backlog_bytes": 0,
            })
            await script(keys=script_keys, args=args)
            a = await meter.mark()
            for _ in range(calls):
                await script(keys=script_keys, args=args)
            b = await meter.mark()
            row[label] = {"command_us": _command_delta(a, b)["evalsha"]["usec"] / calls,
                          "cpu_us": (b["redis_cpu"] - a["redis_cpu"]) / calls * 1e6}
        out.append(row)
        await delete_namespace(redis, keys)
        await redis.aclose()
    return out


async def reclaim_check_costs(spec: Spec, url: str, meter: Meter) -> list[dict[str, Any]]:
    """One producer's reclaim check (``any_idle``: XPENDING IDLE lease COUNT 1, nothing idle)
    against the size of the pending list: it walks the whole list."""
    out = []
    calls = 50
    for size in spec.pending_sizes:
        redis = connect(url)
        keys = await init_ns(redis, f"scalepel-{size}", n_samples_per_prompt=N, batch_size=64)
        for start in range(0, size, 5000):
            await add_prompts(redis, keys, start, min(5000, size - start), with_ids=False)
        await redis.xreadgroup(PRODUCERS_GROUP, "holder", {keys.prompts: ">"}, count=size)
        queue = PromptQueue(redis, keys, "checker")
        a = await meter.mark()
        for _ in range(calls):
            await queue.any_idle(3_600_000)
        b = await meter.mark()
        delta = _command_delta(a, b)["xpending"]
        out.append({"pending": size, "command_us": delta["usec"] / calls,
                    "cpu_us": (b["redis_cpu"] - a["redis_cpu"]) / calls * 1e6})
        await delete_namespace(redis, keys)
        await redis.aclose()
    return out


# -- the driver (inside the trainer's namespace) -----------------------------------------------


async def drive(spec: Spec, logs: Path) -> dict[str, Any]:
    hosts = netns.Hosts(spec.hosts)
    redis_addr = hosts.addr("redis")
    url = f"redis://{redis_addr}:6379/0"
    started: list[subprocess.Popen[bytes]] = []
    data = logs / "redis-data"
    data.mkdir(parents=True, exist_ok=True)
    binary = find_redis_server()
    out: dict[str, Any] = {"spec": asdict(spec), "redis": binary, "steps": []}
    try:
        server = hosts.start("redis", [binary, "--bind", redis_addr, "--port", "6379", "--save", "", "--appendonly",
                                       "no", "--dir", str(data), "--protected-mode", "no", "--maxclients", "10000"],
                             logs / "redis.log")
        started.append(server)
        for host in hosts.producer_hosts:
            started.append(hosts.start(host, [
                sys.executable, "-m", "rollstream.cli", "sim-engine", "--host", "127.0.0.1", "--port", "30000",
                "--mean-tokens", str(spec.tokens), "--length-sigma", "0", "--base-latency", str(spec.latency),
                "--max-running", "100000", "--log-level", "WARNING"], logs / f"sim-{host}.log"))
        for host in hosts.producer_hosts:
            check = "from rollstream.testing.children import wait_for_http; wait_for_http('http://127.0.0.1:30000', 60)"
            await asyncio.to_thread(subprocess.run, hosts.command(host, [sys.executable, "-c", check]), check=True,
                                    timeout=90)
        meter = Meter(url)
        await _wait(lambda: meter.redis.ping(), 30, "redis")
        out["redis_version"] = (await meter.info("server"))["redis_version"]
        sims = [p.pid for p in started[1:]]
        for producers in spec.producers:
            for variant in spec.variants if producers in spec.variant_producers else [""]:
                out["steps"].append(await step(spec, hosts, url, meter, sims, producers, variant, logs))
                print(json.dumps(out["steps"][-1], default=str)[:400], flush=True)
        out["sizes"] = await sizes(spec, url, meter)
        out["admit"] = await admit_costs(spec, url, meter)
        out["reclaim_check"] = await reclaim_check_costs(spec, url, meter)
        await meter.redis.aclose()
    finally:
        for child in reversed(started):
            if child.poll() is None:
                child.terminate()
        for child in started:
            try:
                child.wait(15)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    return out


def measure(spec: Spec, logs: Path) -> dict[str, Any]:
    """Build the hosts, run the driver inside the trainer's namespace, tear everything down."""
    reason = netns.allowed()
    if reason:
        raise RuntimeError(f"the scale benchmark needs network namespaces: {reason}")
    logs.mkdir(parents=True, exist_ok=True)
    hosts = netns.Hosts(spec.hosts)
    result_file = logs / "scale-result.json"
    result_file.unlink(missing_ok=True)
    try:
        hosts.build()
        cmd = hosts.command("trainer", [sys.executable, "-m", "bench.scale", "drive", "--spec", json.dumps(asdict(spec)),
                                        "--logs", str(logs), "--out", str(result_file)])
        with open(logs / "driver.log", "ab") as log:
            child = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = child.wait(spec.timeout)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
                raise RuntimeError(f"the scale driver did not finish within {spec.timeout:.0f} s; see {logs}") from None
        if code != 0 or not result_file.exists():
            tail = (logs / "driver.log").read_text(errors="replace")[-4000:]
            raise RuntimeError(f"the scale driver failed (exit {code}):\n{tail}")
        return dict(json.loads(result_file.read_text()))
    finally:
        hosts.teardown()


# -- tables, plots ----------------------------------------------------------------------------


def tables(result: dict[str, Any]) -> list[Table]:
    steps = result["steps"]
    spec = result["spec"]
    rows: list[list[Any]] = []
    backlog_rows: list[list[Any]] = []
    for s in steps:
        acc = s["accounting"]
        s["command_us_per_group"] = sum(k["usec"] for k in s["slowlog"]["kinds"].values()) / s["slowlog"]["groups"]
        rows.append([
            s["producers"], s["hosts"], s["variant"], s["groups_per_s"], s["ideal_groups_per_s"],
            s["redis_cpu_us_per_group"], s["command_us_per_group"], s["redis_cpu_share"], s["used_memory_mb"],
            s["clients"], f"{s['take_wall_p50_ms']:.0f} / {s['take_wall_p99_ms']:.0f}",
            f"{s['take_lag_p50_ms']:.1f} / {s['take_lag_p99_ms']:.1f}",
            f"{s['spread_min']}-{s['spread_max']} ({s['starved']} starved)", s["inspect_ms"],
            (f"{s['kill']['reclaim_s']:.1f} ({s['kill']['killed']} killed, {s['kill']['held_at_kill']} held)"
             if s["kill"]["held_at_kill"] else f"not measured: the {s['kill']['killed']} killed held nothing"),
            f"{acc['lost']} / {acc['doubled']}", f"{s['producer_cpu_mean']:.3f} / {s['producer_cpu_max']:.3f}",
            s["host_idle"],
        ])
        if "full_backlog" in s:
            fb = s["full_backlog"]
            backlog_rows.append([s["producers"], s["variant"], fb["admit_per_producer_s"],
                                 fb["admit_per_producer_s"] * s["producers"], fb["admit_us_per_call"],
                                 fb["redis_cpu_share"], s["redis_cpu_share"]])
    main = Table(
        "scale",
        f"Scale: producer processes on network-namespace hosts against one Redis {result.get('redis_version', '')}",
        ["producers", "hosts", "code", "groups/s", "latency-bound ideal", "Redis CPU us/group",
         "command us/group", "Redis cores", "Redis MB", "clients", "take() wall p50/p99 ms",
         "publish->take p50/p99 ms", "groups per producer min-max", "inspect ms",
         f"reclaim s after SIGKILL (lease {spec['lease']:.0f} s)", "lost / doubled", "producer CPU mean/max (cores)",
         "host idle"],
        rows,
        [
            f"Each producer: concurrency {spec['concurrency']} samples = {spec['concurrency'] // N} groups of {N}, "
            f"engine {spec['latency']:.0f} s per request ({spec['tokens']} tokens, sigma 0, one simulator per host); "
            f"batch = one round of every producer's groups; max_staleness {spec['max_staleness']}, weight "
            "version standing still; heartbeat 2 s; lease as shown (renew every third, reclaim check every quarter).",
            "Redis CPU us/group: Redis process CPU (user + sys) in the measured window / groups committed in it "
            "(networking included); command us/group: the time of the commands themselves (the clients' "
            "commands, scripts whole), from the slowlog window below.",
            "take() wall includes waiting for the engines (latency-bound); publish->take: time from the XADD of the "
            "batch's newest group (its entry id) to take() returning.",
            "producer CPU: CPU-seconds per wall-second of each producer process (1.0 = a core); host idle: share "
            "of the machine's CPU time idle in the window (the machine is shared with other work).",
        ],
        "python -m bench scale",
    )
    kinds_rows = []
    for s in steps:
        sl = s["slowlog"]
        per = {k: v["usec"] / sl["groups"] for k, v in sl["kinds"].items()}
        calls = {k: v["calls"] / sl["groups"] for k, v in sl["kinds"].items()}
        kinds_rows.append([s["producers"], s["variant"], sl["groups"], "yes" if sl["complete"] else "NO",
                           *(f"{per.get(k, 0):.1f} ({calls.get(k, 0):.2f})" for k in KINDS),
                           sum(per.values())])
    kinds = Table(
        "scale-commands",
        "Redis command time per group by kind: us (calls) per committed group, from a slowlog window",
        ["producers", "code", "groups", "complete", *KINDS, "total us"],
        kinds_rows,
        ["slowlog-log-slower-than 0 during the window: every command with its duration and client; EVALSHA "
         "attributed to its script by sha (ADMIT, PUBLISH, RENEW, ACK_DELETE = commit, SET_VERSION = version); "
         "commands run inside a script are counted in their EVALSHA. Slowlog adds its own cost to each command."],
        "python -m bench scale",
    )
    size_rows = []
    for z in result.get("sizes", []):
        size_rows.append([f"{z['n']} x {z['tokens']}", z["wire_bytes"] / 1e6, z["memory_bytes"] / 1e6,
                          z["publish"]["command_us"], z["publish"]["cpu_us"], z["take"]["command_us"],
                          z["take"]["cpu_us"], z["commit"]["command_us"], z["commit"]["cpu_us"]])
    by_size = Table(
        "scale-sizes",
        "Redis cost of one group by size, each operation alone on an idle Redis",
        ["group", "MB on the wire", "Redis MB held", "PUBLISH command us", "PUBLISH Redis CPU us",
         "read command us", "read Redis CPU us", "commit command us", "commit Redis CPU us"],
        size_rows,
        ["Redis CPU us: process CPU per group (parsing the request, the command, writing the reply)."],
        "python -m bench scale",
    )
    admit_rows = []
    for row in result.get("admit", []):
        before, after = row["before"], row["this code"]
        admit_rows.append([row["consumers"], before["command_us"], after["command_us"], before["cpu_us"],
                           after["cpu_us"], before["cpu_us"] / max(1e-9, after["cpu_us"])])
    admit = Table(
        "scale-admit",
        "ADMIT against the producers in the consumer group: before (XPENDING summary) / this code (XINFO GROUPS)",
        ["producers (consumers)", "command us before", "command us now", "Redis CPU us before", "Redis CPU us now",
         "x"],
        admit_rows,
        ["Each producer holds one prompt (a run's shape); one prompt admitted per call, 100 calls each, both "
         "scripts side by side on the same Redis."],
        "python -m bench scale",
    )
    check_rows = [[r["pending"], r["command_us"], r["cpu_us"]] for r in result.get("reclaim_check", [])]
    check = Table(
        "scale-reclaim-check",
        "One reclaim check (XPENDING IDLE lease COUNT 1, nothing idle) against the prompts in flight",
        ["prompts pending", "command us", "Redis CPU us"],
        check_rows,
        ["Every producer runs it for both prompt streams every min(5 s, lease / 4)."],
        "python -m bench scale",
    )
    backlog = Table(
        "scale-backlog",
        "The trainer holding off, the ready backlog full: what the refused producers cost Redis",
        ["producers", "code", "ADMIT calls per producer per s", "ADMIT calls per s", "us per ADMIT (slowlog)",
         "Redis cores, backlog full", "Redis cores, flowing (main table)"],
        backlog_rows,
        ["A refused producer retries ADMIT after its nap (this code: 2 s, or at once when a take() announces "
         "`taken`; before: every 0.2 s)."],
        "python -m bench scale",
    )
    tables = [main, kinds, by_size, admit, check, backlog]
    if steps and result.get("sizes") and result.get("admit") and result.get("reclaim_check"):
        tables.append(ceiling(result))
    return tables


# -- the ceiling, projected --------------------------------------------------------------------

LARGE_RUN = {"engines": 1024, "prompts_per_step": 512, "n": 16, "step_s": 60.0, "max_staleness": 1}
"""The large run the ceiling is compared with: 1,024 engines, 512 prompts x 16 samples a step, a step a minute."""
PRODUCTION = {"heartbeat_s": 2.0, "lease_s": 120.0, "reclaim_s": 5.0, "concurrency": 256}
"""A producer's defaults in such a run (heartbeat 2 s, lease 120 s: renew every 40 s, reclaim turn every 5 s)."""
NIC_BYTES_PER_S = 1.25e9
"""10 Gbit/s."""


def _per_call(step: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """(Redis CPU us of one round trip beyond its command, Redis CPU us per call of each kind),
    from the largest step: the process CPU per group minus the commands' own time, spread over
    the round trips of a group."""
    sl = step["slowlog"]
    calls = sum(k["calls"] for k in sl["kinds"].values()) / sl["groups"]
    command = sum(k["usec"] for k in sl["kinds"].values()) / sl["groups"]
    overhead = max(0.0, (step["redis_cpu_us_per_group"] - command) / calls)
    return overhead, {k: overhead + v["usec"] / v["calls"] for k, v in sl["kinds"].items() if v["calls"]}


def _interpolate(rows: list[tuple[float, float]], x: float) -> float:
    rows = sorted(rows)
    if len(rows) == 1 or x <= rows[0][0]:  # proportional below the first measured point
        return rows[0][1] * x / rows[0][0] if rows[0][0] else rows[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(rows):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = rows[-2], rows[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


def projection(result: dict[str, Any]) -> dict[str, Any]:
    """The arithmetic of docs/scale.md's ceiling, from one result: per-producer costs per second
    at production defaults, per-group costs by size, groups/s one Redis core carries."""
    step = max((s for s in result["steps"] if s["variant"] == "this code"), key=lambda s: s["producers"])
    overhead, per_call = _per_call(step)
    in_flight = PRODUCTION["concurrency"] // LARGE_RUN["n"]
    sl = step["slowlog"]
    renew = sl["kinds"].get("renew", {"calls": 0, "usec": 0})
    ids_per_renew = result["spec"]["concurrency"] // N
    renew_us_per_id = (renew["usec"] / renew["calls"] / ids_per_renew) if renew["calls"] else 0.0
    scan = [(r["pending"], r["cpu_us"]) for r in result["reclaim_check"]]
    admit_now = [(r["consumers"], r["this code"]["cpu_us"]) for r in result["admit"]]
    admit_before = [(r["consumers"], r["before"]["cpu_us"]) for r in result["admit"]]
    refused = [s["full_backlog"]["admit_us_per_call"] for s in result["steps"] if s.get("full_backlog", {}).get(
        "admit_us_per_call")]
    refused_us = overhead + (sum(refused) / len(refused) if refused else per_call.get("admit", overhead) - overhead)
    out: dict[str, Any] = {"overhead_us": overhead, "per_call_us": per_call, "producers": {}, "sizes": [],
                           "refused_admit_us": refused_us}
    for producers in (128, 1024):
        outstanding = (LARGE_RUN["max_staleness"] + 1) * LARGE_RUN["prompts_per_step"]
        pel = min(producers * in_flight, outstanding)
        fixed = {
            "heartbeat": per_call.get("heartbeat", overhead) / PRODUCTION["heartbeat_s"],
            "renew": (overhead + renew_us_per_id * pel / producers) / (PRODUCTION["lease_s"] / 3),
            "reclaim turn": overhead / PRODUCTION["reclaim_s"],
        }
        fleet_scan = 2 * _interpolate(scan, pel) / PRODUCTION["reclaim_s"]
        before_scans = producers * (overhead + 2 * _interpolate(scan, pel)) / PRODUCTION["reclaim_s"]
        out["producers"][producers] = {
            "pending": pel, "fixed_us_per_s": fixed, "fixed_total_us_per_s": producers * sum(fixed.values()) + fleet_scan,
            "reclaim_scans_before_us_per_s": before_scans, "reclaim_scans_now_us_per_s": fleet_scan + producers * fixed[
                "reclaim turn"],
            "refused_admit_now_us_per_s": producers * _interpolate(admit_now, producers),
            "refused_admit_before_us_per_s": producers * _interpolate(admit_before, producers),
            "admit_now_us": _interpolate(admit_now, producers), "admit_before_us": _interpolate(admit_before, producers),
            "backlog_polls_before_us_per_s": producers / 0.2 * refused_us,
            "backlog_polls_now_us_per_s": producers * (1 / 2.0 + 1 / LARGE_RUN["step_s"]) * refused_us,
        }
    demand = LARGE_RUN["prompts_per_step"] / LARGE_RUN["step_s"]
    for z in result["sizes"]:
        per_group = {"publish": z["publish"]["cpu_us"], "take": z["take"]["cpu_us"], "commit": z["commit"]["cpu_us"]}
        row = {"n": z["n"], "tokens": z["tokens"], "wire_bytes": z["wire_bytes"], "memory_bytes": z["memory_bytes"],
               "per_group_us": per_group, "bw_groups_per_s": NIC_BYTES_PER_S / (2 * z["wire_bytes"]), "runs": {}}
        for producers, p in out["producers"].items():
            admit = p["admit_now_us"]
            g = sum(per_group.values()) + admit
            free = 1e6 - p["fixed_total_us_per_s"]
            row["runs"][producers] = {"us_per_group": g, "groups_per_s": free / g,
                                      "demand_share": (p["fixed_total_us_per_s"] + demand * g) / 1e6}
        out["sizes"].append(row)
    out["demand_groups_per_s"] = demand
    return out


def ceiling(result: dict[str, Any]) -> Table:
    proj = projection(result)
    rows = []
    for z in proj["sizes"]:
        for producers, r in z["runs"].items():
            p = proj["producers"][producers]
            rows.append([f"{z['n']} x {z['tokens']}", producers, r["us_per_group"], p["fixed_total_us_per_s"] / 1e3,
                         r["groups_per_s"], z["bw_groups_per_s"], z["memory_bytes"] / 1e6,
                         f"{100 * r['demand_share']:.1f} %"])
    demand = proj["demand_groups_per_s"]
    return Table(
        "scale-ceiling",
        f"Projected: what one Redis core carries (the large run: {LARGE_RUN['engines']:,} engines, "
        f"{LARGE_RUN['prompts_per_step']} prompts x {LARGE_RUN['n']} samples a step, a step a minute = "
        f"{demand:.2f} groups/s)",
        ["group", "producers", "Redis CPU us/group", "producers' fixed cost ms/s", "groups/s on one core",
         "groups/s on 10 Gbit/s", "Redis MB per group held", "the large run's share of one core"],
        rows,
        [f"Per round trip beyond its command: {proj['overhead_us']:.0f} us of Redis CPU (measured at the largest "
         "step); per group: PUBLISH + read + commit of that size (measured alone) + one ADMIT with that many "
         "producers; fixed: heartbeats, lease renewals, reclaim turns at production defaults "
         f"({PRODUCTION}).",
         "docs/scale.md walks through the arithmetic."],
        "python -m bench.scale render",
    )


def plot(result: dict[str, Any]) -> None:
    from bench.common import IMG, plt

    steps = [s for s in result["steps"] if s["variant"] == "this code"]
    if not steps:
        return
    pyplot = plt()
    ps = [s["producers"] for s in steps]
    fig, ax = pyplot.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(ps, [s["groups_per_s"] for s in steps], marker="o", label="measured")
    ax[0].plot(ps, [s["ideal_groups_per_s"] for s in steps], linestyle="--", label="latency-bound ideal")
    ax[0].set_ylabel("groups/s")
    ax[1].plot(ps, [s["redis_cpu_us_per_group"] for s in steps], marker="o", label="Redis process CPU")
    ax[1].plot(ps, [sum(k["usec"] for k in s["slowlog"]["kinds"].values()) / s["slowlog"]["groups"] for s in steps],
               marker="s", label="the commands themselves (slowlog)")
    ax[1].set_ylabel("Redis CPU us per group")
    for a in ax:
        a.set_xscale("log", base=2)
        a.set_xticks(ps, [str(p) for p in ps])
        a.set_xlabel("producer processes")
        a.legend()
    fig.suptitle("scale: producers on network-namespace hosts, one Redis (python -m bench scale)")
    fig.tight_layout()
    IMG.mkdir(parents=True, exist_ok=True)
    fig.savefig(IMG / "scale.png", dpi=100)
    pyplot.close(fig)
    fig, axis = pyplot.subplots(figsize=(6, 4))
    axis.plot(ps, [s["take_wall_p99_ms"] for s in steps], marker="o", label="take() wall p99")
    axis.plot(ps, [s["take_lag_p99_ms"] for s in steps], marker="s", label="publish -> take p99")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xticks(ps, [str(p) for p in ps])
    axis.set_xlabel("producer processes")
    axis.set_ylabel("ms")
    axis.legend()
    axis.set_title("take() p99 vs producers")
    fig.tight_layout()
    fig.savefig(IMG / "scale-take.png", dpi=100)
    pyplot.close(fig)


def run(quick: bool = False) -> list[Table]:
    spec = QUICK if quick else BIG
    if os.environ.get("ROLLSTREAM_SCALE_VARIANTS"):
        spec.variants = os.environ["ROLLSTREAM_SCALE_VARIANTS"].split(",")
    result = measure(spec, OUT / f"scale-logs{'-quick' if quick else ''}")
    (OUT / f"scale{'-quick' if quick else ''}.json").write_text(json.dumps(result, indent=1, default=str))
    if not quick:
        plot(result)
    return tables(result)


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench.scale")
    sub = parser.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("render", help="the tables and plots again from a result file (no new run)")
    r.add_argument("result", nargs="?", default=str(OUT / "scale.json"))
    d = sub.add_parser("drive", help="(inside the trainer's namespace) run the steps, write the result")
    d.add_argument("--spec", required=True)
    d.add_argument("--logs", required=True)
    d.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.mode == "render":
        result = json.loads(Path(args.result).read_text())
        plot(result)
        text = "".join(t.markdown() + "\n" for t in tables(result))
        (OUT / "scale.md").write_text(text)
        sys.stdout.write(text)
        return
    spec = Spec(**json.loads(args.spec))
    result = asyncio.run(drive(spec, Path(args.logs)))
    Path(args.out).write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
