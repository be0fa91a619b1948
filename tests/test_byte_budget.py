"""Memory bounded in bytes: the group-size ledger, ADMIT's byte budget, the per-group size limit
and the ``init`` checks of Redis' maxmemory and maxmemory-policy (real redis-server)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from conftest import add_prompts, make_namespace
from redis.asyncio import Redis
from rollstream.common.codec import group_fields, group_too_large
from rollstream.common.config import PipelineConfig
from rollstream.common.errors import ConfigError
from rollstream.common.keys import PRODUCERS_GROUP, TRAINER_GROUP, Keys, StateField
from rollstream.common.models import Group, Sample, Status
from rollstream.common.namespace import init_namespace, memory_problem
from rollstream.common.protocol import GroupQueue, PromptQueue
from rollstream.consumer import GroupConsumer


def _group(index: int, tokens: int = 1000, status: Status = Status.COMPLETED, n: int = 2) -> Group:
    samples = [
        Sample(index=i, tokens=list(range(10 + tokens)), response_length=tokens, rollout_log_probs=[-0.5] * tokens,
               loss_mask=[1] * tokens, status=status, weight_versions=[0])
        for i in range(n)
    ]
    return Group(index=index, prompt="p", samples=samples)


async def _ledger(redis: Redis, keys: Keys) -> tuple[int, dict[bytes, int]]:
    held = int(await redis.hget(keys.state, StateField.GROUP_BYTES) or 0)
    sizes = {k: int(v) for k, v in (await redis.hgetall(keys.group_bytes)).items()}
    return held, sizes


async def _stream_bytes(redis: Redis, keys: Keys) -> dict[bytes, int]:
    return {eid: len(fields[b"data"]) for eid, fields in await redis.xrange(keys.groups)}


async def _publish(redis: Redis, keys: Keys, queue: PromptQueue, group: Group) -> bytes:
    admitted = await queue.admit(_config())
    assert admitted.status == "ok", admitted
    item = admitted.entries[0]
    gid = await queue.publish(item.stream, item.entry_id, group_fields(group))
    assert gid is not None
    return gid


async def test_the_ledger_follows_every_group_in_and_out_of_the_stream(redis: Redis, redis_url: str, ns: str) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2)
    keys = Keys(ns)
    await add_prompts(redis, ns, 7)
    queue = PromptQueue(redis, keys, "p1")
    for i, group in enumerate([_group(0), _group(1, 2000), _group(2, 500, Status.ABORTED), _group(3, 300, n=3),
                               _group(4, 700), _group(5, 900)]):
        await _publish(redis, keys, queue, group)
        held, sizes = await _ledger(redis, keys)
        assert sizes == await _stream_bytes(redis, keys) and held == sum(sizes.values()), i
    entries = await redis.xrange(keys.groups)
    assert all(int(f[b"bytes"]) == len(f[b"data"]) for _, f in entries)  # readable in redis-cli
    published = sum(len(f[b"data"]) for _, f in entries)
    assert int(await redis.hget(keys.state, StateField.PUBLISHED_BYTES)) == published
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        async with asyncio.timeout(20):
            batch = await consumer.take(3)  # the aborted group is recycled, the 3-sample one dead-lettered
        held, sizes = await _ledger(redis, keys)
        assert sizes == await _stream_bytes(redis, keys) and held == sum(sizes.values())
        await consumer.commit(batch)
        held, sizes = await _ledger(redis, keys)
        assert sizes == await _stream_bytes(redis, keys) and held == sum(sizes.values())
        assert len(sizes) == 1
    await _publish(redis, keys, queue, _group(6))
    # release-trainer moves a gone trainer's groups back: the ledger moves with them
    await redis.xreadgroup(TRAINER_GROUP, "gone", {keys.groups: ">"}, count=1)
    assert await GroupQueue(redis, keys, "gone").release() == 1
    held, sizes = await _ledger(redis, keys)
    assert sizes == await _stream_bytes(redis, keys) and held == sum(sizes.values()) and len(sizes) == 2
    # a delivered group gone from the stream (XDEL by hand) leaves the ledger when found
    (first, _), = await redis.xrange(keys.groups, count=1)
    async with await GroupConsumer.connect(redis_url, ns, "trainer2") as consumer:
        await redis.xreadgroup(TRAINER_GROUP, "trainer2", {keys.groups: ">"}, count=2)
        await redis.xdel(keys.groups, first)
        async with asyncio.timeout(20):
            batch = await consumer.take(1)
        await consumer.commit(batch)
    assert await _ledger(redis, keys) == (0, {})


def _config(budget: int = 0) -> PipelineConfig:
    """What ADMIT reads: a backlog cap of 1000 groups, no staleness rule, ``budget`` bytes."""
    return PipelineConfig(n_samples_per_prompt=1, batch_size=1, max_backlog=1000, max_backlog_bytes=budget)


async def _admit(queue: PromptQueue, budget: int, count: int = 1) -> Any:
    return await queue.admit(_config(budget), count)


async def test_admit_refuses_at_the_byte_budget_only_while_groups_are_ready(redis: Redis, ns: str) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2)
    keys = Keys(ns)
    await add_prompts(redis, ns, 10)
    queue = PromptQueue(redis, keys, "p1")
    g1 = await _publish(redis, keys, queue, _group(0))
    size = (await _ledger(redis, keys))[1][g1]
    # one group ready, held = size: a budget of 2.5 groups admits one more (at the mean size),
    # then the one in flight counts
    budget = 5 * size // 2
    first = await _admit(queue, budget, count=5)
    assert first.status == "ok" and len(first.entries) == 1
    refused = await _admit(queue, budget)
    assert refused.status == "backlog_bytes" and refused.terms == [2 * size, budget]
    # the trainer takes the ready group: nothing ready, the budget does not refuse (a take() larger
    # than the budget must be able to finish)
    await redis.xreadgroup(TRAINER_GROUP, "trainer", {keys.groups: ">"}, count=10)
    assert (await _admit(queue, size)).status == "ok"
    # no budget: no byte refusal
    assert (await _admit(queue, 0)).status == "ok"


def test_group_too_large_names_the_setting() -> None:
    fields = group_fields(_group(0))
    size = len(fields["data"])
    assert group_too_large(fields, size) is None
    reason = group_too_large(fields, size - 1)
    assert reason is not None and reason.startswith("group_too_large:") and "max_group_bytes" in reason


def test_memory_problem_rules() -> None:
    assert memory_problem(0, "noeviction", 10**6, 0, 10**9) is None  # no maxmemory: nothing to compare
    why = memory_problem(0, "allkeys-lru", 0, 0, 0)
    assert why is not None and "maxmemory-policy" in why and "allkeys-lru" in why
    assert memory_problem(10**9, "noeviction", 10**8, 0, 7 * 10**8) is None
    why = memory_problem(10**9, "noeviction", 10**8, 0, 8 * 10**8)
    assert why is not None and "does not fit" in why and "maxmemory" in why
    # this namespace's own held groups do not count against it on re-init
    assert memory_problem(10**9, "noeviction", 3 * 10**8, 2 * 10**8, 7 * 10**8) is None


@pytest.fixture
async def redis_config(redis: Redis) -> AsyncIterator[Redis]:
    """The session's redis-server with its memory settings restored afterwards."""
    saved = await redis.config_get("maxmemory*")
    try:
        yield redis
    finally:
        await redis.config_set("maxmemory-policy", saved["maxmemory-policy"])
        await redis.config_set("maxmemory", saved["maxmemory"])


