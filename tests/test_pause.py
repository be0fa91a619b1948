"""pause() stops admission at once, also while the engine is busy; resume() restarts it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from conftest import ProcessPool, add_prompts, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common.keys import PRODUCERS_GROUP, Keys
from rollstream.consumer import GroupConsumer
from rollstream.testing.sim import SimConfig, SimEngine
from test_staleness import stop_producers


async def _admitted(redis: Redis, keys: Keys) -> int:
    return int(await redis.hget(keys.state, "admitted") or 0)


async def test_pause_stops_admission_at_once_and_resume_restarts_it(
    redis: Redis, redis_url: str, ns: str, procs: ProcessPool, record_property: Any
) -> None:
    config = SimConfig(seed=3, mean_tokens=48, latency_per_token=0.004, max_running=16)
    async with SimEngine(config) as sim:
        await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4, max_backlog=1000)
        keys = Keys(ns)
        await add_prompts(redis, ns, 400)
        procs.producer(redis_url, ns, sim.url, name="pa", concurrency=8)
        procs.producer(redis_url, ns, sim.url, name="pb", concurrency=8)
        async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
            # Both producers busy, the engine generating.
            await wait_until(lambda: sim.state.running >= 8, timeout=20, message="a busy engine")
            await wait_until(_in_flight(redis, keys), timeout=20, message="prompts in flight")
            await consumer.pause()
            paused_at = time.monotonic()
            # Read after pause() returned, however late: from then on ADMIT hands out nothing.
            admitted = await _admitted(redis, keys)
            pending = (await redis.xpending(keys.prompts, PRODUCERS_GROUP))["pending"]
            # Over the next second (and 20 looks at least) nothing new is admitted, though the
            # engine keeps generating.
            published_before = int(await redis.hget(keys.state, "published") or 0)
            samples: list[tuple[int, int]] = []
            while len(samples) < 20 or time.monotonic() - paused_at < 1.0:
                now_admitted = await _admitted(redis, keys)
                now_pending = (await redis.xpending(keys.prompts, PRODUCERS_GROUP))["pending"]
                samples.append((now_admitted, now_pending))
                assert now_admitted == admitted
                assert now_pending <= pending
                await asyncio.sleep(0.02)
            record_property("pause_samples", len(samples))
            # The groups already in flight finish and drain the pending list.
            await wait_until(
                _drained(redis, keys), timeout=20, message="in-flight prompts to finish while paused"
            )
            assert await _admitted(redis, keys) == admitted
            assert int(await redis.hget(keys.state, "published") or 0) >= published_before
            assert await redis.xlen(keys.prompts) > 0  # there was work to admit
            # resume: admission restarts (woken by the control channel).
            await consumer.resume()
            await wait_until(
                lambda: _more_than(redis, keys, admitted), timeout=10, message="admission after resume"
            )
        await stop_producers(procs)


def _in_flight(redis: Redis, keys: Keys) -> Any:
    async def check() -> bool:
        return (await redis.xpending(keys.prompts, PRODUCERS_GROUP))["pending"] > 0

    return check


def _drained(redis: Redis, keys: Keys) -> Any:
    async def check() -> bool:
        return (await redis.xpending(keys.prompts, PRODUCERS_GROUP))["pending"] == 0

    return check


async def _more_than(redis: Redis, keys: Keys, admitted: int) -> bool:
    return await _admitted(redis, keys) > admitted
