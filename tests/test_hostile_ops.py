"""Hostile inputs an operator (or anyone with write access to Redis) can produce (issue 15): one
damaged value in a hash or stream, operator mistakes, leaked secrets. Real Redis, real producer
processes, `rollstream inspect` as a process; exact accounting at the end."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import ProcessPool, add_prompts, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common.codec import group_fields
from rollstream.common.connection import connect
from rollstream.common.keys import PRODUCERS_GROUP, TRAINER_GROUP, Keys
from rollstream.consumer import GroupConsumer, NamespaceGone, ProducerFailed, RedisDataLost
from rollstream.runtime.redis_server import EmbeddedRedis
from rollstream.testing.sim import SimEngine
from test_hostile_trainer import _group
from test_inspect import inspect_json, run_inspect


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


def _dataset(tmp_path: Path, count: int) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Compute {i} + 1 and box it.", "label": str(i + 1)}) + "\n"
                            for i in range(count)))
    return path


async def _feed(procs: ProcessPool, url: str, ns: str, dataset: Path) -> tuple[int, str]:
    child = procs.start("feed", "--redis", url, "--ns", ns, str(dataset), "--epochs", "1", log_name="feed")
    code = await asyncio.to_thread(child.wait, 60)
    return code, procs.log_of(child)


async def _problems(url: str, ns: str) -> tuple[int, str, dict[str, Any]]:
    code, snap = await inspect_json(url, ns)
    return code, "\n".join(snap["health"]["problems"]), snap


async def test_deleted_state_then_feeder_restart_is_refused(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool, tmp_path: Path
) -> None:
    """`DEL …:state` after a finished epoch, then the feeder restarted: it refuses (exit 2, a clear
    message) instead of feeding and training all 30 prompts twice; `inspect` says why."""
    await make_namespace(redis, ns)
    keys = Keys(ns)
    dataset = _dataset(tmp_path, 30)
    assert (await _feed(procs, redis_url, ns, dataset))[0] == 0
    procs.producer(redis_url, ns, sim.url, name="prod-a", concurrency=8)
    assert await _take_all(redis_url, ns, 30) == Counter(range(30))
    await procs.astop_all()
    await redis.delete(keys.state)
    code, problems, _ = await _problems(redis_url, ns)
    assert code == 1 and f"the state hash {keys.state} does not belong" in problems, problems
    code, log = await _feed(procs, redis_url, ns, dataset)
    assert code == 2 and "feed the dataset again from its start" in log, log
    assert await redis.xlen(keys.prompts) == 0, "nothing fed twice"
    assert await redis.xlen(keys.groups) == 0 and await redis.hget(keys.state, "fed") is None


async def test_xtrim_and_a_destroyed_trainer_group_are_reported(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool, tmp_path: Path
) -> None:
    """XTRIM of the prompt stream (10 prompts) then of the group stream (10 groups): the loss is
    unavoidable but `inspect` counts it (20 vanished); XGROUP DESTROY of the trainer group is a
    problem, a commit that meets it (NOGROUP inside the Lua script) gets the actionable message,
    and `init` with the same config brings the group back: the 20 left are committed once."""
    await make_namespace(redis, ns)
    keys = Keys(ns)
    assert (await _feed(procs, redis_url, ns, _dataset(tmp_path, 40)))[0] == 0
    code, problems, snap = await _problems(redis_url, ns)
    assert snap["ledger"] == {"expected": 40, "held": 40, "vanished": 0}
    await redis.xtrim(keys.prompts, maxlen=30, approximate=False)
    code, problems, snap = await _problems(redis_url, ns)
    assert code == 1 and "10 prompts / groups vanished from the streams" in problems, problems

    procs.producer(redis_url, ns, sim.url, name="prod-a", concurrency=8)
    async def published() -> bool:
        return await redis.xlen(keys.groups) == 30
    await wait_until(published, 30, message=f"30 groups\n{procs.logs()}")
    await redis.xtrim(keys.groups, maxlen=20, approximate=False)
    left = Counter(int(f[b"index"]) for _, f in await redis.xrange(keys.groups))
    assert len(left) == 20 and not set(left) & set(range(10))
    code, problems, snap = await _problems(redis_url, ns)
    assert "20 prompts / groups vanished" in problems, problems

    consumer = await GroupConsumer.connect(redis_url, ns, "trainer-d")
    try:
        batch = await consumer.take(4)
        await redis.xgroup_destroy(keys.groups, TRAINER_GROUP)
        code, problems, snap = await _problems(redis_url, ns)
        assert f"consumer group 'trainer' of {keys.groups} is missing" in problems, problems
        with pytest.raises(NamespaceGone, match=f"namespace '{ns}'.*init"):
            await consumer.commit(batch)  # ACK_DELETE: NOGROUP raised inside the script
    finally:
        await consumer.aclose()
    await make_namespace(redis, ns)  # the same config: re-creates the group at id 0
    assert await _take_all(redis_url, ns, 20) == left
    code, problems, snap = await _problems(redis_url, ns)
    assert snap["ledger"] == {"expected": 20, "held": 0, "vanished": 20}
    assert snap["counters"]["committed"] == 20 and snap["counters"]["fed"] == 40


async def test_redis_restart_without_persistence_is_named(
    ns: str, sim: SimEngine, procs: ProcessPool, tmp_path: Path
) -> None:
    """Redis restarted with no AOF / RDB: the trainer and the producer say that Redis lost its data
    (not "was the namespace deleted? run init"), and `inspect` does not call it healthy."""
    with EmbeddedRedis(dir=tmp_path / "redis") as server:
        redis = connect(server.url)
        try:
            await make_namespace(redis, ns)
            await add_prompts(redis, ns, 8)
            producer = procs.producer(server.url, ns, sim.url, name="prod-a", concurrency=4)
            async with GroupConsumer.connect(server.url, ns, "trainer-p", stall_timeout=60) as consumer:
                batch = await consumer.take(4)
                assert await consumer.commit(batch) == 4
                await asyncio.to_thread(server.restart, kill=True, down_for=0.5)
                with pytest.raises(RedisDataLost, match="without persistence") as lost:
                    async with asyncio.timeout(30):
                        await consumer.take(4)
                assert "was the namespace deleted" not in str(lost.value)
            assert await asyncio.to_thread(producer.wait, 30) != 0
            assert "without persistence" in procs.log_of(producer)
            code, problems, _ = await _problems(server.url, ns)
            assert code == 1 and "not initialised" in problems
        finally:
            await redis.aclose()


async def test_init_force_with_a_different_n_is_refused_while_producers_live(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    """`init --force --n-samples 4` under a running producer (n = 2) is refused; once the producer
    is stopped it is accepted. Nothing was dead-lettered: the 8 prompts are committed once."""
    await make_namespace(redis, ns)
    keys = Keys(ns)
    await add_prompts(redis, ns, 8)
    procs.producer(redis_url, ns, sim.url, name="prod-a", concurrency=4)
    assert await _take_all(redis_url, ns, 8) == Counter(range(8))

    def init(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "rollstream.cli", "init", "--redis", redis_url, "--ns", ns, "--n-samples", "4",
             "--batch-size", "4", *extra], capture_output=True, text=True, timeout=30,
        )

    refused = await asyncio.to_thread(init, "--force")
    assert refused.returncode == 2 and "live producers: prod-a" in refused.stderr + refused.stdout
    assert await redis.hget(keys.config, "n_samples_per_prompt") == b"2"
    await procs.astop_all()
    accepted = await asyncio.to_thread(init, "--force")
    assert accepted.returncode == 0, accepted.stderr
    assert await redis.hget(keys.config, "n_samples_per_prompt") == b"4"
    assert await redis.xlen(keys.dead) == 0


async def test_engine_credentials_are_shown_nowhere(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    """An engine URL with `user:password@` (and a failing engine, so the error paths run too): the
    password is in no log line, no Redis key or value, no `inspect` output, no exception text."""
    secret = "s3cret-PW-4711"
    await make_namespace(redis, ns)
    keys = Keys(ns)
    async with httpx.AsyncClient() as client:
        reply = await client.post(f"{sim.url}/sim/faults", json={"generate_errors": -1, "generate_error_status": 500})
        assert reply.status_code == 200
    await add_prompts(redis, ns, 2)
    engine = sim.url.replace("http://", f"http://trainer:{secret}@")
    producer = procs.producer(redis_url, ns, engine, "--max-retries", "1", name="prod-s", concurrency=2)
    async with GroupConsumer.connect(redis_url, ns, "trainer-s") as consumer:
        with pytest.raises(ProducerFailed) as caught:
            async with asyncio.timeout(30):
                await consumer.take(1)
    assert await asyncio.to_thread(producer.wait, 30) == 1
    failure = caught.value
    shown = [str(failure), failure.remote_traceback, procs.log_of(producer)]
    for key in await redis.keys(f"{keys.base}:*"):
        kind = (await redis.type(key)).decode()
        if kind == "hash":
            shown.append(repr(await redis.hgetall(key)))
        elif kind == "stream":
            shown.append(repr(await redis.xrange(key)))
        else:
            shown.append(repr(await redis.get(key)))
    shown.append(json.dumps((await inspect_json(redis_url, ns))[1]))
    shown.append((await run_inspect(redis_url, ns))[1])
    assert "trainer:***@" in "\n".join(shown)  # the URL is shown, redacted
    for text in shown:
        assert secret not in text, text[text.find(secret) - 300:text.find(secret) + 100]
