"""Behaviour that differs between Redis versions, run on whichever redis-server the suite uses
(``$ROLLSTREAM_TEST_REDIS``; ``.ci/run`` runs this file on the embedded 6.2 and on Debian's 7).

XAUTOCLAIM on 6.2 returns a pending entry whose stream entry was deleted as ``(id, None)`` and
keeps it pending; 7.0 drops it from the pending list and lists its id in a third reply element.
A producer must reclaim around such entries on both without looping or losing the live ones.
"""

from __future__ import annotations

import asyncio

from conftest import ProcessPool, add_prompts, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common.keys import PRODUCERS_GROUP, Keys
from rollstream.consumer import GroupConsumer
from rollstream.testing.sim import SimEngine


async def server_major(redis: Redis) -> int:
    info = await redis.info("server")
    return int(str(info["redis_version"]).split(".")[0])


async def test_xautoclaim_reply_shape_of_this_version(redis: Redis, ns: str) -> None:
    keys = Keys(ns)
    await make_namespace(redis, ns)
    await add_prompts(redis, ns, 2)
    read = await redis.xreadgroup(PRODUCERS_GROUP, "ghost", {keys.prompts: ">"}, count=2)
    (first, _), (second, _) = read[0][1]
    await redis.xdel(keys.prompts, first)
    reply = await redis.xautoclaim(keys.prompts, PRODUCERS_GROUP, "heir", 0, start_id="0-0", count=10)
    claimed = reply[1]
    major = await server_major(redis)
    print(f"redis {major}: XAUTOCLAIM reply {reply!r}")
    if major >= 7:
        assert [c[0] for c in claimed] == [second]
        assert reply[2] == [first]  # the deleted id, dropped from the pending list
        assert (await redis.xpending(keys.prompts, PRODUCERS_GROUP))["pending"] == 1
    else:
        assert [c[0] for c in claimed if c[0] is not None] == [second] or [c[0] for c in claimed] == [first, second]
        assert (await redis.xpending(keys.prompts, PRODUCERS_GROUP))["pending"] == 2


async def test_producer_reclaims_around_deleted_pending_entries(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    """A dead producer left 4 prompts pending, 2 of them deleted from the stream since (an
    operator's XDEL, a namespace trim): the survivor finishes the 2 live ones, the deleted
    ones leave the pending list (acknowledged on 6.2, dropped by Redis on 7), nothing loops."""
    keys = Keys(ns)
    await make_namespace(redis, ns, lease_seconds=1.0)
    await add_prompts(redis, ns, 4)
    read = await redis.xreadgroup(PRODUCERS_GROUP, "dead-producer", {keys.prompts: ">"}, count=4)
    ids = [entry_id for entry_id, _ in read[0][1]]
    await redis.xdel(keys.prompts, ids[0], ids[2])
    await asyncio.sleep(1.1)
    procs.producer(redis_url, ns, sim.url, name="heir")
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        async with asyncio.timeout(40):
            batch = await consumer.take(2)
        await consumer.commit(batch)
    assert sorted(g.index for g in batch.groups) == [1, 3]

    async def pending() -> int:
        return int((await redis.xpending(keys.prompts, PRODUCERS_GROUP))["pending"])

    await wait_until(lambda: _eq(pending(), 0), timeout=20, message="no prompt left pending")
    assert await redis.xlen(keys.groups) == 0
    assert procs.children[0][0].poll() is None, procs.logs()


async def _eq(value: object, expected: int) -> bool:
    return await value == expected  # type: ignore[misc]
