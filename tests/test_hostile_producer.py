"""Hostile inputs on the producer side (issue 15): bad prompt entries, a producer that fails in
its first milliseconds, poison prompts and broken rewards, garbage engine replies, requests in
flight for too long. Real Redis, real producer processes; each test checks the accounting: every
prompt fed is committed once or dead-lettered, nothing else.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
from aiohttp import web
from conftest import ProcessPool, add_prompts, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common.codec import DEFAULT_LIMITS, decode_prompt_entry, group_fields, prompt_fields
from rollstream.common.config import PipelineConfig
from rollstream.common.errors import EngineError
from rollstream.common.events import recent_events
from rollstream.common.keys import PRODUCERS_GROUP, Keys
from rollstream.common.models import Group, Prompt, Sample, Status
from rollstream.consumer import GroupConsumer
from rollstream.consumer.verdict import Route, judge
from rollstream.producer.engine import EngineClient, EngineSettings
from rollstream.producer.rewards import load_reward
from rollstream.producer.settings import ProducerSettings
from rollstream.producer.worker import Producer
from rollstream.testing.sim import SimEngine
from test_inspect import polled_snapshot

TESTS_DIR = Path(__file__).resolve().parent
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
        child = procs.producer(redis_url, ns, NO_ENGINE, "--max-retries", "0", name=f"early-{round_}")
        code = await wait_exit(child, 30)
        assert code is not None, f"round {round_}: still running after 30 s\n{procs.log_of(child)}"
        assert code == 1, procs.log_of(child)
        fatal = [e for e in await recent_events(redis, keys) if e.kind == "fatal" and e.source == f"early-{round_}"]
        assert fatal and "EngineError" in fatal[0].message + fatal[0].traceback
    # Each prompt is back (in the prompt stream, or the retry stream when returned by the failing
    # producer) or dead-lettered (the bad one, once its task ran before the shutdown); nothing is
    # left pending or doubled.
    dead = await dead_reasons(redis, ns)
    queued = await redis.xlen(keys.prompts) + await redis.xlen(keys.retry)
    assert len(dead) <= 1 and queued + len(dead) == 2
    for stream in (keys.prompts, keys.retry):
        assert (await redis.xpending(stream, PRODUCERS_GROUP))["pending"] == 0


async def test_a_loop_whose_library_swallows_the_cancellation_still_ends(
    redis: Redis, redis_url: str, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The root cause, made deterministic: the control loop's subscribe swallows the cancellation
    (as Python 3.11's ``asyncio.wait_for`` inside redis-py did) while a fatal error stops the
    producer. The loop must end at its next turn, the fatal event be recorded, ``run()`` raise."""
    keys = Keys(ns)
    await make_namespace(redis, ns)
    await add_prompts(redis, ns, 1)
    engine = EngineClient(EngineSettings(urls=(NO_ENGINE,), max_retries=0, connect_timeout=1.0))
    producer = await Producer.connect(redis_url, ProducerSettings(namespace=ns, concurrency=2, name="swallower"),
                                      engine, load_reward("math"))
    subscribe = producer.control.subscribe
    swallowed = asyncio.Event()

    async def swallowing_subscribe(blocking: Redis) -> Any:
        try:
            await asyncio.sleep(2)
        except asyncio.CancelledError:
            swallowed.set()  # and carry on as if nothing happened
        return await subscribe(blocking)

    producer.control.subscribe = swallowing_subscribe  # type: ignore[method-assign]
    try:
        async with asyncio.timeout(20):
            with pytest.raises(EngineError):
                await producer.run()
    finally:
        await producer.aclose()
        await engine.aclose()
    assert swallowed.is_set()
    # The loop ended by itself at its next turn, not by being left behind after TASK_EXIT_TIMEOUT.
    assert "left behind" not in caplog.text
    [fatal] = [e for e in await recent_events(redis, keys) if e.kind == "fatal"]
    assert fatal.source == "swallower" and "EngineError" in fatal.message
    assert await redis.xlen(keys.prompts) + await redis.xlen(keys.retry) == 1  # returned, not lost
    for stream in (keys.prompts, keys.retry):
        assert (await redis.xpending(stream, PRODUCERS_GROUP))["pending"] == 0


# -- item 2: poison prompts and broken rewards ---------------------------------------------------


