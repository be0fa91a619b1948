"""Hostile inputs on the trainer's side (issue 15): a cancelled take(), a second trainer with the
same name, code named in Redis, garbage values in the namespace's hashes. Real Redis, real
producer processes, exact accounting at the end."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import ProcessPool, add_prompts, make_namespace
from killable_trainer import run_trainer
from redis.asyncio import Redis
from rollstream.common.codec import group_fields
from rollstream.common.keys import PRODUCERS_GROUP, TRAINER_GROUP, Keys
from rollstream.common.models import Group, Sample, Status
from rollstream.consumer import ConsumerNameInUse, GroupConsumer, PipelineStalled
from rollstream.consumer.group_consumer import NAME_LEASE_SECONDS
from rollstream.ops.actions import release_consumer
from rollstream.testing.sim import SimEngine


def _group(index: int, rewards: tuple[float, ...] = (0.0, 1.0)) -> Group:
    samples = [
        Sample(index=i, tokens=[1, 2, 3, 4, 5], response="xy", response_length=2, reward=reward,
               status=Status.COMPLETED, finish_reason="stop", weight_versions=[0])
        for i, reward in enumerate(rewards)
    ]
    return Group(index=index, prompt=f"Compute {index} + 1.", samples=samples, label=str(index + 1))


async def _counter(redis: Redis, ns: str, name: str) -> int:
    return int(await redis.hget(Keys(ns).state, name) or 0)


async def test_cancelled_takes_strand_nothing(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    """50-80 cancellations at random points (asyncio.timeout and bare cancel after k loop turns),
    against two real producers: every group is committed exactly once, none is stranded. How
    many cancellations land before their take returns depends on the machine's speed: prompts
    are fed 200 at first, then 50 more at a time until 50 cancellations landed."""
    prompts = 200
    await make_namespace(redis, ns, max_backlog=16)
    await add_prompts(redis, ns, prompts)
    procs.producer(redis_url, ns, sim.url, name="prod-a", concurrency=4)
    procs.producer(redis_url, ns, sim.url, name="prod-b", concurrency=4)
    rng = random.Random(15)
    committed: Counter[int] = Counter()
    cancellations = 0
    late: list[float] = []
    typical = 0.005
    async with GroupConsumer.connect(redis_url, ns, "trainer-c", stall_timeout=60) as consumer:
        deadline = time.monotonic() + 300
        while sum(committed.values()) < prompts or cancellations < 50:
            assert time.monotonic() < deadline, f"stuck at {sum(committed.values())} committed\n{procs.logs()}"
            if sum(committed.values()) == prompts:  # all taken, too few cancellations landed yet
                await add_prompts(redis, ns, 50, start=prompts)
                prompts += 50
            target = min(2, prompts - sum(committed.values()))
            started = time.monotonic()
            task = asyncio.create_task(consumer.take(target))
            if cancellations < 80 and rng.random() < 0.9:
                if rng.random() < 0.3:
                    for _ in range(rng.randrange(1, 16)):
                        await asyncio.sleep(0)
                else:  # anywhere within the duration of an uncancelled take
                    await asyncio.sleep(rng.uniform(0, typical))
                task.cancel()
            cancelled_at = time.monotonic()
            try:
                batch = await asyncio.wait_for(task, 30)
            except asyncio.CancelledError:
                cancellations += 1
                late.append(time.monotonic() - cancelled_at)
                continue
            typical = 0.8 * typical + 0.2 * (time.monotonic() - started)
            assert await consumer.commit(batch) == len(batch)
            committed.update(g.index for g in batch.groups)
        # the recommended pattern itself, on an empty stream: ends on time, holds nothing
        for _ in range(5):
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await consumer.take(1)
            # Ends with its timeout, not after a blocking read or never (slack for a loaded machine).
            assert time.monotonic() - started < 5
    assert cancellations >= 50
    assert max(late) < 1.0, f"a cancelled take() ran on for {max(late):.2f} s"
    assert committed == Counter(range(prompts)), "every group committed exactly once"
    keys = Keys(ns)
    assert await _counter(redis, ns, "committed") == prompts
    assert await _counter(redis, ns, "dead_lettered") == 0
    assert await redis.xlen(keys.groups) == 0
    assert (await redis.xpending(keys.groups, TRAINER_GROUP))["pending"] == 0
    assert (await redis.xpending(keys.prompts, PRODUCERS_GROUP))["pending"] == 0


async def test_stalled_fires_when_every_take_is_short(redis: Redis, redis_url: str, ns: str) -> None:
    """No producer at all, take() always cut at 0.3 s (shorter than one blocking read):
    PipelineStalled still comes, since the clock is the consumer's, not the call's."""
    await make_namespace(redis, ns)
    async with GroupConsumer.connect(redis_url, ns, "trainer-s", stall_timeout=1.5) as consumer:
        started = time.monotonic()
        with pytest.raises(PipelineStalled):
            while time.monotonic() - started < 15:
                try:
                    async with asyncio.timeout(0.3):
                        await consumer.take(4)
                except TimeoutError:
                    continue
        assert time.monotonic() - started < 12  # stall_timeout 1.5 s; the loop gives up at 15 s


async def test_code_named_in_redis_is_never_imported(
    redis: Redis, redis_url: str, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """`HSET config keep sys:exit` used to kill every trainer at connect; now it is ignored (with a
    warning), and the filter is what the trainer's own code passes."""
    await make_namespace(redis, ns)
    keys = Keys(ns)
    await redis.hset(keys.config, "keep", "sys:exit")
    await redis.hset(keys.config, "recycle_filtered", "os:system")  # a bool field: just "not 1"
    for index in range(4):
        await redis.xadd(keys.groups, group_fields(_group(index, (0.0, 1.0) if index % 2 else (1.0, 1.0))))
    def only_varied(group: Group) -> bool:
        return len({s.reward for s in group.samples}) > 1

    async with GroupConsumer.connect(redis_url, ns, "trainer-k") as plain:
        assert plain.keep is None
        batch = await plain.take(2)
        assert await plain.commit(batch) == 2
    assert "never loaded from Redis" in caplog.text
    async with GroupConsumer.connect(redis_url, ns, "trainer-k2", keep=only_varied) as filtered:
        batch = await filtered.take(1)
        assert batch.metrics["filtered"] == 1 and await filtered.commit(batch) == 1
    assert await _counter(redis, ns, "committed") == 3 and await _counter(redis, ns, "filtered") == 1


