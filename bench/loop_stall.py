"""A rollout that blocks the event loop (issue 32): what it costs the other prompts.

The issue's scenario: a generate function calling a synchronous ``time.sleep(8)`` on every 6th
prompt (``bench.episode_fns:blocking``), a 5 s lease, two ``rollstream produce`` processes on the
simulator, 36 prompts of n=2 taken and committed one batch of 6 at a time. Figures: groups
trained (each once?), leases lost, prompts reclaimed, duplicates discarded, the stalls the
producers logged and reported in their heartbeats, and the wall time.

A second run blocks 14 s, past the 10 s socket timeout (issue 43, finding 9: a command in flight
across such a stall was timed out and its script run again). A second table is what reading
replies under the stall-tolerant deadline (``common/connection.py``) costs a round trip: the same
client's GETs with redis-py's own read timeout and with the deadline, interleaved.

``python -m bench loop_stall`` (``--quick``: 12 prompts, a 6 s stall, no 14 s run).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import Counter
from typing import Any

from redis.asyncio import Connection
from rollstream.common.connection import ReplyDeadline, connect
from rollstream.common.keys import Keys
from rollstream.consumer import GroupConsumer
from rollstream.runtime.redis_server import EmbeddedRedis
from rollstream.testing.sim import SimConfig, SimEngine

from bench.common import OUT, Table, add_prompts, children, init_ns, spawn

LEASE = 5.0
BATCH = 6


async def scenario(prompts: int, block: float) -> dict[str, Any]:
    ns = f"stall-{time.monotonic_ns()}"
    with EmbeddedRedis() as server:
        redis = connect(server.url)
        keys = await init_ns(redis, ns, n_samples_per_prompt=2, batch_size=BATCH, lease_seconds=LEASE)
        await add_prompts(redis, keys, 0, prompts, with_ids=False)
        logs = [OUT / f"loop-stall-{ns}-p{i}.log" for i in range(2)]
        env = {"BENCH_BLOCK_SECONDS": str(block), "BENCH_BLOCK_EVERY": "6"}
        async with SimEngine(SimConfig(seed=1, mean_tokens=16, latency_per_token=0.002)) as sim:
            with children() as procs:
                for i, log in enumerate(logs):
                    procs.append(spawn(
                        ["-m", "rollstream.cli", "produce", "--redis", server.url, "--ns", ns, "--engine", sim.url,
                         "--reward", "math", "--concurrency", "8", "--name", f"p{i}", "--heartbeat-interval", "0.5",
                         "--generate", "bench.episode_fns:blocking"],
                        log, env,
                    ))
                started = time.monotonic()
                taken: Counter[int] = Counter()
                async with await GroupConsumer.connect(server.url, ns, "trainer", stall_timeout=120) as consumer:
                    while sum(taken.values()) < prompts:
                        batch = await asyncio.wait_for(consumer.take(min(BATCH, prompts - sum(taken.values()))), 300)
                        taken.update(g.index for g in batch.groups)
                        await consumer.commit(batch)
                seconds = time.monotonic() - started
                await asyncio.sleep(1.0)  # one more heartbeat with the last stall in it
                beats = {k.decode(): json.loads(v) for k, v in (await redis.hgetall(Keys(ns).producers)).items()}
        state = {k.decode(): v.decode() for k, v in (await redis.hgetall(keys.state)).items()}
        await redis.aclose()
    text = "\n".join(log.read_text(errors="replace") for log in logs)
    return {
        "trained": len(taken), "doubled": sum(1 for c in taken.values() if c > 1),
        "lost_leases": text.count("lost the lease"), "reclaimed": int(state.get("reclaimed", 0)),
        "duplicates": int(state.get("duplicates_discarded", 0)),
        "stalls_logged": text.count("event loop stalled"),
        "stalls_reported": sum(int(b.get("loop_stalls", 0)) for b in beats.values()),
        "longest": max((float(b.get("loop_stall_longest_s", 0.0)) for b in beats.values()), default=0.0),
        "seconds": seconds,
    }


async def round_trips(rounds: int, count: int) -> tuple[float, float]:
    """Median microseconds per GET round trip: redis-py's plain connection, then the
    stall-tolerant one of :func:`connect` (rounds interleaved, one embedded Redis)."""
    samples: dict[bool, list[float]] = {False: [], True: []}
    with EmbeddedRedis() as server:
        for _ in range(rounds):
            for tolerant in (False, True):
                client = connect(server.url)
                if not tolerant:
                    client.connection_pool.connection_class = Connection
                await client.ping()
                started = time.perf_counter()
                for _ in range(count):
                    await client.get("bench-round-trip")
                samples[tolerant].append((time.perf_counter() - started) / count * 1e6)
                await client.aclose()
    return statistics.median(samples[False]), statistics.median(samples[True])


async def deadline_costs(rounds: int, count: int) -> tuple[float, float]:
    """Median microseconds to enter and leave ``asyncio.timeout`` (redis-py's) and
    :class:`ReplyDeadline` around nothing: the part of a round trip the change touches."""
    samples: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for tolerant in (False, True):
            started = time.perf_counter()
            for _ in range(count):
                async with ReplyDeadline(10.0) if tolerant else asyncio.timeout(10.0):
                    pass
            samples[tolerant].append((time.perf_counter() - started) / count * 1e6)
    return statistics.median(samples[False]), statistics.median(samples[True])


def run(quick: bool = False) -> list[Table]:
    prompts, blocks = (12, [6.0]) if quick else (36, [8.0, 14.0])
    rows = []
    for block in blocks:
        r = asyncio.run(scenario(prompts, block))
        rows.append([f"{block:.0f}", f"{r['trained']}/{prompts}", r["doubled"], r["lost_leases"], r["reclaimed"],
                     r["duplicates"], r["stalls_logged"], r["stalls_reported"], r["longest"], r["seconds"]])
    plain, tolerant = asyncio.run(round_trips(3 if quick else 7, 2000 if quick else 10000))
    bare, deadline = asyncio.run(deadline_costs(3 if quick else 7, 20000 if quick else 100000))
    return [Table(
        "loop-stall", f"A rollout blocking the loop on every 6th of {prompts} prompts, lease {LEASE:.0f} s, 2 producers",
        ["block (s)", "trained once", "doubled", "leases lost", "reclaimed", "duplicates discarded", "stalls logged",
         "stalls in heartbeats", "longest stall (s)", "wall (s)"],
        rows,
        ["the blocked prompt's own time is the stall; a takeover re-runs other prompts from the start",
         "14 s outlasts the 10 s socket timeout: a reply that came during the stall is read, not timed out"],
        command=f"python -m bench loop_stall{' --quick' if quick else ''}",
    ), Table(
        "reply-deadline", "A Redis round trip (GET) with redis-py's read timeout and with the stall-tolerant deadline",
        ["read timeout", "us per round trip (median)", "us to enter and leave the timeout (median)"],
        [["redis-py's (asyncio.timeout)", plain, bare], ["stall-tolerant (ReplyDeadline)", tolerant, deadline]],
        ["one client, one connection, sequential GETs on an embedded Redis; rounds interleaved",
         "the last column is the timeout alone around nothing, no I/O (the part of a read that changed)"],
        command=f"python -m bench loop_stall{' --quick' if quick else ''}",
    )]