class Trainer:
    """A consumer taking and committing ``count`` usable groups one at a time in the background
    (FAILED groups it meets are recycled or dead-lettered by ``take()`` as they are read)."""

    def __init__(self, url: str, ns: str, count: int) -> None:
        self.groups: list[Group] = []
        self.task = asyncio.create_task(self._run(url, ns, count))

    async def _run(self, url: str, ns: str, count: int) -> None:
        async with await GroupConsumer.connect(url, ns, "trainer-h") as consumer:
            while len(self.groups) < count:
                batch = await consumer.take(1)
                self.groups += batch.groups
                assert await consumer.commit(batch) == len(batch)

    async def result(self, timeout: float) -> list[Group]:
        async with asyncio.timeout(timeout):
            await self.task
        return self.groups


async def add_prompt(redis: Redis, ns: str, index: int, text: str, label: Any = "1") -> None:
    await redis.xadd(Keys(ns).prompts, prompt_fields(Prompt(index=index, prompt=text, label=label)))


@pytest.fixture
def tests_on_pythonpath(monkeypatch: pytest.MonkeyPatch) -> None:
    """Producer processes can import the tests' reward modules."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")])))


POISON = {
    "sync": ["raise", "exit", "interrupt", "nan", "inf", "string", "short", "hang"],
    "async": ["raise", "exit", "nan", "hang"],
}


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_poison_prompts_cost_one_failed_group_each_and_are_dead_lettered(
    mode: str, redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool, tests_on_pythonpath: None
) -> None:
    """Each poison prompt fails its group on every attempt (raises, SystemExit, NaN, a string, a
    wrong-length list, hangs past the 1 s reward timeout, ...): recycled with attempt + 1, then
    dead-lettered; the good prompts are committed once each; the producer never exits."""
    await make_namespace(redis, ns, max_attempts=2)
    kinds = POISON[mode]
    for i, kind in enumerate(kinds):
        await add_prompt(redis, ns, i, f"Compute {i} + 1.")
        await add_prompt(redis, ns, 100 + i, f"BADREWARD:{kind} compute {i}.")
    fn = "poison_group" if mode == "sync" else "poison_group_async"
    producer = procs.producer(redis_url, ns, sim.url, "--reward-timeout", "1", "--reward-failure-limit", "50",
                              name=f"poisoned-{mode}", reward=f"hostile_rewards:{fn}")
    trainer = Trainer(redis_url, ns, len(kinds) + 1)
    await wait_until(lambda: _len(redis, Keys(ns).dead, len(kinds)), timeout=90, message=f"{len(kinds)} dead letters")
    await add_prompt(redis, ns, 99, "Compute 99 + 1.")  # the last one the trainer takes
    groups = await trainer.result(60)
    assert sorted(g.index for g in groups) == [*range(len(kinds)), 99]
    assert all(s.status == Status.COMPLETED and s.reward == 1.0 for g in groups for s in g.samples)
    dead = {int(f[b"index"]): f[b"reason"].decode() for _, f in await redis.xrange(Keys(ns).dead)}
    assert sorted(dead) == [100 + i for i in range(len(kinds))]
    assert all("max_attempts" in reason and "reward" in reason for reason in dead.values()), dead
    assert producer.poll() is None, procs.log_of(producer)
    st = await counters(redis, ns)
    assert st["committed"] == len(kinds) + 1 and st["dead_lettered"] == len(kinds)
    assert st["recycled_failed"] == 2 * len(kinds)  # attempts 0 and 1 recycled, attempt 2 dead
    assert await redis.xlen(Keys(ns).prompts) == 0 and await redis.xlen(Keys(ns).groups) == 0
    assert not [e for e in await recent_events(redis, Keys(ns)) if e.kind == "fatal"]
    # Logged once per cause (ValueError, SystemExit, ..., "invalid" for unusable values) and
    # minute, not once per failed group (3 x len(kinds) of them).
    failed_lines = [line for line in procs.log_of(producer).splitlines() if "group failed" in line]
    assert any("timed out after 1 s" in line for line in failed_lines)
    assert len(failed_lines) == {"sync": 5, "async": 4}[mode], failed_lines


async def test_a_math_reward_on_a_prompt_without_a_label_fails_that_prompt_only(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    await make_namespace(redis, ns, max_attempts=1)
    await add_prompts(redis, ns, 3)
    await add_prompt(redis, ns, 50, "Compute 50 + 1 and box it.", label=None)
    producer = procs.producer(redis_url, ns, sim.url, name="math-nolabel")
    trainer = Trainer(redis_url, ns, 4)
    await wait_until(lambda: _len(redis, Keys(ns).dead, 1), timeout=60, message="the unlabelled prompt dead-lettered")
    await add_prompts(redis, ns, 1, start=3)
    assert sorted(g.index for g in await trainer.result(60)) == [0, 1, 2, 3]
    [(_, dead)] = await redis.xrange(Keys(ns).dead)
    assert int(dead[b"index"]) == 50 and b"needs a label" in dead[b"reason"]
    assert producer.poll() is None
    st = await counters(redis, ns)
    assert st["committed"] == 4 and st["dead_lettered"] == 1 and st["recycled_failed"] == 1


async def test_a_reward_broken_for_every_prompt_is_fatal_with_a_clear_message(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool, tests_on_pythonpath: None
) -> None:
    """Not one poison prompt but a broken reward: after 3 distinct prompts failed in a row
    (``--reward-failure-limit 3``) the producer records a fatal event and exits 1."""
    keys = Keys(ns)
    await make_namespace(redis, ns)
    await add_prompts(redis, ns, 6)
    producer = procs.producer(redis_url, ns, sim.url, "--reward-failure-limit", "3", name="broken-reward",
                              concurrency=2, reward="hostile_rewards:always_raises")
    assert await wait_exit(producer, 60) == 1, procs.log_of(producer)
    [fatal] = [e for e in await recent_events(redis, keys) if e.kind == "fatal"]
    assert "failed on 3 distinct prompts in a row" in fatal.message and "this reward is broken" in fatal.message
    # Accounting: the failed groups published so far, plus the prompts returned or never admitted.
    groups = [int(f[b"index"]) for _, f in await redis.xrange(keys.groups)]
    prompts = [int(f[b"index"]) for stream in (keys.prompts, keys.retry) for _, f in await redis.xrange(stream)]
    assert len(groups) == 2 and sorted(groups + prompts) == list(range(6))
    for stream in (keys.prompts, keys.retry):
        assert (await redis.xpending(stream, PRODUCERS_GROUP))["pending"] == 0


async def _len(redis: Redis, key: str, n: int) -> bool:
    return await redis.xlen(key) >= n


async def test_a_group_past_max_attempts_is_dead_lettered_by_its_producer_not_left_in_the_backlog(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    """Issue 32, item 3. A prompt the engine always refuses, max_attempts 1: its first failed group
    is recycled by take(); its second can never be trained, so the producer that built it
    dead-letters it (the same reason text take() writes) instead of publishing it, and the backlog
    holds nothing no take will accept: a trainer done with its epoch takes nothing more."""
    keys = Keys(ns)
    await make_namespace(redis, ns, max_attempts=1)
    await add_prompt(redis, ns, 7, "POISON: the engine refuses this prompt")
    # concurrency n: one prompt at a time, so the order below is the order of the streams
    producer = procs.producer(redis_url, ns, sim.url, name="where-it-fails", concurrency=2)
    await wait_until(lambda: _len(redis, keys.groups, 1), message="the first failed group")
    await add_prompt(redis, ns, 8, "Compute 8 + 1 and box it.", label="9")
    await wait_until(lambda: _len(redis, keys.groups, 2), message="the good group behind it")
    async with await GroupConsumer.connect(redis_url, ns, "trainer-h") as consumer:
        batch = await asyncio.wait_for(consumer.take(1), 60)  # recycles the failed group, keeps the good one
        assert [g.index for g in batch.groups] == [8]
        assert await consumer.commit(batch) == 1
    # No take from here on: the retry fails again and is dead-lettered where it failed.
    await wait_until(lambda: _len(redis, keys.dead, 1), message="the retry dead-lettered by its producer")
    [(_, dead)] = await redis.xrange(keys.dead)
    assert dead[b"source"] == b"prompts" and int(dead[b"index"]) == 7, dead
    prompt = decode_prompt_entry(dead, DEFAULT_LIMITS)
    assert prompt.attempt == 2 and len(prompt.history) == 2
    assert prompt.history[0] == prompt.history[1]  # take()'s recycle line and the producer's: one rule
    assert prompt.history[0].startswith("failed: ") and "POISON" in prompt.history[0]
    # the reason take() would have written for that group
    failed = Group(index=7, prompt=prompt.prompt, attempt=1, history=prompt.history[:1], samples=[
        Sample(index=i, status=Status.FAILED, error=prompt.history[0].removeprefix("failed: ")) for i in range(2)
    ])
    verdict = judge(group_fields(failed), PipelineConfig(n_samples_per_prompt=2, batch_size=4, max_attempts=1),
                    version=0, staleness_limit=None)
    assert verdict.route == Route.DEAD_LETTER and dead[b"reason"].decode() == verdict.reason
    assert verdict.reason == f"max_attempts: recycled 2 times (> 1); last: {prompt.history[1]}"
    # Counted exactly: 2 published (the failed attempt 0, the good one), 1 recycled, 1 committed,
    # 1 dead; nothing left in any stream or pending.
    st = await counters(redis, ns)
    assert (st["published"], st["recycled_failed"], st["committed"], st["dead_lettered"]) == (2, 1, 1, 1), st
    for stream in (keys.prompts, keys.retry, keys.groups):
        assert await redis.xlen(stream) == 0, stream
    for stream in (keys.prompts, keys.retry):
        assert (await redis.xpending(stream, PRODUCERS_GROUP))["pending"] == 0
    assert "dead-lettered after 2 attempts" in procs.log_of(producer)
    assert producer.poll() is None, procs.log_of(producer)


# -- items 3 and 4: garbage engine replies, requests in flight for too long ----------------------


def _valid_reply(tokens: int = 8) -> dict[str, Any]:
    return {
        "text": "The answer is \\boxed{1}",
        "output_ids": list(range(1, tokens + 1)),
        "meta_info": {
            "finish_reason": {"type": "stop"},
            "output_token_logprobs": [[-0.5, i, None] for i in range(1, tokens + 1)],
            "weight_version": 0,
        },
    }


GARBAGE: dict[str, Callable[[], bytes]] = {
    "empty": lambda: b"{}",
    "no_meta": lambda: json.dumps({"text": "\\boxed{1}", "output_ids": [1, 2, 3]}).encode(),
    "nan": lambda: json.dumps(_valid_reply()).replace("-0.5", "NaN", 1).encode(),
    "inf": lambda: json.dumps(_valid_reply()).replace("-0.5", "-Infinity", 1).encode(),
    "huge": lambda: json.dumps(_valid_reply()).replace("-0.5", "-1e999", 1).encode(),
    "float32_overflow": lambda: json.dumps(_valid_reply()).replace("-0.5", "-1e39", 1).encode(),
    "short_logprobs": lambda: json.dumps(
        {**_valid_reply(), "meta_info": {**_valid_reply()["meta_info"], "output_token_logprobs": [[-0.5, 1, None]] * 2}}
    ).encode(),
}


class HostileEngine:
    """An SGLang-shaped ``/generate`` served in-process: a prompt ``GARBAGE:<kind> ...`` gets the
    garbage body of that kind, ``SLOW:<seconds> ...`` a valid reply after that long, ``HOLD ...``
    a valid reply once the test sets :attr:`release`, any other prompt a valid reply at once.
    Nothing else is served (``/tokenize``, ``/model_info``: 404)."""

    def __init__(self) -> None:
        self.requests: dict[str, int] = {}
        self.release = asyncio.Event()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _generate(self, request: web.Request) -> web.Response:
        text = str((await request.json()).get("text", ""))
        head, _, arg = text.split(" ", 1)[0].partition(":")
        self.requests[head] = self.requests.get(head, 0) + 1
        if head == "GARBAGE":
            return web.Response(body=GARBAGE[arg](), content_type="application/json")
        if head == "SLOW":
            await asyncio.sleep(float(arg))
        if head == "HOLD":
            await self.release.wait()
        return web.json_response(_valid_reply())

    async def __aenter__(self) -> HostileEngine:
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def hostile_engine() -> AsyncIterator[HostileEngine]:
    async with HostileEngine() as engine:
        yield engine


async def test_garbage_engine_replies_fail_their_sample_and_are_never_trained_on(
    redis: Redis, redis_url: str, ns: str, hostile_engine: HostileEngine, procs: ProcessPool
) -> None:
    """Each garbage shape (``{}``, no ``meta_info``, NaN / inf / out-of-range log-probs, 2
    log-probs for 8 tokens) fails its samples, never COMPLETED: the group is recycled, then
    dead-lettered with the parser's reason; the good prompts are trained on once each."""
    await make_namespace(redis, ns, max_attempts=1)
    kinds = list(GARBAGE)
    for i, kind in enumerate(kinds):
        await add_prompt(redis, ns, i, f"Compute {i} + 1.")
        await add_prompt(redis, ns, 100 + i, f"GARBAGE:{kind} compute {i}.")
    producer = procs.producer(redis_url, ns, hostile_engine.url, name="garbage-fed")
    trainer = Trainer(redis_url, ns, len(kinds) + 1)
    await wait_until(lambda: _len(redis, Keys(ns).dead, len(kinds)), timeout=60, message="every garbage prompt dead")
    await add_prompt(redis, ns, 99, "Compute 99 + 1.")
    groups = await trainer.result(60)
    assert sorted(g.index for g in groups) == [*range(len(kinds)), 99]  # 0 garbage groups trained on
    for sample in (s for g in groups for s in g.samples):
        assert sample.status == Status.COMPLETED and sample.rollout_log_probs is not None
        assert len(sample.rollout_log_probs) == sample.response_length == 8
        assert all(math.isfinite(lp) for lp in sample.rollout_log_probs)
    dead = {int(f[b"index"]): f[b"reason"].decode() for _, f in await redis.xrange(Keys(ns).dead)}
    assert sorted(dead) == [100 + i for i in range(len(kinds))]
    expected = {"empty": "schema", "no_meta": "schema", "nan": "not_json", "inf": "not_json", "huge": "schema",
                "float32_overflow": "non_finite_logprob", "short_logprobs": "count_mismatch"}
    for i, kind in enumerate(kinds):
        assert f"invalid engine reply from {hostile_engine.url}/generate: {expected[kind]}" in dead[100 + i], dead
    st = await counters(redis, ns)
    assert st["committed"] == len(kinds) + 1 and st["dead_lettered"] == len(kinds)
    assert st["recycled_failed"] == len(kinds)
    assert await redis.xlen(Keys(ns).prompts) == 0 and await redis.xlen(Keys(ns).groups) == 0
    assert producer.poll() is None
    # One log line per reason (rate-limited), not one per failed sample (2 x 2 x 7 of them).
    lines = [line for line in procs.log_of(producer).splitlines() if "sample failed: invalid engine reply" in line]
    assert len(lines) == len(set(expected.values())), lines


