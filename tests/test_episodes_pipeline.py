"""User-written rollouts end to end: real Redis, real ``rollstream produce --generate`` processes,
the multi-turn simulator, a trainer that takes and commits. Accounting is exact: group counts,
dead letters, heartbeat counters (engine requests vs episodes), never timings."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable
from pathlib import Path

import pytest
from conftest import ProcessPool, add_prompts, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common.codec import decode_prompt_entry
from rollstream.common.errors import ProducerFailed
from rollstream.common.keys import Keys
from rollstream.common.models import Status
from rollstream.common.protocol import Heartbeat
from rollstream.consumer import GroupConsumer
from rollstream.testing.sim import SimEngine
from rollstream.testing.sim.simulator import detokenize
from test_faults import wait_exit

FNS = Path(__file__).with_name("episode_fns.py")
EXAMPLES = Path(__file__).parents[1] / "examples"


def fn(name: str) -> str:
    return f"{FNS}:{name}"


async def heartbeat(redis: Redis, ns: str, name: str) -> Heartbeat:
    raw = await redis.hget(Keys(ns).producers, name)  # type: ignore[misc]
    return Heartbeat.parse(raw) if raw else Heartbeat()


async def _count_is(count: Awaitable[int], expected: int) -> bool:
    return await count == expected


async def test_three_turn_episodes_from_the_calculator_example(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=3)
    await add_prompts(redis, ns, 3, text="What is 6 * 7? [tools=2]")
    procs.producer(redis_url, ns, sim.url, "--generate", f"{EXAMPLES / 'calculator.py'}:generate", name="calc")
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        async with asyncio.timeout(30):
            batch = await consumer.take(3)
        await consumer.commit(batch)
    assert sorted(g.index for g in batch.groups) == [0, 1, 2]
    for group in batch.groups:
        assert group.attempt == 0 and len(group.samples) == 2
        for sample in group.samples:
            text = detokenize(sample.response_tokens.tolist())
            assert text.count("<tool>calc: 6 * 7</tool>") == 2 and text.count("<result>42</result>") == 2
            mask = sample.loss_mask
            assert mask is not None
            masked = "".join(text[i] for i in range(sample.response_length) if not mask[i])
            assert masked == "<result>42</result>" * 2  # loss mask 0 exactly on the tool tokens
            assert sample.weight_versions == [0, 0, 0]
            spans = sample.weight_version_spans
            assert spans is not None and len(spans) == 3
    beat = await heartbeat(redis, ns, "calc")
    assert beat.episodes_failed == 0


async def test_a_hanging_tool_and_a_raising_tool_are_dead_lettered_the_others_unaffected(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4, max_attempts=2)
    keys = Keys(ns)
    await add_prompts(redis, ns, 1, start=0, text="HANG 1 + 1 [tools=1]")
    await add_prompts(redis, ns, 1, start=1, text="RAISE 1 + 1 [tools=1]")
    await add_prompts(redis, ns, 4, start=2, text="What is 2 + 2? [tools=1]")
    procs.producer(redis_url, ns, sim.url, "--generate", fn("calculator"), "--episode-timeout", "1", name="p")
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        async with asyncio.timeout(60):
            batch = await consumer.take(4)
        await consumer.commit(batch)
        assert sorted(g.index for g in batch.groups) == [2, 3, 4, 5]
        assert all(g.status == Status.COMPLETED for g in batch.groups)
        # The two bad prompts: FAILED each attempt (recycled once), then dead-lettered; a take
        # in progress is what recycles and dead-letters them.
        taking = asyncio.create_task(consumer.take(1))
        try:
            await wait_until(lambda: _count_is(redis.xlen(keys.dead), 2), timeout=60, message="two dead letters")
        finally:
            taking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await taking
    dead = {int(f[b"index"]): f for _, f in await redis.xrange(keys.dead)}
    assert sorted(dead) == [0, 1]
    assert b"episode deadline" in dead[0][b"reason"] and b"ToolFailed" in dead[1][b"reason"]
    async def settled() -> Heartbeat | None:
        beat = await heartbeat(redis, ns, "p")
        return beat if beat.episodes == 0 and beat.in_flight_prompts == 0 else None

    beat = await wait_until(settled, message="the producer idle")
    # 2 bad prompts x 3 attempts (max_attempts 2 recycles) x 2 members each
    assert beat.episodes_failed == 12 and beat.engine_requests == 0


async def test_unencodable_metadata_fails_the_sample_and_is_dead_lettered_the_producer_lives(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    """Metadata the wire format cannot carry (an object) is one FAILED sample with the reason,
    recycled and dead-lettered after max_attempts; the producer keeps publishing the others."""
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=3, max_attempts=2)
    keys = Keys(ns)
    await add_prompts(redis, ns, 1, start=0, text="OBJECT 1 + 1 [tools=1]")
    await add_prompts(redis, ns, 3, start=1, text="What is 2 + 2? [tools=1]")
    procs.producer(redis_url, ns, sim.url, "--generate", fn("object_metadata"), name="p")
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        async with asyncio.timeout(60):
            batch = await consumer.take(3)
        await consumer.commit(batch)
        assert sorted(g.index for g in batch.groups) == [1, 2, 3]
        assert all(g.status == Status.COMPLETED for g in batch.groups)
        taking = asyncio.create_task(consumer.take(1))
        try:
            await wait_until(lambda: _count_is(redis.xlen(keys.dead), 1), timeout=60, message="one dead letter")
        finally:
            taking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await taking
    dead_at_ms = int(time.time() * 1000)
    [(_, dead)] = await redis.xrange(keys.dead)
    assert int(dead[b"index"]) == 0
    assert b"metadata is not plain data" in dead[b"reason"], dead[b"reason"]

    async def settled() -> Heartbeat | None:  # a beat written after the last attempt was dead-lettered
        beat = await heartbeat(redis, ns, "p")
        fresh = beat.last_seen_ms > dead_at_ms
        return beat if fresh and beat.episodes == 0 and beat.in_flight_prompts == 0 else None

    beat = await wait_until(settled, timeout=30, message="a heartbeat of the producer idle")
    assert beat.state == "running"  # not fatal
    assert beat.episodes_failed == 6  # 3 attempts (max_attempts 2 recycles) x 2 members
    await add_prompts(redis, ns, 1, start=4, text="What is 3 + 3? [tools=1]")
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        async with asyncio.timeout(60):
            batch = await consumer.take(1)
        await consumer.commit(batch)
    assert [g.index for g in batch.groups] == [4]  # nothing lost: the producer still publishes


async def test_tool_time_holds_no_engine_capacity(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eight episodes, two engine slots: all eight sit in their tool at once while no engine
    request runs; the engine never sees more than two requests."""
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4)
    release = tmp_path / "release"
    monkeypatch.setenv("EPISODE_RELEASE", str(release))
    await add_prompts(redis, ns, 4, text="SLOWTOOL 3 + 4 [tools=1]")
    procs.producer(
        redis_url, ns, sim.url, "--generate", fn("calculator"), "--engine-concurrency", "2", name="cap",
        concurrency=8,
    )

    async def all_in_tools() -> bool:
        beat = await heartbeat(redis, ns, "cap")
        return beat.episodes == 8 and beat.engine_requests == 0

    await wait_until(all_in_tools, timeout=30, message="eight episodes in their tool, no engine request")
    release.touch()
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        async with asyncio.timeout(30):
            batch = await consumer.take(4)
        await consumer.commit(batch)
    assert all(g.status == Status.COMPLETED for g in batch.groups)
    beat = await heartbeat(redis, ns, "cap")
    assert beat.episodes_peak == 8 and beat.engine_requests_peak == 2
    assert sim.state.stats()["max_running_seen"] <= 2


