"""Redis out of memory (``maxmemory`` reached under ``noeviction``), on a redis-server of the test's
own: the feeder and the producers back off (logged once per outage, naming maxmemory) and
resume, ``take()`` and ``commit()`` go on with what is there (commits free memory), ``inspect``
reports a problem naming maxmemory, and every prompt is trained exactly once."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
from conftest import ProcessPool, add_prompts, make_namespace, redis_binary_under_test, wait_until
from redis.exceptions import OutOfMemoryError
from rollstream.common.admission import memory_deadlock
from rollstream.common.codec import group_fields
from rollstream.common.connection import Outage, connect
from rollstream.common.errors import RedisOutOfMemory
from rollstream.common.keys import PRODUCERS_GROUP, Keys
from rollstream.common.models import Group, Sample, Status
from rollstream.common.protocol import Feed, GroupQueue, PromptQueue, TrainerMonitor
from rollstream.consumer import GroupConsumer
from rollstream.ops.snapshot import snapshot
from rollstream.runtime.redis_server import EmbeddedRedis
from rollstream.testing.sim import SimConfig, SimEngine

OOM_LINE = "Redis is out of memory (used_memory reached maxmemory"
BACK_LINE = "Redis accepts writes again"


async def _no_latency_histograms(redis: object) -> None:
    """A limit set a few KiB above ``used_memory`` would be eaten by Redis 7's own per-command
    histograms (24 KiB for each command first run after the reading: the trainer's commit, inspect,
    the out-of-memory paths), leaving no room for the groups the trainer waits for. Redis 6.2 has none."""
    if await redis.config_get("latency-tracking"):  # type: ignore[attr-defined]
        await redis.config_set("latency-tracking", "no")  # type: ignore[attr-defined]


async def _fill(redis: object, key: str) -> int:
    """Add entries until Redis refuses one for memory; how many it took."""
    added = 0
    while True:
        try:
            await redis.xadd(key, {"pad": "x" * 4000})  # type: ignore[attr-defined]
        except OutOfMemoryError:
            return added
        added += 1


async def test_scripts_refused_at_maxmemory_change_nothing_and_commit_frees_memory(tmp_path: Path) -> None:
    """The building blocks: the feeder's script is refused whole (typed, transient), a producer
    still publishes a group, take's bookkeeping write is skipped, and a commit still runs and frees memory."""
    with EmbeddedRedis(binary=redis_binary_under_test(), dir=tmp_path / "redis") as server:
        redis = connect(server.url)
        try:
            keys = Keys("oom-unit")
            await make_namespace(redis, keys.namespace)
            await add_prompts(redis, keys.namespace, 1)  # admitted by a producer before Redis fills up
            [(_, [(prompt_id, _)])] = await redis.xreadgroup(PRODUCERS_GROUP, "p", {keys.prompts: ">"}, count=1)
            used = int((await redis.info("memory"))["used_memory"])
            await redis.config_set("maxmemory", used + 256 * 1024)
            filler = keys.groups  # group-sized entries in the group stream, delivered to a trainer
            assert await _fill(redis, filler) > 10
            # the group that may be the one the trainer waits for is published all the same
            samples = [Sample(index=i, tokens=[1, 2, 3], response_length=1, status=Status.COMPLETED, weight_versions=[0])
                       for i in range(2)]
            group = Group(index=0, prompt="p", samples=samples)
            assert await PromptQueue(redis, keys, "p").publish(keys.prompts, prompt_id, group_fields(group)) is not None
            queue = GroupQueue(redis, keys, "t")
            delivered = await queue.read(redis, 1000, 10)
            feed = Feed(redis, keys)
            with pytest.raises(RedisOutOfMemory, match=r"maxmemory.*FEED script changed nothing"):
                await feed.add(expected_next=0, next_after=1, epoch=0, position=1, dataset="d", entries=[{"a": "b"}])
            assert await redis.xlen(keys.prompts) == 0 and await redis.hget(keys.state, "feed_next_index") is None
            stats = await TrainerMonitor(redis, keys).mark_take()  # the take's time is refused, its statistics are read
            assert stats.groups_pending == len(delivered)
            assert await queue.commit([eid for eid, _ in delivered]) == len(delivered)
            assert await redis.xlen(keys.groups) == 0

            async def accepted() -> bool:
                """A feed of one prompt is accepted again: memory freed by the commit. Redis 7 shrinks
                grown client buffers in its cron a moment later, and checks maxmemory at each write a
                script makes, so a feed right after used_memory first dips below it can still be
                refused (whole: the script changes nothing, so asking again is safe)."""
                try:
                    return await feed.add(
                        expected_next=0, next_after=1, epoch=0, position=1, dataset="d", entries=[{"a": "b"}]
                    ) == 1
                except RedisOutOfMemory:
                    assert await redis.xlen(keys.prompts) == 0
                    return False

            await wait_until(accepted, timeout=30, message="a feed accepted once the commit freed memory")
            assert await redis.xlen(keys.prompts) == 1
        finally:
            await redis.aclose()