async def test_long_engine_requests_show_in_the_heartbeat_and_as_an_inspect_warning(
    redis: Redis, redis_url: str, ns: str, hostile_engine: HostileEngine, procs: ProcessPool
) -> None:
    await make_namespace(redis, ns)
    await add_prompts(redis, ns, 2)
    # Held by the engine until the warning was seen: no window for a loaded machine to miss.
    await add_prompt(redis, ns, 50, "HOLD compute 50.")
    procs.producer(redis_url, ns, hostile_engine.url, "--long-request-after", "2", name="slow-engine")

    async def warned() -> dict[str, Any] | None:
        snap = await polled_snapshot(redis, ns)
        row = next((p for p in snap["producers"] if p["name"] == "slow-engine"), None)
        # The two samples' requests start a moment apart: a heartbeat may count only the first.
        if row and row["long_requests"] >= 2:
            return {"row": row, "warnings": snap["health"]["warnings"]}
        return None

    seen = await wait_until(warned, timeout=30, interval=0.3, message="long requests in the heartbeat")
    _, shown = await inspect_json(redis_url, ns)  # the command shows the warning too (the requests are held)
    assert any("slow-engine: 2 sample(s) with an engine request in flight" in w for w in shown["health"]["warnings"])
    row = seen["row"]
    # oldest_request_s is rounded to 0.1 s: an age just over the threshold may read exactly 2.0.
    assert row["long_requests"] == 2 and row["long_request_s"] == 2 and row["oldest_request_s"] >= 2
    assert any("slow-engine: 2 sample(s) with an engine request in flight for over 2 s" in w for w in seen["warnings"])
    assert hostile_engine.requests.get("HOLD") == 2
    hostile_engine.release.set()
    assert sorted(await take_and_commit(redis_url, ns, 3)) == [0, 1, 50]

    async def cleared() -> bool:  # the slow requests ended: no warning from the next heartbeat on
        snap = await polled_snapshot(redis, ns)
        return not any("engine request in flight" in w for w in snap["health"]["warnings"])

    await wait_until(cleared, timeout=15, interval=0.3, message="the warning to go")
    st = await counters(redis, ns)
    assert st["committed"] == 3 and st.get("dead_lettered", 0) == 0


async def inspect_json(redis_url: str, ns: str) -> tuple[int, dict[str, Any]]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollstream.cli", "inspect", "--redis", redis_url, "--ns", ns, "--json",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode in (0, 1), err.decode()
    return proc.returncode, json.loads(out)
