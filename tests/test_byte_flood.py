"""A flood of large groups (R3 routing replay) against a byte budget: the groups held in Redis stay
under ``max_backlog_bytes`` the whole run, Redis' dataset memory with them, and nothing is lost."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from conftest import ProcessPool, add_prompts, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common.keys import Keys, StateField
from rollstream.consumer import GroupConsumer
from rollstream.testing.sim.simulator import SimConfig, SimEngine

PROMPTS = 40
BATCH = 4


@pytest.fixture
async def moe_sim() -> AsyncIterator[SimEngine]:
    """~500-token responses with a 48-layer top-8 routing replay: ~190 KiB of R3 a sample."""
    config = SimConfig(seed=5, mean_tokens=500, length_sigma=0.0, latency_per_token=0.0002, moe=(48, 8, 128))
    async with SimEngine(config) as engine:
        yield engine


@pytest.mark.slow
async def test_a_flood_of_large_groups_stays_under_the_byte_budget(
    redis: Redis, redis_url: str, ns: str, moe_sim: SimEngine, procs: ProcessPool
) -> None:
    budget = 4 * 1024 * 1024
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=BATCH, max_backlog=1000,
                         max_backlog_bytes=budget)
    keys = Keys(ns)
    base = await _dataset(redis)
    await add_prompts(redis, ns, PROMPTS)
    for i in range(2):
        procs.producer(redis_url, ns, moe_sim.url, "--routed-experts", "48x8x128", "--max-new-tokens", "600",
                       name=f"flood-{i}", concurrency=4)
    peak = {"held": 0, "dataset": 0}
    stop = asyncio.Event()

    async def watch() -> None:
        while not stop.is_set():
            held = int(await redis.hget(keys.state, StateField.GROUP_BYTES) or 0)
            dataset = await _dataset(redis) - base
            peak["held"] = max(peak["held"], held)
            peak["dataset"] = max(peak["dataset"], dataset)
            await asyncio.sleep(0.01)

    taken = []
    async with asyncio.TaskGroup() as tasks:
        watcher = tasks.create_task(watch())
        async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
            for _ in range(PROMPTS // BATCH):
                # a slow trainer: the producers run into the budget before every take
                await wait_until(
                    lambda: _refused(redis, keys), timeout=60, message="admission refused at the byte budget"
                )
                async with asyncio.timeout(60):
                    batch = await consumer.take(BATCH)
                taken.extend(g.index for g in batch.groups)
                assert all(s.routed_experts is not None for g in batch.groups for s in g.samples)
                await consumer.commit(batch)
        stop.set()
        await watcher
    assert sorted(taken) == list(range(PROMPTS))  # nothing lost, nothing doubled
    state = await redis.hgetall(keys.state)
    assert int(state.get(b"dead_lettered", 0)) == 0
    mean = int(state[StateField.PUBLISHED_BYTES.encode()]) // int(state[b"published"])
    assert mean > 700 * 1024 // 2  # the groups were large (R3): ~190 KiB a sample
    assert peak["held"] <= budget, peak
    # Redis' own memory: the budget, jemalloc's rounding of each large entry up to its size class
    # (at most 25 % above the request for allocations this size) and the rest of the namespace
    assert peak["dataset"] <= budget * 1.25 + 1024 * 1024, peak
    assert int(state[StateField.GROUP_BYTES.encode()]) == 0


async def _dataset(redis: Redis) -> int:
    """Redis' dataset memory, ``used_memory - used_memory_overhead`` as signed numbers (Redis'
    own ``used_memory_dataset`` is unsigned and wraps when the overhead is momentarily larger)."""
    info = await redis.info("memory")
    return max(0, int(info["used_memory"]) - int(info["used_memory_overhead"]))


async def _refused(redis: Redis, keys: Keys) -> bool:
    """Some producer reports the byte-budget refusal (or every prompt is already out)."""
    beats = await redis.hgetall(keys.producers)
    refused = any(b'"backlog_bytes"' in raw for raw in beats.values())
    return refused or (await redis.xlen(keys.prompts)) == 0