async def test_outage_logs_out_of_memory_once_per_outage(caplog: pytest.LogCaptureFixture) -> None:
    outage = Outage(logging.getLogger("oom-test"), "feeder", max_delay=0.05)
    calls = 0

    async def refused_twice() -> int:
        nonlocal calls
        calls += 1
        if calls <= 2:
            raise RedisOutOfMemory("refused")
        return calls

    with caplog.at_level(logging.WARNING, logger="oom-test"):
        assert await outage.run(refused_twice) == 3
        outage.recovered()  # a read succeeding meanwhile does not end an out-of-memory outage
    lines = [r.getMessage() for r in caplog.records]
    assert sum(OOM_LINE in line and "maxmemory" in line for line in lines) == 1
    assert sum(BACK_LINE in line for line in lines) == 1
    assert (outage.oom_count, outage.count, outage.out_of_memory) == (1, 0, False)


def test_memory_deadlock_is_named_only_when_nothing_can_move() -> None:
    full = {"used_memory": 2 * 2**20, "maxmemory": 2 * 2**20}
    still = {"prompts_waiting": 0, "in_flight_prompts": 0, "groups_held": 1, "batch_size": 4}
    why = memory_deadlock(full, **still)
    assert why is not None and why.startswith("deadlock at maxmemory") and "1 groups, fewer than a batch of 4" in why
    near = {**full, "used_memory": 2 * 2**20 - 4096}  # a write's arguments would cross the limit
    assert memory_deadlock(near, **still) is not None
    assert memory_deadlock({**full, "used_memory": 2 * 2**20 - 65 * 1024}, **still) is None  # room for a write
    assert memory_deadlock({**full, "maxmemory": 0}, **still) is None  # no limit
    assert memory_deadlock(None, **still) is None  # INFO not allowed
    assert memory_deadlock(full, **{**still, "prompts_waiting": 1}) is None  # a producer can publish it
    assert memory_deadlock(full, **{**still, "in_flight_prompts": 1}) is None  # publishing works at maxmemory
    assert memory_deadlock(full, **{**still, "groups_held": 4}) is None  # a take completes, its commit frees


