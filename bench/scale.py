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

This module is the run (the steps, the driver, the command line); beside it ``scale_spec`` (what
a run measures), ``scale_meter`` (the Redis-side accounting), ``scale_costs`` (the idle-Redis
costs) and ``scale_report`` (tables, plots, the projected ceiling); the hosts are ``netns``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
from rollstream.common.connection import connect
from rollstream.common.keys import PRODUCERS_GROUP, Keys
from rollstream.consumer import GroupConsumer
from rollstream.ops.namespaces import delete_namespace
from rollstream.ops.snapshot import snapshot
from rollstream.runtime.redis_server import find_redis_server

from bench import netns
from bench.common import OUT, ROOT, Table, add_prompts, init_ns, percentile
from bench.scale_costs import admit_costs, reclaim_check_costs, sizes
from bench.scale_meter import KINDS, METER, Meter, classify, command_delta, slowlog_breakdown
from bench.scale_report import plot, tables
from bench.scale_spec import BIG, QUICK, N, Spec

__all__ = [  # the run lives here; its spec, meter, idle-Redis costs and report in their own modules
    "BIG",
    "KINDS",
    "METER",
    "QUICK",
    "Meter",
    "N",
    "Spec",
    "classify",
    "drive",
    "main",
    "measure",
    "plot",
    "run",
    "slowlog_breakdown",
    "step",
    "tables",
]


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
        "commands": command_delta(a, b),
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
            check = "from rollstream.runtime.children import wait_for_http; wait_for_http('http://127.0.0.1:30000', 60)"
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
