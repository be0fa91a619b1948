"""Hostile inputs on the producer side (issue 15): bad prompt entries, a producer that fails in
its first milliseconds, poison prompts and broken rewards, garbage engine replies, requests in
flight for too long. Real Redis, real producer processes; each test checks the accounting: every
prompt fed is committed once or dead-lettered, nothing else.
"""

from __future__ import annotations

import asyncio
import subprocess
import time

import msgpack
from conftest import ProcessPool, add_prompts, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common.events import recent_events
from rollstream.common.keys import PRODUCERS_GROUP, Keys
from rollstream.consumer import GroupConsumer
from rollstream.testing.sim import SimEngine

NO_ENGINE = "http://127.0.0.1:9"
"""Nothing listens there: a request fails at once (connection refused)."""


async def wait_exit(child: subprocess.Popen[bytes], timeout: float) -> int | None:
    """The exit code, or None when the process is still running after ``timeout`` seconds."""
    try:
        return await asyncio.to_thread(child.wait, timeout)
    except subprocess.TimeoutExpired:
        return None


async def take_and_commit(url: str, ns: str, count: int, timeout: float = 60.0) -> list[int]:
    """Take and commit ``count`` groups one by one; their indexes."""
    indexes: list[int] = []
    async with await GroupConsumer.connect(url, ns, "trainer-h") as consumer:
        async with asyncio.timeout(timeout):
            while len(indexes) < count:
                batch = await consumer.take(1)
                indexes += [g.index for g in batch.groups]
                assert await consumer.commit(batch) == len(batch)
    return indexes


async def counters(redis: Redis, ns: str) -> dict[str, int]:
    raw = await redis.hgetall(Keys(ns).state)
    return {k.decode(): int(v) for k, v in raw.items() if v.lstrip(b"-").isdigit()}


async def dead_reasons(redis: Redis, ns: str) -> list[str]:
    return [f[b"reason"].decode() for _, f in await redis.xrange(Keys(ns).dead)]


# -- item 1: bad prompt entries; a producer that fails in its first milliseconds ----------------


async def test_bad_prompt_entries_are_dead_lettered_and_the_producer_goes_on(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    keys = Keys(ns)
    await make_namespace(redis, ns)
    await redis.xadd(keys.prompts, {b"\xff\xfe": b"x"})  # a field name that is not UTF-8
    await add_prompts(redis, ns, 2)
    await redis.xadd(keys.prompts, {"index": 90, "attempt": 0, "data": b"\xc1 not msgpack"})
    await redis.xadd(keys.prompts, {"index": 91, "attempt": 0, "data": msgpack.packb({"v": 2, "kind": "prompt"})})
    await redis.xadd(keys.prompts, {b"\xff": b"\xfe", "data": b"\xff"})
    await add_prompts(redis, ns, 2, start=2)
    producer = procs.producer(redis_url, ns, sim.url, name="tolerant")
    assert sorted(await take_and_commit(redis_url, ns, 4)) == [0, 1, 2, 3], procs.logs()
    await wait_until(lambda: redis.xlen(keys.dead), message="dead letters")
    reasons = await dead_reasons(redis, ns)
    assert len(reasons) == 4 and all(reasons), reasons
    assert producer.poll() is None, procs.log_of(producer)  # a bad entry is never fatal
    st = await counters(redis, ns)
    assert st["published"] == 4 and st["committed"] == 4 and st["dead_lettered"] == 4
    assert await redis.xlen(keys.prompts) == 0 and await redis.xlen(keys.groups) == 0
    assert not [e for e in await recent_events(redis, keys) if e.kind == "fatal"]


async def test_a_producer_failing_in_its_first_milliseconds_records_it_and_exits(
    redis: Redis, redis_url: str, ns: str, procs: ProcessPool
) -> None:
    """The engine refuses at once, so the fatal error lands while the control loop is still
    subscribing (redis-py could swallow that cancellation and the producer hung, heartbeat
    'running', no fatal event). Several rounds: the race does not lose every time."""
    keys = Keys(ns)
    await make_namespace(redis, ns, lease_seconds=2)
    await redis.xadd(keys.prompts, {b"\xff\xfe": b"x"})
    await add_prompts(redis, ns, 1)
    for round_ in range(3):
        started = time.monotonic()
        child = procs.producer(redis_url, ns, NO_ENGINE, "--max-retries", "0", name=f"early-{round_}")
        code = await wait_exit(child, 30)
        assert code is not None, f"round {round_}: still running after 30 s\n{procs.log_of(child)}"
        assert code == 1, procs.log_of(child)
        assert time.monotonic() - started < 30
        fatal = [e for e in await recent_events(redis, keys) if e.kind == "fatal" and e.source == f"early-{round_}"]
        assert fatal and "EngineError" in fatal[0].message + fatal[0].traceback
    # Each prompt is back in the stream (returned by the failing producer) or dead-lettered (the
    # bad one, once its task ran before the shutdown); nothing is left pending or doubled.
    dead = await dead_reasons(redis, ns)
    assert len(dead) <= 1 and await redis.xlen(keys.prompts) + len(dead) == 2
    assert (await redis.xpending(keys.prompts, PRODUCERS_GROUP))["pending"] == 0