async def test_one_live_trainer_per_consumer_name(redis: Redis, redis_url: str, ns: str, tmp_path: Path) -> None:
    """A second trainer under a live trainer's name is refused; a SIGKILLed holder's name frees
    itself within the lease, and the next trainer gets its batch back: 4 groups, each committed once."""
    await make_namespace(redis, ns)
    keys = Keys(ns)
    for index in range(4):
        await redis.xadd(keys.groups, group_fields(_group(index)))
    first, taken = await asyncio.to_thread(run_trainer, redis_url, ns, "hang")
    try:
        with pytest.raises(ConsumerNameInUse, match="trainer-k") as refused:
            await GroupConsumer.connect(redis_url, ns, "trainer-k", name_wait=0)
        assert f"pid {first.pid}" in str(refused.value)
        started = time.monotonic()
        with pytest.raises(ConsumerNameInUse):
            await GroupConsumer.connect(redis_url, ns, "trainer-k", name_wait=1)
        assert 0.9 < time.monotonic() - started < 10  # waited name_wait out, then gave up
        first.send_signal(signal.SIGKILL)
        await asyncio.to_thread(first.wait, 10)
        started = time.monotonic()
        async with GroupConsumer.connect(redis_url, ns, "trainer-k") as second:
            assert time.monotonic() - started <= NAME_LEASE_SECONDS + 1
            again = await second.take(2)
            assert again.id == taken["id"] and again.redelivered
            assert await second.commit(again) == 2
            with pytest.raises(ConsumerNameInUse):  # held by `second` now
                await GroupConsumer.connect(redis_url, ns, "trainer-k", name_wait=0)
            with pytest.raises(ConsumerNameInUse, match="release-trainer"):
                await release_consumer(redis, keys, "trainer-k")
        async with GroupConsumer.connect(redis_url, ns, "trainer-k", name_wait=0) as third:  # released on close
            rest = await third.take(2)
            assert await third.commit(rest) == 2
    finally:
        first.kill()
    assert sorted(taken["indexes"] + [g.index for g in rest.groups]) == [0, 1, 2, 3]
    assert await _counter(redis, ns, "committed") == 4
    assert not await redis.exists(keys.consumer_lease("trainer-k"))


async def test_a_trainer_whose_name_was_taken_stops(redis: Redis, redis_url: str, ns: str) -> None:
    """The hold lapsed (e.g. Redis unreachable past the lease) and another trainer took the name:
    the first one's next take() / commit() raises instead of training the same groups."""
    await make_namespace(redis, ns)
    keys = Keys(ns)
    await redis.xadd(keys.groups, group_fields(_group(0)))
    async with GroupConsumer.connect(redis_url, ns, "trainer-l") as consumer:
        batch = await consumer.take(1)
        await redis.set(keys.consumer_lease("trainer-l"), "another host pid 1", px=60_000)
        await asyncio.sleep(NAME_LEASE_SECONDS / 4 + 1)  # one renewal
        with pytest.raises(ConsumerNameInUse, match="another host pid 1"):
            await consumer.commit(batch)
        with pytest.raises(ConsumerNameInUse):
            await consumer.take(1)
    assert await redis.get(keys.consumer_lease("trainer-l")) == b"another host pid 1"  # not released by the loser
    assert await _counter(redis, ns, "committed") == 0


async def test_pending_groups_trimmed_away_are_reported(
    redis: Redis, redis_url: str, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Groups taken, not committed, then XTRIMmed away: the restarted trainer acknowledges them
    with a warning naming the loss (it used to say nothing); nothing stays pending."""
    await make_namespace(redis, ns)
    keys = Keys(ns)
    for index in range(2):
        await redis.xadd(keys.groups, group_fields(_group(index)))
    async with GroupConsumer.connect(redis_url, ns, "trainer-x") as first:
        await first.take(2)
    await redis.xtrim(keys.groups, maxlen=0, approximate=False)
    async with GroupConsumer.connect(redis_url, ns, "trainer-x") as second:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(1.5):
                await second.take(1)
    assert caplog.text.count("is gone from the stream (XTRIM / XDEL?)") == 2
    assert (await redis.xpending(keys.groups, TRAINER_GROUP))["pending"] == 0
