"""What the trainer cannot train on is recycled (or dropped, or dead-lettered), and counted.

Groups are published straight into the groups stream where the test needs exact versions or
rewards; real producer processes against the engine simulator where the path through the
producer matters (a recycled prompt comes back, a poison prompt keeps failing).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from conftest import ProcessPool, add_prompts, make_namespace
from redis.asyncio import Redis
from rollstream.common.codec import decode_prompt_entry, group_fields
from rollstream.common.keys import Keys
from rollstream.common.models import Group, Sample, Status
from rollstream.consumer import GroupConsumer, reward_variance


def _group(
    index: int,
    versions: list[int],
    *,
    rewards: tuple[float, ...] = (0.0, 1.0),
    status: Status = Status.COMPLETED,
    attempt: int = 0,
) -> Group:
    samples = [
        Sample(
            index=i,
            tokens=[1, 2, 3, 4, 5],
            response="xy",
            response_length=2,
            reward=reward,
            status=status,
            finish_reason="abort" if status == Status.ABORTED else "stop",
            weight_versions=list(versions),
        )
        for i, reward in enumerate(rewards)
    ]
    return Group(index=index, prompt=f"Compute {index} + 1.", samples=samples, label=str(index + 1), attempt=attempt)


async def stop_producers(procs: ProcessPool) -> None:
    """SIGTERM the producers and let them drain while the in-process simulator keeps answering."""
    await procs.astop_all()


async def _publish(redis: Redis, ns: str, group: Group) -> None:
    await redis.xadd(Keys(ns).groups, group_fields(group))


async def _prompts(redis: Redis, ns: str) -> list[Any]:
    """The recycled prompts (the retry stream, served before fresh prompts)."""
    return [decode_prompt_entry(fields) for _, fields in await redis.xrange(Keys(ns).retry)]


async def _state(redis: Redis, ns: str) -> dict[str, str]:
    raw = await redis.hgetall(Keys(ns).state)
    return {k.decode(): v.decode() for k, v in raw.items()}


async def test_stale_group_is_recycled_and_the_batch_is_still_full(redis: Redis, redis_url: str, ns: str) -> None:
    await make_namespace(redis, ns, max_staleness=2, staleness_rule="oldest_token")
    await _publish(redis, ns, _group(0, [9]))
    await _publish(redis, ns, _group(1, [5]))  # staleness 10 - 5 = 5 > 2
    await _publish(redis, ns, _group(2, [8, 10]))  # oldest version 8: staleness 2, allowed
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        await consumer.set_weight_version(10)
        async with asyncio.timeout(15):
            batch = await consumer.take(2)
        assert len(batch) == 2
        assert [g.index for g in batch.groups] == [0, 2]
        assert batch.metrics["groups"] == 2
        assert batch.metrics["recycled_stale"] == 1
        assert batch.metrics["staleness_max"] == 2  # over the batch
        assert batch.metrics["staleness_max_seen"] == 5  # the recycled group included
        assert batch.metrics["staleness_mean"] == 1.5
        await consumer.commit(batch)
    (prompt,) = await _prompts(redis, ns)
    # Staleness is not the prompt's fault: the attempt is not used up, the reason is recorded.
    assert (prompt.index, prompt.attempt, prompt.partial) == (1, 0, None)
    assert prompt.history == ["stale: staleness 5 > 2"]
    assert (await _state(redis, ns))["recycled_stale"] == "1"
    assert await redis.xlen(Keys(ns).groups) == 0


@pytest.mark.parametrize("rule", ["newest_token", "oldest_token"])
async def test_a_continued_generation_is_judged_by_its_newest_token_not_its_length(
    redis: Redis, redis_url: str, ns: str, rule: str
) -> None:
    """A group holding a long generation continued across weight updates (versions 6 to 10, 100
    tokens: 10 at 6, 90 at 10) is not stale under the default rule (it was finished at the
    trainer's version), is under the strict one (its oldest token lags 4 > 2); a group whose
    newest token lags past the limit is stale under both. The batch reports the tokens' lags."""
    await make_namespace(redis, ns, max_staleness=2, staleness_rule=rule)
    long = _group(0, [6, 10])
    long.samples = [
        Sample(index=s.index, tokens=list(range(103)), response="x" * 100, response_length=100, prompt_length=3,
               reward=s.reward, finish_reason="stop", weight_versions=[6, 10],
               weight_version_spans=[(0, 10, 6), (10, 100, 10)], rollout_log_probs=[-0.5] * 100, loss_mask=[1] * 100)
        for s in long.samples
    ]
    await _publish(redis, ns, long)
    await _publish(redis, ns, _group(1, [5, 7]))  # its newest token lags 3 > 2: stale under both
    await _publish(redis, ns, _group(2, [10]))
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        await consumer.set_weight_version(10)
        async with asyncio.timeout(15):
            batch = await consumer.take(1 if rule == "oldest_token" else 2)
        await consumer.commit(batch)
    recycled = [p.index for p in await _prompts(redis, ns)]
    if rule == "newest_token":
        assert [g.index for g in batch.groups] == [0, 2] and recycled == [1]
        assert batch.metrics["staleness_max"] == 0
        assert batch.metrics["token_lag_max"] == 4
        assert batch.metrics["token_lag_mean"] == pytest.approx(2 * 10 * 4 / (2 * 100 + 2 * 2))
        lags = batch.token_lags_numpy()
        assert lags[0] is not None and lags[0].tolist() == [4] * 10 + [0] * 90
        assert lags[2] is not None and lags[2].tolist() == [0, 0]
    else:
        assert [g.index for g in batch.groups] == [2] and recycled == [0, 1]


def test_a_reply_whose_version_moved_at_an_unknown_point_is_judged_by_the_older_version() -> None:
    """A reply during which the engine's version moved, with nothing to say where, records both
    versions (oldest first, ``weight_version_split: unknown``): its tokens may all predate the
    update, so the default rule judges it by the older one too; a known split by its newest."""
    unknown = _group(0, [6, 10])
    for sample in unknown.samples:
        sample.metadata["weight_version_split"] = "unknown"
    assert unknown.staleness(10, "newest_token") == 4
    assert unknown.staleness(10, "oldest_token") == 4
    assert _group(1, [6, 10]).staleness(10, "newest_token") == 0


async def test_take_overrides_max_staleness(redis: Redis, redis_url: str, ns: str) -> None:
    await make_namespace(redis, ns, max_staleness=2)
    await _publish(redis, ns, _group(0, [5]))
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        await consumer.set_weight_version(10)
        async with asyncio.timeout(15):
            batch = await consumer.take(1, max_staleness=None)
    assert batch.metrics["recycled_stale"] == 0 and batch.metrics["staleness_max"] == 5


async def test_aborted_group_is_recycled_reset_and_comes_back(
    redis: Redis, redis_url: str, ns: str, sim: Any, procs: ProcessPool
) -> None:
    await make_namespace(redis, ns, max_staleness=3, partial_rollout=False)
    await _publish(redis, ns, _group(7, [0], status=Status.ABORTED))
    await _publish(redis, ns, _group(8, [0]))
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        async with asyncio.timeout(15):
            first = await consumer.take(1)
        assert [g.index for g in first.groups] == [8]
        assert first.metrics["recycled_aborted"] == 1
        await consumer.commit(first)
        # Reset: no partial samples (partial rollout is off), the next attempt starts from scratch.
        (prompt,) = await _prompts(redis, ns)
        assert (prompt.index, prompt.attempt, prompt.partial) == (7, 1, None)
        assert prompt.history == ["aborted"]
        sim.state.weight_version = 1
        await consumer.set_weight_version(1)
        procs.producer(redis_url, ns, sim.url)
        async with asyncio.timeout(25):
            second = await consumer.take(1)
        (group,) = second.groups
        assert (group.index, group.attempt, group.status) == (7, 1, Status.COMPLETED)
        for sample in group.samples:
            assert sample.weight_versions == [1]
            assert "continued_from" not in sample.metadata
            assert sample.response != "xy"
        await consumer.commit(second)
    await stop_producers(procs)
    assert (await _state(redis, ns))["recycled_aborted"] == "1"


async def test_poison_prompt_is_dead_lettered_after_max_attempts(
    redis: Redis, redis_url: str, ns: str, sim: Any, procs: ProcessPool
) -> None:
    """POISON -> HTTP 400 -> FAILED samples -> recycled max_attempts times -> dead letter, loudly."""
    await make_namespace(redis, ns, max_attempts=2)
    keys = Keys(ns)
    await add_prompts(redis, ns, 1, start=0, text="POISON: compute 1 + 1")

    async def feeder() -> None:  # keeps a few good prompts queued, as the real feeder would
        index = 1
        while True:
            if await redis.xlen(keys.prompts) < 4:
                await add_prompts(redis, ns, 2, start=index)
                index += 2
            await asyncio.sleep(0.02)

    feeding = asyncio.create_task(feeder())
    producer = procs.producer(redis_url, ns, sim.url)
    recycled_failed = 0
    indexes: list[int] = []
    try:
        async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer, asyncio.timeout(25):
            while await redis.xlen(keys.dead) == 0:
                batch = await consumer.take(2)
                recycled_failed += int(batch.metrics["recycled_failed"])
                indexes += [g.index for g in batch.groups]
                await consumer.commit(batch)
            # The pipeline goes on: other groups keep arriving after the dead letter.
            before = len(indexes)
            for _ in range(2):
                batch = await consumer.take(2)
                indexes += [g.index for g in batch.groups]
                await consumer.commit(batch)
    finally:
        feeding.cancel()
        await stop_producers(procs)
    assert 0 not in indexes and len(indexes) == before + 4
    assert recycled_failed == 2
    (dead,) = await redis.xrange(keys.dead)
    fields = dead[1]
    reason = fields[b"reason"].decode()
    # dead-lettered by the producer that ran the attempt past max_attempts (issue 32): its group
    # never reached the backlog
    assert fields[b"source"] == b"prompts" and fields[b"index"] == b"0"
    assert reason.startswith("max_attempts: recycled 3 times (> 2)") and "failed:" in reason and "POISON" in reason
    assert decode_prompt_entry(fields).history[-1].startswith("failed:")
    state = await _state(redis, ns)
    assert state["recycled_failed"] == "2" and state["dead_lettered"] == "1"
    warnings = [line for line in procs.log_of(producer).splitlines() if "dead-lettered after" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0] and "prompt 0 " in warnings[0], procs.logs()


async def test_filter_drops_zero_variance_groups_without_recycling(redis: Redis, redis_url: str, ns: str) -> None:
    await make_namespace(redis, ns)
    await _publish(redis, ns, _group(0, [0], rewards=(1.0, 1.0)))
    await _publish(redis, ns, _group(1, [0], rewards=(0.0, 1.0)))
    await _publish(redis, ns, _group(2, [0], rewards=(0.0, 0.0)))
    await _publish(redis, ns, _group(3, [0], rewards=(1.0, 0.0)))
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        async with asyncio.timeout(15):
            batch = await consumer.take(2, keep=reward_variance)
        await consumer.commit(batch)
    assert [g.index for g in batch.groups] == [1, 3]
    assert batch.metrics["filtered"] == 2
    assert batch.metrics["filtered/zero_variance"] == 2
    assert batch.metrics["recycled_filtered"] == 0
    assert await redis.xlen(Keys(ns).prompts) == await redis.xlen(Keys(ns).retry) == 0  # dropped, not recycled
    assert await redis.xlen(Keys(ns).groups) == 0
    state = await _state(redis, ns)
    assert state["filtered"] == "2" and state["filtered:zero_variance"] == "2"
    assert "recycled_filtered" not in state


async def test_filter_recycles_with_recycle_filtered(redis: Redis, redis_url: str, ns: str) -> None:
    await make_namespace(redis, ns, recycle_filtered=True)
    await _publish(redis, ns, _group(0, [0], rewards=(1.0, 1.0)))
    await _publish(redis, ns, _group(1, [0], rewards=(0.0, 1.0)))
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        async with asyncio.timeout(15):
            batch = await consumer.take(1, keep=reward_variance)
        await consumer.commit(batch)
    assert [g.index for g in batch.groups] == [1]
    assert batch.metrics["filtered/zero_variance"] == 1
    assert batch.metrics["recycled_filtered"] == 1
    (prompt,) = await _prompts(redis, ns)
    assert (prompt.index, prompt.attempt, prompt.partial) == (0, 1, None)
    assert prompt.history == ["filtered: zero_variance"]
    state = await _state(redis, ns)
    assert state["recycled_filtered"] == "1" and "filtered" not in state


def test_reward_variance_verdicts() -> None:
    assert reward_variance(_group(0, [0], rewards=(0.5, 0.5))) == "zero_variance"
    assert reward_variance(_group(0, [0], rewards=(0.0, 1.0))) is True
    assert reward_variance(_group(0, [0], rewards=(math.nan, math.nan))) is True  # unscored: not judged


async def test_a_prompt_stale_on_its_own_again_and_again_is_dead_lettered_not_one_stale_with_all(
    redis: Redis, redis_url: str, ns: str
) -> None:
    """The one loop staleness can make for a single prompt (its generation always outlasts the
    window while other groups are fresh): after MAX_STALE_RECYCLES stale recycles in a row it is
    dead-lettered. Recycles marked as made while every group went stale (the pipeline's fault)
    never count, and neither attempt is used up."""
    from rollstream.consumer.group_consumer import ALL_STALE_MARK, MAX_STALE_RECYCLES

    await make_namespace(redis, ns, max_staleness=1, max_attempts=2)
    alone = _group(1, [0])
    alone.history = ["stale: staleness 3 > 1"] * (MAX_STALE_RECYCLES - 1)
    with_all = _group(2, [0])
    with_all.history = [f"stale: staleness 3 > 1{ALL_STALE_MARK}"] * (MAX_STALE_RECYCLES - 1)
    await _publish(redis, ns, _group(0, [3]))
    await _publish(redis, ns, alone)
    await _publish(redis, ns, _group(3, [3]))
    await _publish(redis, ns, with_all)
    await _publish(redis, ns, _group(4, [3]))
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        await consumer.set_weight_version(3)
        async with asyncio.timeout(15):
            batch = await consumer.take(3)
        assert [g.index for g in batch.groups] == [0, 3, 4]
        assert batch.metrics["recycled_stale"] == 1 and batch.metrics["dead_lettered"] == 1
        await consumer.commit(batch)
    [(_, dead)] = await redis.xrange(Keys(ns).dead)
    assert int(dead[b"index"]) == 1 and dead[b"reason"].startswith(b"stale_recycles: recycled as stale 20 times")
    (prompt,) = await _prompts(redis, ns)
    assert (prompt.index, prompt.attempt) == (2, 0) and prompt.history[-1] == "stale: staleness 3 > 1"
