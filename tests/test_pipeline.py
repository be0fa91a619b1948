"""The core pipeline end to end: real redis-server, real producer processes, the simulator over HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys

import httpx
from conftest import ProcessPool, add_prompts, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common.events import FATAL, recent_events
from rollstream.common.keys import PRODUCERS_GROUP, Keys, StateField
from rollstream.consumer import GroupConsumer
from rollstream.testing.sim import SimConfig, SimEngine


async def test_take_returns_the_oldest_groups_and_leaves_the_surplus(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4)
    await add_prompts(redis, ns, 10)
    procs.producer(redis_url, ns, sim.url)
    await wait_until(lambda: redis.xlen(keys.groups), timeout=30, message="first group")
    await wait_until(lambda: _eq(redis.xlen(keys.groups), 10), timeout=30, message="10 groups")
    entries = await redis.xrange(keys.groups)
    oldest = [e[0] for e in entries[:4]]
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        batch = await consumer.take(4)
        assert len(batch.groups) == 4
        assert sorted(batch.entry_ids) == sorted(oldest)
        assert [g.index for g in batch.groups] == sorted(g.index for g in batch.groups)
        assert all(len(g.samples) == 2 for g in batch.groups)
        assert batch.metrics["backlog"] == 6
        assert await consumer.commit(batch) == 4
        assert await redis.xlen(keys.groups) == 6


async def _eq(value: object, expected: int) -> bool:
    return await value == expected  # type: ignore[misc]


async def _at_least(value: object, expected: int) -> bool:
    return await value >= expected  # type: ignore[misc]


async def test_three_takes_never_lose_or_double_a_group(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=3, batch_size=5)
    await add_prompts(redis, ns, 15)
    for i in range(2):
        procs.producer(redis_url, ns, sim.url, name=f"p{i}", concurrency=6)
    seen: list[int] = []
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        for _ in range(3):
            batch = await asyncio.wait_for(consumer.take(5), 60)
            indexes = [g.index for g in batch.groups]
            assert indexes == sorted(indexes)
            seen += indexes
            await consumer.commit(batch)
    assert sorted(seen) == list(range(15))
    state = await redis.hgetall(Keys(ns).state)
    assert int(state[b"committed"]) == 15 and int(state[b"published"]) == 15


async def test_in_flight_samples_never_exceed_concurrency(
    redis: Redis, redis_url: str, ns: str, procs: ProcessPool
) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=4, batch_size=4)
    await add_prompts(redis, ns, 12)
    async with SimEngine(SimConfig(mean_tokens=40, length_sigma=0, latency_per_token=0.005)) as engine:
        procs.producer(redis_url, ns, engine.url, concurrency=6)  # room for one prompt (4 samples) at a time
        await wait_until(lambda: _eq(redis.xlen(Keys(ns).groups), 12), timeout=60, message="12 groups")
        async with httpx.AsyncClient() as http:
            stats = (await http.get(f"{engine.url}/sim/stats")).json()
    assert stats["max_running_seen"] <= 6
    assert stats["max_running_seen"] >= 4  # the four samples of a prompt do run together


async def test_backlog_stays_under_max_backlog_without_a_trainer(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2, max_backlog=5)
    await add_prompts(redis, ns, 40)
    # ADMIT reads only while the ready backlog is under 5 (so at most 4 ready then), and at most 8
    # prompts are in flight after it (capacity goes back per sample, a prompt holds at least one
    # unit until published); without a trainer only ADMIT raises ready + in flight: at most 4 + 8.
    procs.producer(redis_url, ns, sim.url, concurrency=8, name="capped")
    lengths = []
    for _ in range(60):
        lengths.append(await redis.xlen(keys.groups))
        await asyncio.sleep(0.05)
    await wait_until(lambda: _at_least(redis.xlen(keys.groups), 5), timeout=20, message="backlog at its cap")
    # From here on every ADMIT is refused: the prompts in flight finish, and nothing follows them.
    await wait_until(lambda: _pending_prompts(redis, keys, 0), timeout=20,
                     message=f"the prompts in flight at the cap to be published\n{procs.logs()}")
    admitted = int(await redis.hget(keys.state, StateField.ADMITTED))
    assert await redis.xlen(keys.groups) == admitted  # each admitted prompt published once
    await wait_until(lambda: _refused_at_the_cap(redis, keys, "capped", admitted), timeout=20,
                     message=f"a heartbeat after the last publish, refused by the backlog\n{procs.logs()}")
    lengths.append(await redis.xlen(keys.groups))
    assert 5 <= max(lengths) <= 5 - 1 + 8, lengths
    assert (await redis.xpending(keys.prompts, PRODUCERS_GROUP))["pending"] == 0  # nothing admitted past the cap
    assert int(await redis.hget(keys.state, StateField.ADMITTED)) == admitted == lengths[-1]
    assert await redis.xlen(keys.prompts) == 40 - admitted  # the rest wait, unread


async def _pending_prompts(redis: Redis, keys: Keys, expected: int) -> bool:
    return (await redis.xpending(keys.prompts, PRODUCERS_GROUP))["pending"] == expected


async def _refused_at_the_cap(redis: Redis, keys: Keys, name: str, published: int) -> bool:
    beat = json.loads((await redis.hget(keys.producers, name)) or "{}")
    return (beat.get("published") == published and beat.get("in_flight_prompts") == 0
            and beat.get("admission") == "backlog")


async def test_engine_500s_are_retried(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2)
    async with httpx.AsyncClient() as http:
        await http.post(f"{sim.url}/sim/faults", json={"generate_errors": 3, "generate_error_status": 500})
    await add_prompts(redis, ns, 2)
    producer = procs.producer(redis_url, ns, sim.url, name="retrier")
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        batch = await asyncio.wait_for(consumer.take(2), 60)
    assert sorted(g.index for g in batch.groups) == [0, 1]
    beat = json.loads((await redis.hget(Keys(ns).producers, "retrier")) or "{}")
    await wait_until(lambda: _retries(redis, ns), timeout=10, message="retries in the heartbeat")
    assert producer.poll() is None, procs.log_of(producer)
    assert beat.get("state") == "running"


async def _retries(redis: Redis, ns: str) -> bool:
    beat = json.loads((await redis.hget(Keys(ns).producers, "retrier")) or "{}")
    return beat.get("engine_retries", 0) >= 3


async def test_engine_that_keeps_failing_is_fatal_and_the_prompt_stays(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2)
    async with httpx.AsyncClient() as http:
        await http.post(f"{sim.url}/sim/faults", json={"generate_errors": -1, "generate_error_status": 503})
    await add_prompts(redis, ns, 1)
    producer = procs.producer(redis_url, ns, sim.url, "--max-retries", "2", name="doomed")
    code = await asyncio.to_thread(producer.wait, 60)
    assert code != 0, procs.log_of(producer)
    events = await recent_events(redis, keys, kind=FATAL)
    assert events and events[0].source == "doomed"
    assert "EngineError" in events[0].message and "Traceback" in events[0].traceback
    rows = await redis.xrange(keys.retry)  # returned prompts are served first
    assert [int(r[1][b"index"]) for r in rows] == [0] and await redis.xlen(keys.prompts) == 0
    assert (await redis.xpending(keys.retry, PRODUCERS_GROUP))["pending"] == 0


async def test_producer_refuses_a_namespace_without_config_or_with_other_flags(
    redis: Redis, redis_url: str, ns: str
) -> None:
    base = [sys.executable, "-m", "rollstream.cli", "produce", "--redis", redis_url, "--ns", ns,
            "--engine", "http://127.0.0.1:9", "--concurrency", "4", "--reward", "math"]
    missing = await asyncio.to_thread(subprocess.run, base, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "rollstream init" in missing.stderr
    await make_namespace(redis, ns, n_samples_per_prompt=2)
    mismatch = await asyncio.to_thread(
        subprocess.run, [*base, "--n-samples", "8"], capture_output=True, text=True, timeout=60
    )
    assert mismatch.returncode == 2 and "n_samples_per_prompt" in mismatch.stderr


def test_demo_runs_three_steps(tmp_path) -> None:  # type: ignore[no-untyped-def]
    result = subprocess.run(
        [sys.executable, "-m", "rollstream.cli", "demo", "--steps", "3", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=240, env={**os.environ, "COLUMNS": "400"},  # one line a step
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "24 groups committed" in result.stdout
    assert (tmp_path / "demo.png").stat().st_size > 1000
    # the table a step: throughput, the trainer's wait within its step, fates, staleness, the ledger
    line = re.compile(
        r"step=(\d)  groups/s=([\d.]+)  tokens/s=([\d,]+)  wait / step s=([\d.]+) / ([\d.]+)  "
        r"fates T/R/F=8 / (\d+) / (\d+)  stale=([\d.]+) \((\d+)\)  token lag=([\d.]+) \((\d+)\)  "
        r"long T/F=(\d+% / \d+%|-)"
    )
    steps = [m.groups() for m in line.finditer(result.stdout)]
    assert [int(s[0]) for s in steps] == [0, 1, 2], result.stdout[-3000:]
    for _, per_s, tokens, wait, step, *_ in steps:
        assert float(per_s) > 0 and int(tokens.replace(",", "")) > 0
        assert 0 <= float(wait) <= float(step)