async def test_a_broken_generate_function_is_fatal_and_loud_at_the_trainer(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4)
    await add_prompts(redis, ns, 4)
    producer = procs.producer(
        redis_url, ns, sim.url, "--generate", fn("not_a_sample"), "--generate-failure-limit", "3", name="bad"
    )
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        with pytest.raises(ProducerFailed) as caught:
            async with asyncio.timeout(30):
                await consumer.take(4)
    assert "GenerateBroken" in caught.value.remote_traceback and "returned a str" in str(caught.value)
    assert await wait_exit(producer) == 1, procs.log_of(producer)


@pytest.mark.slow
async def test_sigterm_mid_episode_hands_the_episode_back(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=1)
    keys = Keys(ns)
    release = tmp_path / "release"
    await add_prompts(redis, ns, 1, text="SLOWTOOL 3 + 4 [tools=1]")
    monkeypatch.setenv("EPISODE_RELEASE", str(release))
    first = procs.producer(redis_url, ns, sim.url, "--generate", fn("calculator"), "--drain-timeout", "1", name="a")

    async def in_tool() -> bool:
        beat = await heartbeat(redis, ns, "a")
        return beat.episodes == 2 and beat.engine_requests == 0

    await wait_until(in_tool, timeout=30, message="both episodes in their tool")
    first.send_signal(signal.SIGTERM)
    assert await wait_exit(first) == 0, procs.log_of(first)
    assert "returned 1 prompts" in procs.log_of(first)
    ((_, fields),) = await redis.xrange(keys.retry)
    assert decode_prompt_entry(fields).attempt == 0  # a drain is not the prompt's fault
    assert await redis.xlen(keys.groups) == 0
    release.touch()
    procs.producer(redis_url, ns, sim.url, "--generate", fn("calculator"), name="b")
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        async with asyncio.timeout(30):
            batch = await consumer.take(1)
        await consumer.commit(batch)
    (group,) = batch.groups
    assert (group.index, group.attempt, group.producer) == (0, 0, "b") and group.status == Status.COMPLETED


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        ["--generate", str(EXAMPLES / "calculator.py") + ":generate"],
        ["--generate", str(EXAMPLES / "search.py") + ":generate", "--tool", "search", "--limit", "sandbox=4",
         "--episode-timeout", "60", "--engine-concurrency", "16"],
    ],
    ids=["calculator", "search"],
)
def test_the_demo_runs_the_examples(flags: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rollstream.cli", "demo", "--steps", "2", "--producers", "1", "--no-plot", *flags],
        capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "16 groups committed" in result.stdout
