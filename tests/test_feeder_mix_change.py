"""A mix changed under a running feeder (issue 49 finding 12), with real processes and signals:
`init --force` refuses while a feeder runs; a feeder that missed the change (SIGSTOPped past its
beat) stops loudly when it wakes; take() waiting on the source nobody feeds names it."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
from pathlib import Path

import pytest
from conftest import ProcessPool, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common.keys import Keys
from rollstream.consumer import GroupConsumer
from rollstream.producer.feeder import Feeder, FeedSettings, load_jsonl


def _write(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "label": "1"}) + "\n" for p in prompts))
    return path


async def test_init_force_refuses_a_running_feeder_and_a_stalled_one_stops_loudly(
    redis: Redis, redis_url: str, ns: str, tmp_path: Path, procs: ProcessPool, caplog: pytest.LogCaptureFixture
) -> None:
    keys = Keys(ns)
    await make_namespace(redis, ns, mix="a=1,b=1", heartbeat_timeout=2.0)
    a = _write(tmp_path / "a.jsonl", [f"a{i}" for i in range(50)])
    b = _write(tmp_path / "b.jsonl", [f"b{i}" for i in range(50)])
    feeder = procs.start("feed", "--redis", redis_url, "--ns", ns, f"a={a}", f"b={b}", "--forever", "--window", "4",
                         log_name="feed")
    await wait_until(lambda: _xlen(redis, keys.prompts, 4), message="the window filled\n" + procs.logs())

    refused = procs.start("init", "--redis", redis_url, "--ns", ns, "--n-samples", "2", "--batch-size", "4",
                          "--heartbeat-timeout", "2", "--mix", "a=1,c=1", "--force", log_name="refused")
    assert await asyncio.to_thread(refused.wait, 120) == 2, procs.logs()
    assert f"a running feeder: {socket.gethostname()} pid {feeder.pid}" in procs.log_of(refused), procs.logs()
    assert b"b=1" in (await redis.hget(keys.config, "mix") or b"")  # unchanged

    os.kill(feeder.pid, signal.SIGSTOP)  # a feeder that misses the change: stopped past its beat
    try:
        await wait_until(lambda: _gone(redis, keys.feeder), message="the stopped feeder's beat lapsed")
        changed = procs.start("init", "--redis", redis_url, "--ns", ns, "--n-samples", "2", "--batch-size", "4",
                              "--heartbeat-timeout", "2", "--mix", "a=1,c=1", "--force", log_name="changed")
        assert await asyncio.to_thread(changed.wait, 120) == 0, procs.logs()
    finally:
        os.kill(feeder.pid, signal.SIGCONT)
    await redis.xtrim(keys.prompts, maxlen=2)  # room: the woken feeder would feed on
    assert await asyncio.to_thread(feeder.wait, 120) == 2, procs.logs()
    log = procs.log_of(feeder)
    assert "the namespace's mix changed while feeding, from 'a=1,b=1' to 'a=1,c=1'" in log, log
    assert "source(s) c not fed by this feed; source(s) b fed here not in it" in log, log
    assert await redis.exists(keys.feeder) == 0

    # the trainer's take() waits on source c, fed by nobody: its warning names it (a is fed, alive)
    warnings = await _take_warnings(redis_url, ns, caplog, 3)
    assert warnings and all("source(s) 'c' (0 of its 2 taken, 0 fed ever, none alive)" in w for w in warnings), warnings
    assert all("'a' (" not in w for w in warnings)


async def test_a_new_mix_of_the_same_sources_is_adopted_by_the_running_feeder(
    redis: Redis, ns: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The same sources reweighted (the config written while the feeder runs, as after a lapsed
    beat): the feeder says so and feeds by the new weights instead of stopping."""
    keys = Keys(ns)
    await make_namespace(redis, ns, mix="a=1,b=1", heartbeat_timeout=1.0)
    sources = {n: load_jsonl(_write(tmp_path / f"{n}.jsonl", [f"{n}{i}" for i in range(40)])) for n in "ab"}
    caplog.set_level(logging.WARNING, logger="rollstream")
    feeder = Feeder(redis, sources, FeedSettings(namespace=ns, window=2, poll_interval=0.02))
    task = asyncio.create_task(feeder.run())
    try:
        await wait_until(lambda: _xlen(redis, keys.prompts, 2), message="the window filled")
        await redis.hset(keys.config, "mix", "a=3,b=1")
        await wait_until(lambda: feeder.weights == {"a": 3.0, "b": 1.0}, message="the feeder adopted the new mix")
    finally:
        feeder.stop()
        await task
    assert any("mix changed from 'a=1,b=1' to 'a=3,b=1': feeding by the new weights" in r.getMessage()
               for r in caplog.records)


async def _take_warnings(redis_url: str, ns: str, caplog: pytest.LogCaptureFixture, seconds: float) -> list[str]:
    """The warnings of a ``take(4)`` that waits ``seconds`` in vain (one every 0.1 s)."""
    caplog.set_level(logging.WARNING, logger="rollstream")
    async with await GroupConsumer.connect(redis_url, ns, "trainer-t", warn_interval=0.1) as consumer:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(seconds):
                await consumer.take(4)
    return [r.getMessage() for r in caplog.records if "take(4) waiting" in r.getMessage()]


async def _xlen(redis: Redis, key: str, count: int) -> bool:
    return bool(await redis.xlen(key) >= count)


async def _gone(redis: Redis, key: str) -> bool:
    return not await redis.exists(key)


async def test_take_waiting_on_a_source_nobody_feeds_names_it(
    redis: Redis, redis_url: str, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """take(4) on a mix whose sources nothing feeds: its periodic warning names each of them, and
    what to run (it used to wait without naming them)."""
    await make_namespace(redis, ns, mix="a=1,c=3")
    warnings = await _take_warnings(redis_url, ns, caplog, 2)
    assert warnings, [r.getMessage() for r in caplog.records]
    assert "source(s) 'a' (0 of its 1 taken, 0 fed ever, none alive), 'c' (0 of its 3 taken" in warnings[0]
    assert "is a feeder feeding them? (rollstream feed NAME=PATH" in warnings[0]
