"""Hostile inputs an operator (or anyone with write access to Redis) can produce (issue 15): one
damaged value in a hash or stream, operator mistakes, leaked secrets. Real Redis, real producer
processes, `rollstream inspect` as a process; exact accounting at the end."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

from conftest import ProcessPool, add_prompts, make_namespace
from redis.asyncio import Redis
from rollstream.common.codec import group_fields
from rollstream.common.keys import PRODUCERS_GROUP, TRAINER_GROUP, Keys
from rollstream.consumer import GroupConsumer
from rollstream.testing.sim import SimEngine
from test_hostile_trainer import _group
from test_inspect import inspect_json


async def _take_all(url: str, ns: str, count: int) -> Counter[int]:
    committed: Counter[int] = Counter()
    async with GroupConsumer.connect(url, ns, "trainer-h", stall_timeout=60) as consumer:
        while sum(committed.values()) < count:
            batch = await consumer.take(min(4, count - sum(committed.values())))
            assert await consumer.commit(batch) == len(batch)
            committed.update(g.index for g in batch.groups)
    return committed


async def test_one_bad_value_wedges_nothing(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    """Each damaged value of issue 15 at once, with staleness-aware admission on (ADMIT reads the
    weight version): producers and the trainer go on, `inspect` names every damaged key and field
    (exit 1, not 2), the one undecodable group is dead-lettered, every prompt is committed once."""
    await make_namespace(redis, ns, max_staleness=10)
    keys = Keys(ns)
    await redis.hset(keys.producers, "evil", "[1,2]")
    await redis.hset(keys.producers, "evil2", json.dumps({"state": "running", "last_seen_ms": "abc"}))
    await redis.hset(keys.producers, "evil3", b"\xff\xfe{")
    await redis.hset(keys.state, mapping={
        "admission_blocked_ms": "abc", "weight_version": "abc", "committed": "x1", b"\xff\xfe": "1",
    })
    await redis.xadd(keys.events, {"kind": "fatal", "ts_ms": "abc", "producer": "evil", "message": "forged"})
    bad_group = {**group_fields(_group(1000)), b"\xff\xfe": b"x"}
    await redis.xadd(keys.groups, bad_group)  # type: ignore[arg-type]

    code, snap = await inspect_json(redis_url, ns)
    assert code == 1
    problems = "\n".join(snap["health"]["problems"])
    for named in (f"{keys.state} field 'admission_blocked_ms'", f"{keys.state} field 'weight_version'",
                  f"{keys.state} field 'committed'", f"{keys.state}: field name b'\\xff\\xfe'",
                  f"{keys.producers} field 'evil'", f"{keys.producers} field 'evil2'",
                  f"{keys.producers} field 'evil3'", f"{keys.events} entry"):
        assert named in problems, f"{named!r} not reported in\n{problems}"

    prompts = 24
    await add_prompts(redis, ns, prompts)
    procs.producer(redis_url, ns, sim.url, name="prod-a", concurrency=4)
    try:
        async with asyncio.timeout(60):
            committed = await _take_all(redis_url, ns, prompts)
    except TimeoutError:
        raise AssertionError(
            f"stuck: {await redis.hgetall(keys.state)} {await redis.xlen(keys.prompts)} "
            f"{await redis.xpending(keys.prompts, PRODUCERS_GROUP)}"
        ) from None
    assert committed == Counter(range(prompts)), "every prompt committed exactly once"
    await procs.astop_all()
    dead = await redis.xrange(keys.dead)
    assert [(f[b"source"], f[b"reason"].split(b":")[0]) for _, f in dead] == [(b"groups", b"bad_field")]
    state = await redis.hgetall(keys.state)
    assert state[b"committed"] == str(prompts).encode()  # the damaged counter was reset, then counted
    assert state[b"dead_lettered"] == b"1"
    assert await redis.xlen(keys.groups) == 0 and await redis.xlen(keys.prompts) == 0
    assert (await redis.xpending(keys.groups, TRAINER_GROUP))["pending"] == 0
    assert (await redis.xpending(keys.prompts, PRODUCERS_GROUP))["pending"] == 0
    code, snap = await inspect_json(redis_url, ns)
    problems = "\n".join(snap["health"]["problems"])
    assert "'committed'" not in problems and "'weight_version'" in problems  # a counter is repaired by use
