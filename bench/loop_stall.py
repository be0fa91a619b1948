"""A rollout that blocks the event loop (issue 32): what it costs the other prompts.

The issue's scenario: a generate function calling a synchronous ``time.sleep(8)`` on every 6th
prompt (``bench.episode_fns:blocking``), a 5 s lease, two ``rollstream produce`` processes on the
simulator, 36 prompts of n=2 taken and committed one batch of 6 at a time. Figures: groups
trained (each once?), leases lost, prompts reclaimed, duplicates discarded, the stalls the
producers logged and reported in their heartbeats, and the wall time.

``python -m bench loop_stall`` (``--quick``: 12 prompts, a 6 s stall).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from typing import Any

from rollstream.common.connection import connect
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


def run(quick: bool = False) -> list[Table]:
    prompts, block = (12, 6.0) if quick else (36, 8.0)
    r = asyncio.run(scenario(prompts, block))
    return [Table(
        "loop-stall", f"A rollout blocking the loop {block:.0f} s on every 6th of {prompts} prompts, lease {LEASE:.0f} s, 2 producers",
        ["trained once", "doubled", "leases lost", "reclaimed", "duplicates discarded", "stalls logged",
         "stalls in heartbeats", "longest stall (s)", "wall (s)"],
        [[f"{r['trained']}/{prompts}", r["doubled"], r["lost_leases"], r["reclaimed"], r["duplicates"],
          r["stalls_logged"], r["stalls_reported"], r["longest"], r["seconds"]]],
        ["the blocked prompt's own time is the stall; a takeover re-runs other prompts from the start"],
        command=f"python -m bench loop_stall{' --quick' if quick else ''}",
    )]