async def test_a_deadlock_at_maxmemory_is_an_error_in_take_and_a_problem_in_inspect(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Memory filled outside the pipeline, nothing queued: no group can ever come and no commit can
    free memory. take() says so as an error (not "is the feeder running?"), inspect as a problem."""
    with EmbeddedRedis(binary=redis_binary_under_test(), dir=tmp_path / "redis") as server:
        admin = connect(server.url)
        keys = Keys("oom-deadlock")
        try:
            await make_namespace(admin, keys.namespace, batch_size=4)
            async with GroupConsumer.connect(server.url, keys.namespace, "t", warn_interval=0.2) as trainer:
                used = int((await admin.info("memory"))["used_memory"])
                await admin.config_set("maxmemory", used + 256 * 1024)
                assert await _fill(admin, "other-data") > 10  # not the pipeline's: no commit frees it
                problems = (await snapshot(admin, keys))["health"]["problems"]
                assert any(p.startswith("deadlock at maxmemory") and "0 groups, fewer than a batch of 4" in p
                           for p in problems), problems
                with caplog.at_level(logging.WARNING, logger="rollstream.consumer"):

                    async def reported() -> bool:
                        return any(r.levelno == logging.ERROR and "deadlock at maxmemory" in r.getMessage()
                                   for r in caplog.records)

                    take = asyncio.create_task(trainer.take(4))
                    try:
                        await wait_until(reported, timeout=60, message="take()'s deadlock error")
                    finally:
                        take.cancel()
                        await asyncio.wait([take])
                    assert take.cancelled()  # it waited: the error is a report, not an exception
                    assert not any("is the feeder running" in r.getMessage() for r in caplog.records)
                # the remedy it names: more room (freeing other-data alone may not do on Redis 7, whose
                # latency histograms took memory meanwhile)
                await admin.config_set("maxmemory", used + 2 * 2**20)
                problems = (await snapshot(admin, keys))["health"]["problems"]
                assert not any("maxmemory" in p for p in problems), problems
        finally:
            await admin.aclose()


async def test_a_flood_at_maxmemory_backs_off_resumes_and_trains_every_prompt_once(
    procs: ProcessPool, tmp_path: Path
) -> None:
    # The flood must outgrow the room whatever the producer published during the warm-up (on one
    # loaded core it runs far ahead of this process): 192 groups of about 8 KB, 128 KiB of room.
    prompts, batch = 192, 4
    warm_up, room = 16, 128 * 1024  # groups published before the limit; room above used_memory then
    dataset = tmp_path / "data.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"Compute {i} + 1.", "label": str(i + 1)}) + "\n"
                               for i in range(prompts)))
    with EmbeddedRedis(binary=redis_binary_under_test(), dir=tmp_path / "redis") as server:
        url = server.url
        admin = connect(url)
        ns = "oomflood"
        keys = Keys(ns)
        try:
            await _no_latency_histograms(admin)
            await make_namespace(admin, ns, n_samples_per_prompt=2, batch_size=batch)
            # the trainer holds its name before Redis fills up (taking a new name is a write)
            async with SimEngine(SimConfig(seed=5, mean_tokens=256, length_sigma=0.0)) as sim, \
                    GroupConsumer.connect(url, ns, "oom-trainer") as trainer:
                producer = procs.producer(url, ns, sim.url, name="oom-producer", concurrency=16)
                feeder = procs.start("feed", "--redis", url, "--ns", ns, str(dataset), "--window", "24",
                                     "--log-level", "INFO", log_name="feed")
                # The limit is read once Redis' memory outside the keys has settled: the producer's
                # connection pool grown to what its concurrency needs (on 6.2 a connection holds a
                # 16 KiB reply buffer), the trainer's read and commit done, inspect run. Read before,
                # the connections opened after it take the room the groups need: no batch fits, and
                # nothing can move (take() and inspect then report a deadlock at maxmemory).
                async def published() -> bool:
                    return int(await admin.hget(keys.state, "published") or 0) >= warm_up

                await wait_until(published, timeout=60, message="the warm-up groups")
                got = await trainer.take(batch)
                seen = [g.index for g in got.groups]
                assert await trainer.commit(got) == batch
                await snapshot(admin, keys)
                used = int((await admin.info("memory"))["used_memory"])
                await admin.config_set("maxmemory", used + room)  # the flood of groups fills it
                await wait_until(lambda: OOM_LINE in procs.log_of(feeder), timeout=90,
                                 message="the feeder refused for memory")
                # memory hovers at the limit (the feeder gets a chunk in whenever it dips below), and
                # the groups published from what was fed push it over: inspect sees it there
                async def memory_problems() -> list[str]:
                    health = (await snapshot(admin, keys))["health"]
                    return [p for p in health["problems"] if "maxmemory" in p]

                problems = await wait_until(memory_problems, timeout=60, message="inspect's maxmemory problem")
                assert "noeviction" in problems[0] and "used_memory" in problems[0], problems
                snap = await snapshot(admin, keys)
                assert snap["redis_memory"]["maxmemory"] == used + room

                while len(seen) < prompts:
                    async with asyncio.timeout(120):
                        got = await trainer.take(batch)
                    seen += [g.index for g in got.groups]
                    assert await trainer.commit(got) == batch
                await wait_until(lambda: feeder.poll() is not None, timeout=60, message="the feeder to finish")
                assert feeder.returncode == 0, procs.logs()
            # exact accounting: every prompt trained once, nothing dead-lettered or left over
            assert sorted(seen) == list(range(prompts)), procs.logs()
            assert await admin.xlen(keys.dead) == 0 and await admin.xlen(keys.groups) == 0
            state = await admin.hgetall(keys.state)
            assert int(state[b"fed"]) == int(state[b"committed"]) == prompts
            # once per outage: each out-of-memory warning is followed by one recovery line
            log = procs.log_of(feeder)
            assert log.count(OOM_LINE) == log.count(BACK_LINE), log[-3000:]
            await wait_until(lambda: procs.log_of(producer).count(OOM_LINE) == procs.log_of(producer).count(BACK_LINE),
                             timeout=30, message="the producer's outages each logged once and ended")
            assert procs.log_of(feeder).count(OOM_LINE) >= 1
            assert producer.poll() is None, procs.logs()  # backed off, never failed
        finally:
            await admin.aclose()
