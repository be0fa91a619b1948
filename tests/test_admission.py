"""Staleness-aware admission: producers do not generate what would go stale.

The same 20-step run twice, with real producer processes and a trainer that bumps the engine's
and its own version every step: with admission control nothing is taken staler than
``max_staleness`` and (almost) nothing is recycled as stale; without it the producers run ahead
into the backlog and the consumer recycles stale groups.
"""

from __future__ import annotations

import asyncio
from typing import Any

from conftest import ProcessPool, add_prompts, make_namespace
from redis.asyncio import Redis
from rollstream.consumer import GroupConsumer
from rollstream.testing.sim import SimConfig, SimEngine
from test_staleness import stop_producers

STEPS = 20
BATCH = 4
MAX_STALENESS = 1


async def _run(redis: Redis, redis_url: str, ns: str, procs: ProcessPool, *, admission: bool) -> dict[str, float]:
    config = SimConfig(seed=4, mean_tokens=16, latency_per_token=0.001, max_running=64)
    async with SimEngine(config) as sim:
        await make_namespace(
            redis, ns, n_samples_per_prompt=2, batch_size=BATCH, max_staleness=MAX_STALENESS,
            admission_control=admission, max_backlog=48,
        )
        await add_prompts(redis, ns, 400)
        procs.producer(redis_url, ns, sim.url, name=f"{ns}-a", concurrency=16)
        totals = {"recycled_stale": 0.0, "staleness_max": 0.0, "staleness_max_seen": 0.0, "committed": 0.0}
        async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer, asyncio.timeout(40):
            for step in range(STEPS):
                batch = await consumer.take(BATCH)
                assert len(batch) == BATCH
                await asyncio.sleep(0.1)  # the "training step": producers keep generating
                await consumer.commit(batch)
                totals["recycled_stale"] += batch.metrics["recycled_stale"]
                totals["staleness_max"] = max(totals["staleness_max"], batch.metrics["staleness_max"])
                totals["staleness_max_seen"] = max(totals["staleness_max_seen"], batch.metrics["staleness_max_seen"])
                totals["committed"] += len(batch)
                sim.state.weight_version = step + 1  # the weight update reaches the engine...
                await consumer.set_weight_version(step + 1)  # ... and the trainer records it
        await stop_producers(procs)
    return totals


async def test_admission_control_prevents_stale_groups(
    redis: Redis, redis_url: str, ns: str, procs: ProcessPool, record_property: Any
) -> None:
    on = await _run(redis, redis_url, f"{ns}-on", procs, admission=True)
    off = await _run(redis, redis_url, f"{ns}-off", procs, admission=False)
    summary = (
        f"{STEPS} steps, batch {BATCH}, max_staleness {MAX_STALENESS}: recycled stale with admission control "
        f"{on['recycled_stale']:.0f} (max staleness seen {on['staleness_max_seen']:.0f}), without "
        f"{off['recycled_stale']:.0f} (max staleness seen {off['staleness_max_seen']:.0f})"
    )
    print(summary)
    record_property("recycled_stale_admission_on", on["recycled_stale"])
    record_property("recycled_stale_admission_off", off["recycled_stale"])
    record_property("staleness_max_seen_admission_on", on["staleness_max_seen"])
    record_property("staleness_max_seen_admission_off", off["staleness_max_seen"])
    assert on["committed"] == off["committed"] == STEPS * BATCH
    assert on["staleness_max"] <= MAX_STALENESS and off["staleness_max"] <= MAX_STALENESS  # the filter holds
    assert on["recycled_stale"] <= 2, summary  # (almost) nothing generated that could not be used
    assert off["recycled_stale"] >= 10, summary
    assert off["staleness_max_seen"] > MAX_STALENESS, summary
