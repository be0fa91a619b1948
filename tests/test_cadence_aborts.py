"""The pipeline's cadence never costs a prompt an attempt (issue 38, DESIGN §4.17): an abort by a
weight update (``WeightSync.update(mode="abort")``) is recycled and written in the prompt's
history with its attempt kept; an abort the engine makes on its own still uses one."""

from __future__ import annotations

import asyncio

import httpx
from conftest import ProcessPool, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream import WeightSync
from rollstream.common.attempts import WEIGHT_UPDATE_REASON
from rollstream.common.codec import prompt_fields
from rollstream.common.keys import Keys
from rollstream.common.models import Prompt
from rollstream.consumer import GroupConsumer
from rollstream.testing.sim import SimConfig, SimEngine

LONG = "What is 2 + 3? [reply=200]"
"""200 tokens at 10 ms each: 2 s, long enough for several weight updates to fall on it."""


async def _state(redis: Redis, keys: Keys, field: str) -> int:
    return int(await redis.hget(keys.state, field) or 0)


async def _abort_while_generating(redis: Redis, keys: Keys, sim: SimEngine, counter: str, times: int, abort) -> None:  # type: ignore[no-untyped-def]
    """``times`` rounds of: wait until the long prompt's two samples are generating, ``abort``
    them, wait until the trainer recycled the group (``counter`` went up)."""
    for round_ in range(1, times + 1):
        await wait_until(lambda: sim.state.running >= 2, message=f"the long prompt generating (round {round_})")
        await abort(round_)
        await wait_until(lambda r=round_: _state_at_least(redis, keys, counter, r), message=f"{counter} >= {round_}")


async def _state_at_least(redis: Redis, keys: Keys, field: str, value: int) -> bool:
    return await _state(redis, keys, field) >= value


async def test_weight_updates_with_abort_never_use_up_a_long_prompts_attempts(
    redis: Redis, redis_url: str, ns: str, procs: ProcessPool
) -> None:
    keys = Keys(ns)
    async with SimEngine(SimConfig(seed=1, latency_per_token=0.01, length_sigma=0)) as sim:
        # max_attempts 1: before issue 38 the second abort dead-lettered the prompt
        await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=1, max_attempts=1,
                             partial_rollout=False)
        await redis.xadd(keys.prompts, prompt_fields(Prompt(index=0, prompt=LONG, label="5")))  # type: ignore[arg-type]
        procs.producer(redis_url, ns, sim.url, name="p0", concurrency=2)
        async with (
            await GroupConsumer.connect(redis_url, ns, "trainer") as consumer,
            WeightSync([sim.url], kind="sglang") as sync,
        ):
            take = asyncio.create_task(consumer.take(1))  # recycles every aborted group as it comes

            async def update(version: int) -> None:
                await sync.update(consumer, f"/weights/{version}", version, mode="abort")

            await _abort_while_generating(redis, keys, sim, "recycled_weight_update", 3, update)
            async with asyncio.timeout(60):
                batch = await take  # no more updates: the fourth attempt runs to the end
            await consumer.commit(batch)
    [group] = batch.groups
    assert group.index == 0 and group.attempt == 0, group.history
    assert group.history.count(WEIGHT_UPDATE_REASON) == 3, group.history
    assert all(s.response_length == 200 for s in group.samples)
    assert await redis.xlen(keys.dead) == 0
    assert await _state(redis, keys, "recycled_aborted") == 0
    assert await _state(redis, keys, "recycled_weight_update") == 3


async def test_an_abort_the_engine_makes_on_its_own_still_uses_an_attempt(
    redis: Redis, redis_url: str, ns: str, procs: ProcessPool
) -> None:
    """The control: the same prompt, aborted by the engine with no pause and no new weights, is
    dead-lettered past max_attempts (the rule above does not simply forgive every abort)."""
    keys = Keys(ns)
    async with SimEngine(SimConfig(seed=1, latency_per_token=0.01, length_sigma=0)) as sim:
        await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=1, max_attempts=1,
                             partial_rollout=False)
        await redis.xadd(keys.prompts, prompt_fields(Prompt(index=0, prompt=LONG, label="5")))  # type: ignore[arg-type]
        procs.producer(redis_url, ns, sim.url, name="p0", concurrency=2)
        async with (
            await GroupConsumer.connect(redis_url, ns, "trainer") as consumer,
            httpx.AsyncClient(timeout=10) as http,
        ):
            take = asyncio.create_task(consumer.take(1))

            async def abort(_: int) -> None:
                assert (await http.post(sim.url + "/abort_request", json={"abort_all": True})).status_code == 200

            await _abort_while_generating(redis, keys, sim, "recycled_aborted", 1, abort)
            await wait_until(lambda: sim.state.running >= 2, message="the second attempt generating")
            await abort(2)
            await wait_until(lambda: redis.xlen(keys.dead), message="the prompt dead-lettered")
            take.cancel()
            await asyncio.gather(take, return_exceptions=True)
    [(_, fields)] = await redis.xrange(keys.dead)
    assert b"max_attempts" in fields[b"reason"], fields[b"reason"]
    assert await _state(redis, keys, "recycled_weight_update") == 0