async def test_init_refuses_an_evicting_policy_and_a_budget_over_maxmemory(redis_config: Redis, ns: str) -> None:
    redis = redis_config
    keys = Keys(ns)
    cfg = PipelineConfig(n_samples_per_prompt=2, batch_size=2, max_backlog_bytes=64 * 1024 * 1024)
    await redis.config_set("maxmemory-policy", "allkeys-lru")
    with pytest.raises(ConfigError, match="maxmemory-policy is 'allkeys-lru'"):
        await init_namespace(redis, keys, cfg)
    await redis.config_set("maxmemory-policy", "volatile-ttl")
    with pytest.raises(ConfigError, match="maxmemory-policy"):
        await init_namespace(redis, keys, cfg)
    await redis.config_set("maxmemory-policy", "noeviction")
    used = int((await redis.info("memory"))["used_memory"])
    await redis.config_set("maxmemory", used + 32 * 1024 * 1024)
    with pytest.raises(ConfigError, match="max_backlog_bytes 67108864 does not fit in Redis maxmemory"):
        await init_namespace(redis, keys, cfg)
    assert not await redis.exists(keys.config)  # nothing written
    await redis.config_set("maxmemory", used + 256 * 1024 * 1024)
    assert await init_namespace(redis, keys, cfg)
    assert (await redis.xinfo_groups(keys.prompts))[0]["name"] == PRODUCERS_GROUP.encode()



async def test_a_budget_over_maxmemory_is_fine_with_a_payload_store(redis_config: Redis, ns: str, tmp_path: Path) -> None:
    """With a payload store the budget counts the store's bytes, not Redis': a 1 TiB budget on a
    small Redis is what such a namespace is for (an evicting policy is still refused)."""
    redis = redis_config
    store = PipelineConfig(n_samples_per_prompt=2, batch_size=2, max_backlog_bytes=1 << 40,
                           payload_store=f"fs://{tmp_path}")
    used = int((await redis.info("memory"))["used_memory"])
    await redis.config_set("maxmemory", used + 32 * 1024 * 1024)
    assert await init_namespace(redis, Keys(ns), store)
    await redis.config_set("maxmemory-policy", "allkeys-lru")
    with pytest.raises(ConfigError, match="maxmemory-policy is 'allkeys-lru'"):
        await init_namespace(redis, Keys(f"{ns}-b"), store)




async def test_inspect_shows_the_bytes_held_against_the_budget(redis: Redis, redis_url: str, ns: str) -> None:
    from rollstream.ops.snapshot import snapshot
    from test_inspect import run_inspect

    await make_namespace(redis, ns, max_backlog_bytes=3 * 1024 * 1024)
    keys = Keys(ns)
    await add_prompts(redis, ns, 2)
    queue = PromptQueue(redis, keys, "p1")
    await _publish(redis, keys, queue, _group(0))
    await _publish(redis, keys, queue, _group(1))
    held, sizes = await _ledger(redis, keys)
    groups = (await snapshot(redis, keys))["groups"]
    assert groups["bytes"] == held == sum(sizes.values()) > 0
    assert groups["bytes_budget"] == 3 * 1024 * 1024 and groups["mean_group_bytes"] == held // 2
    _, text = await run_inspect(redis_url, ns)
    assert f"bytes {held / 1024:.1f} KiB of 3.0 MiB budget" in text, text
