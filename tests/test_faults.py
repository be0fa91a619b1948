"""Kill anything at any time: real producer and trainer processes, real signals, real redis-server.

Each test drives one failure (SIGKILL, SIGSTOP past the lease, SIGTERM, a Redis restart, a
failing engine, garbage in the groups stream) and then checks the accounting: every prompt
index ends in exactly one group, a returned prompt, or a dead-letter entry with a reason.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from array import array
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
from conftest import ProcessPool, add_prompts, make_namespace, redis_binary_under_test, take_all, wait_until
from killable_trainer import run_trainer
from redis.asyncio import Redis
from rollstream.common.codec import CodecLimits, decode_prompt_entry, group_fields
from rollstream.common.connection import connect
from rollstream.common.errors import ProducerFailed
from rollstream.common.keys import PRODUCERS_GROUP, TRAINER_GROUP, Keys
from rollstream.common.models import Group, Sample, Status
from rollstream.consumer import GroupConsumer
from rollstream.consumer.group_consumer import _READ_BLOCK_MS
from rollstream.runtime.redis_server import EmbeddedRedis
from rollstream.testing.sim import SimConfig, SimEngine


@pytest.fixture
async def slow_sim() -> AsyncIterator[SimEngine]:
    """Every sample takes 40 tokens x 0.05 s = 2 s: long enough to kill a producer mid-generation."""
    config = SimConfig(seed=1, mean_tokens=40, length_sigma=0.0, latency_per_token=0.05, accuracy=0.5)
    async with SimEngine(config) as engine:
        yield engine


async def pending_of(redis: Redis, ns: str, consumer: str) -> int:
    rows = await redis.xpending_range(Keys(ns).prompts, PRODUCERS_GROUP, min="-", max="+", count=100,
                                      consumername=consumer)
    return len(rows)


async def state(redis: Redis, ns: str) -> dict[str, int]:
    raw = await redis.hgetall(Keys(ns).state)
    out = {}
    for k, v in raw.items():
        try:
            out[k.decode()] = int(v)
        except ValueError:
            pass
    return out


async def groups_in_stream(redis: Redis, ns: str) -> list[int]:
    return [int(f[b"index"]) for _, f in await redis.xrange(Keys(ns).groups)]


async def wait_exit(child: subprocess.Popen[bytes], timeout: float = 20.0) -> int:
    """Wait in a thread: the simulator shares this event loop and must keep answering."""
    try:
        return await asyncio.to_thread(child.wait, timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"process {child.pid} did not exit within {timeout} s") from None


# -- producers killed, stopped, drained ---------------------------------------------------------


async def test_sigkill_mid_generation_prompts_taken_over(
    redis: Redis, redis_url: str, ns: str, slow_sim: SimEngine, procs: ProcessPool
) -> None:
    await make_namespace(redis, ns, lease_seconds=2)
    await add_prompts(redis, ns, 4)
    a = procs.producer(redis_url, ns, slow_sim.url, name="prod-a", concurrency=8)
    await wait_until(lambda: pending_of(redis, ns, "prod-a"), 15, message="A admits prompts")
    await wait_until(lambda: slow_sim.state.running >= 8, 15, message="A generating all 4 prompts")
    a.send_signal(signal.SIGKILL)
    assert await wait_exit(a) == -signal.SIGKILL
    assert (await state(redis, ns)).get("published", 0) == 0
    procs.producer(redis_url, ns, slow_sim.url, name="prod-b", concurrency=8)
    try:
        indexes = await take_all(redis_url, ns, 4, 4)
    except TimeoutError:
        raise AssertionError(procs.logs()) from None
    assert sorted(indexes) == [0, 1, 2, 3]
    st = await state(redis, ns)
    assert st["reclaimed"] == 4 and st["published"] == 4 and st["committed"] == 4
    assert st.get("duplicates_discarded", 0) == 0
    assert await redis.xlen(Keys(ns).prompts) == 0 and await redis.xlen(Keys(ns).groups) == 0


async def test_stopped_producer_past_its_lease_publishes_no_duplicate(
    redis: Redis, redis_url: str, ns: str, slow_sim: SimEngine, procs: ProcessPool
) -> None:
    await make_namespace(redis, ns, lease_seconds=2)
    await add_prompts(redis, ns, 2)
    a = procs.producer(redis_url, ns, slow_sim.url, name="prod-a", concurrency=4)
    await wait_until(lambda: slow_sim.state.running >= 4, 15, message="A generating both prompts")
    a.send_signal(signal.SIGSTOP)
    try:
        procs.producer(redis_url, ns, slow_sim.url, name="prod-b", concurrency=4)
        # B takes both prompts over once A's lease ran out, and publishes them while A sleeps.
        await wait_until(lambda: groups_in_stream(redis, ns), 20, message="B publishes")
        await wait_until(lambda: _len_is(redis, Keys(ns).groups, 2), 20, message="B publishes both")
        assert (await state(redis, ns))["reclaimed"] == 2
    finally:
        a.send_signal(signal.SIGCONT)
    # A wakes up with its finished generations and tries to publish them: the XACK says no.
    await wait_until(lambda: _state_at_least(redis, ns, "duplicates_discarded", 2), 20,
                     message="A's two duplicates discarded")
    await asyncio.sleep(1.0)
    assert sorted(await groups_in_stream(redis, ns)) == [0, 1]
    assert {f[b"producer"] for _, f in await redis.xrange(Keys(ns).groups)} == {b"prod-b"}
    st = await state(redis, ns)
    assert st["published"] == 2 and st["duplicates_discarded"] == 2
    assert "duplicate group discarded" in procs.log_of(a)
    assert sorted(await take_all(redis_url, ns, 2, 2)) == [0, 1]


async def _len_is(redis: Redis, key: str, n: int) -> bool:
    return await redis.xlen(key) == n


async def _state_at_least(redis: Redis, ns: str, name: str, n: int) -> bool:
    return (await state(redis, ns)).get(name, 0) >= n


async def test_sigterm_drains_in_flight_groups(
    redis: Redis, redis_url: str, ns: str, slow_sim: SimEngine, procs: ProcessPool
) -> None:
    await make_namespace(redis, ns)
    await add_prompts(redis, ns, 6)
    a = procs.producer(redis_url, ns, slow_sim.url, name="prod-a", concurrency=8)
    await wait_until(lambda: slow_sim.state.running >= 8, 15, message="A generating 4 prompts")
    a.send_signal(signal.SIGTERM)
    assert await wait_exit(a) == 0, procs.log_of(a)
    # The 4 in-flight prompts were finished and published; the 2 never admitted are still queued.
    assert sorted(await groups_in_stream(redis, ns)) == [0, 1, 2, 3]
    keys = Keys(ns)
    assert await redis.xlen(keys.prompts) == 2
    assert (await redis.xpending(keys.prompts, PRODUCERS_GROUP))["pending"] == 0


async def test_sigterm_past_drain_timeout_returns_prompts(
    redis: Redis, redis_url: str, ns: str, slow_sim: SimEngine, procs: ProcessPool
) -> None:
    await make_namespace(redis, ns)
    await add_prompts(redis, ns, 3)
    a = procs.producer(redis_url, ns, slow_sim.url, "--drain-timeout", "0.2", name="prod-a", concurrency=8)
    await wait_until(lambda: slow_sim.state.running >= 6, 15, message="A generating 3 prompts")
    a.send_signal(signal.SIGTERM)
    assert await wait_exit(a) == 0, procs.log_of(a)
    keys = Keys(ns)
    assert await redis.xlen(keys.groups) == 0
    assert (await redis.xpending(keys.prompts, PRODUCERS_GROUP))["pending"] == 0
    assert await redis.xlen(keys.prompts) == 0  # returned prompts are served first:
    assert sorted(int(f[b"index"]) for _, f in await redis.xrange(keys.retry)) == [0, 1, 2]
    assert (await state(redis, ns))["returned"] == 3
    # Another producer picks the returned prompts up (and nothing else).
    procs.producer(redis_url, ns, slow_sim.url, name="prod-b", concurrency=8)
    assert sorted(await take_all(redis_url, ns, 3, 3)) == [0, 1, 2]


async def test_producer_failure_raises_in_take_with_remote_traceback(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    await make_namespace(redis, ns)
    async with httpx.AsyncClient() as client:
        reply = await client.post(f"{sim.url}/sim/faults", json={"generate_errors": -1, "generate_error_status": 500})
        assert reply.status_code == 200
    await add_prompts(redis, ns, 1)
    a = procs.producer(redis_url, ns, sim.url, "--max-retries", "1", name="prod-a", concurrency=2)
    async with await GroupConsumer.connect(redis_url, ns, "trainer-t") as consumer:
        with pytest.raises(ProducerFailed) as caught:
            async with asyncio.timeout(120):
                await consumer.take(1)
    failure = caught.value
    assert failure.producer == "prod-a"
    assert "Traceback" in failure.remote_traceback and "EngineError" in failure.remote_traceback
    assert "500" in str(failure)
    assert await wait_exit(a) == 1, procs.log_of(a)
    keys = Keys(ns)
    assert [int(f[b"index"]) for _, f in await redis.xrange(keys.retry)] == [0]  # returned, served first
    assert (await redis.xpending(keys.retry, PRODUCERS_GROUP))["pending"] == 0


# -- the trainer ----------------------------------------------------------------------------------


async def test_trainer_killed_before_commit_gets_the_same_batch(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool, tmp_path: Path
) -> None:
    await make_namespace(redis, ns)
    await add_prompts(redis, ns, 4)
    procs.producer(redis_url, ns, sim.url, name="prod-a", concurrency=8)
    await wait_until(lambda: _len_is(redis, Keys(ns).groups, 4), 20, message="4 groups published")
    first, taken = await asyncio.to_thread(run_trainer, redis_url, ns, "hang")
    first.send_signal(signal.SIGKILL)
    await asyncio.to_thread(first.wait, 10)
    assert not taken["redelivered"]
    second, again = await asyncio.to_thread(run_trainer, redis_url, ns, "commit")
    assert await asyncio.to_thread(second.wait, 20) == 0
    assert again == {**taken, "redelivered": True}
    third, rest = await asyncio.to_thread(run_trainer, redis_url, ns, "commit")
    assert await asyncio.to_thread(third.wait, 20) == 0
    assert rest["id"] != taken["id"] and not rest["redelivered"]
    assert sorted(taken["indexes"] + rest["indexes"]) == [0, 1, 2, 3]
    st = await state(redis, ns)
    assert st["committed"] == 4
    assert await redis.xlen(Keys(ns).groups) == 0


# -- Redis itself ---------------------------------------------------------------------------------


async def test_redis_restart_mid_run_loses_nothing(ns: str, procs: ProcessPool, tmp_path: Path) -> None:
    config = SimConfig(seed=2, mean_tokens=16, length_sigma=0.3, latency_per_token=0.02, accuracy=0.5)
    with EmbeddedRedis(dir=tmp_path / "redis", appendonly=True, appendfsync="always",
                       binary=redis_binary_under_test()) as server:
        redis = connect(server.url)
        try:
            async with SimEngine(config) as engine:
                await make_namespace(redis, ns)
                await add_prompts(redis, ns, 16)
                for name in ("prod-a", "prod-b"):
                    procs.producer(server.url, ns, engine.url, name=name, concurrency=4)
                committed: list[int] = []
                restarted = False
                async with await GroupConsumer.connect(server.url, ns, "trainer-r") as consumer:
                    async with asyncio.timeout(60):
                        while len(committed) < 32:
                            batch = await consumer.take(4)
                            committed += [g.index for g in batch.groups]
                            await consumer.commit(batch)
                            if not restarted and len(committed) >= 8:
                                restarted = True
                                # SIGKILL: only what the AOF fsynced survives (appendfsync always).
                                await asyncio.to_thread(server.restart, kill=True, down_for=1.0)
                                await add_prompts(redis, ns, 16, start=16)
                st = await state(redis, ns)
        finally:
            await redis.aclose()
    assert sorted(committed) == list(range(32)), procs.logs()
    assert st["committed"] == 32 and st["published"] == 32


# -- garbage in the groups stream -----------------------------------------------------------------


def _group(index: int, n: int = 2, response: str = "\\boxed{1}") -> Group:
    samples = [
        Sample(index=i, tokens=array("i", [1, 2, 3]), response=response, response_length=2, reward=1.0,
               status=Status.COMPLETED, finish_reason="stop", weight_versions=[0])
        for i in range(n)
    ]
    return Group(index=index, prompt=f"p{index}", label="1", producer="hand", samples=samples)


async def test_malformed_entries_are_dead_lettered_and_take_goes_on(redis: Redis, redis_url: str, ns: str) -> None:
    await make_namespace(redis, ns)
    keys = Keys(ns)
    good = group_fields(_group(0))
    missing_samples = msgpack.unpackb(good["data"], raw=False)  # type: ignore[arg-type]
    del missing_samples["samples"]
    bad: list[tuple[dict[str, Any], str]] = [
        ({"index": 100, "data": b"\xc1\x00 not msgpack"}, "not_msgpack"),
        ({"index": 101, "data": msgpack.packb({"v": 99, "kind": "group"})}, "unknown_schema"),
        ({"index": 102, "status": "completed"}, "missing_field"),
        ({"index": 103, "data": msgpack.packb(missing_samples)}, "missing_field"),
        (group_fields(_group(104, n=3)), "wrong_group_size"),
        (group_fields(_group(105, response="x" * 5000)), "too_large"),
    ]
    for i, (fields, _) in enumerate(bad):
        await redis.xadd(keys.groups, fields)
        await redis.xadd(keys.groups, group_fields(_group(i)))
    limits = CodecLimits(max_payload_bytes=4096)
    async with await GroupConsumer.connect(redis_url, ns, "trainer-m", limits=limits) as consumer:
        async with asyncio.timeout(10):
            first = await consumer.take(4)
            second = await consumer.take(2)
        assert [g.index for g in first.groups] == [0, 1, 2, 3]
        assert [g.index for g in second.groups] == [4, 5]
        await consumer.commit(first)
        await consumer.commit(second)
    dead = await redis.xrange(keys.dead)
    assert len(dead) == len(bad)
    for (_, fields), (sent, reason) in zip(dead, bad, strict=True):
        assert fields[b"reason"].decode().startswith(reason + ":"), fields[b"reason"]
        assert fields[b"source"] == b"groups"
        assert fields[b"index"] == str(sent["index"]).encode()
        if reason == "wrong_group_size":  # decodable: dead letters hold its prompt, ready to requeue
            prompt = decode_prompt_entry(fields)
            assert (prompt.index, prompt.prompt, prompt.label) == (104, "p104", "1")
            assert prompt.input_ids is not None and prompt.input_ids.tolist() == [1]
        elif "data" in sent:
            assert fields[b"data"] == sent["data"]  # the raw bytes, untouched
        else:
            assert b"data" not in fields
    st = await state(redis, ns)
    assert st["dead_lettered"] == len(bad) and st["committed"] == 6
    assert await redis.xlen(keys.groups) == 0
    assert (await redis.xpending(keys.groups, TRAINER_GROUP))["pending"] == 0


# -- blocking reads ------------------------------------------------------------------------------


async def test_blocking_reader_socket_timeout_is_above_block(redis: Redis, redis_url: str, ns: str) -> None:
    """redis-py re-sends a command whose socket timed out: a BLOCK longer than the socket timeout
    would re-send XREADGROUP, and entries delivered to the lost reply stay pending unseen.

    Also the orphan case: take() cancelled mid-BLOCK, then a group arrives at once; Redis may
    still deliver it to the cancelled read (whose connection is being closed). The next take()
    must hand it out (it did not before the fix: it waited until a trainer restart)."""
    await make_namespace(redis, ns)
    async with await GroupConsumer.connect(redis_url, ns, "trainer-b") as consumer:
        timeout = consumer._blocking.connection_pool.connection_kwargs["socket_timeout"]
        assert timeout > _READ_BLOCK_MS / 1000 + 1
        # An empty stream: several full BLOCK periods pass without error or re-send, then it works.
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(2.5 * _READ_BLOCK_MS / 1000):
                await consumer.take(1)
        await redis.xadd(Keys(ns).groups, group_fields(_group(9)))
        async with asyncio.timeout(5):
            assert [g.index for g in (await consumer.take(1)).groups] == [9]


def test_no_pickle_anywhere() -> None:
    root = Path(__file__).resolve().parents[1]
    for folder in ("common", "producer", "consumer", "cli"):
        for path in (root / folder).rglob("*.py"):
            assert "import pickle" not in path.read_text(), path


