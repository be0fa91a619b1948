"""A rollout that blocks the event loop (issue 32, item 1): the stall is found, timed and named,
and costs only its own prompt's time: leases are renewed from a thread of their own, so no
other prompt is taken over. Real Redis, real producer processes, the simulator over HTTP.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from conftest import ProcessPool, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common.codec import prompt_fields
from rollstream.common.keys import Keys
from rollstream.common.models import Prompt
from rollstream.common.watchdog import LoopWatchdog, default_stall_after
from rollstream.consumer import GroupConsumer
from rollstream.runtime.redis_server import free_port
from rollstream.testing.sim import SimEngine
from test_inspect import inspect_json

FNS = Path(__file__).with_name("episode_fns.py")
LEASE = 3.0
BLOCK = 2 * LEASE
"""Each blocking call holds the loop for twice the lease: before, every prompt of that producer
(the blocked one included) was taken over by the other producer."""


async def test_a_blocking_rollout_is_named_and_takes_over_nothing(
    redis_url: str, redis: Redis, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4, lease_seconds=LEASE)
    total, blocked = 12, {0, 4, 8}
    for index in range(total):
        text = f"Compute {index} + 1 and box it." + (f" BLOCK={BLOCK}" if index in blocked else "")
        await redis.xadd(keys.prompts, prompt_fields(Prompt(index=index, prompt=text, label=str(index + 1))))
    port = free_port()
    producers = [
        procs.producer(redis_url, ns, sim.url, "--generate", f"{FNS}:blocking", *extra, name=f"stall-{i}")
        for i, extra in enumerate([("--metrics-port", str(port), "--metrics-host", "127.0.0.1"), ()])
    ]
    taken: Counter[int] = Counter()
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        async with asyncio.timeout(180):
            while sum(taken.values()) < total:
                batch = await consumer.take(min(4, total - sum(taken.values())))
                taken.update(g.index for g in batch.groups)
                assert await consumer.commit(batch) == len(batch)
    assert sorted(taken) == list(range(total)) and set(taken.values()) == {1}, taken

    # Nothing taken over, nothing generated twice: the leases outlived the stalls.
    state = {k.decode(): v.decode() for k, v in (await redis.hgetall(keys.state)).items()}
    assert int(state.get("reclaimed", 0)) == 0, procs.logs()
    assert int(state.get("duplicates_discarded", 0)) == 0, procs.logs()
    logs = "\n".join(procs.log_of(p) for p in producers)
    assert "lost the lease" not in logs, procs.logs()

    # Each stall logged once, with its length and the code that held the loop.
    stalls = [line for line in logs.splitlines() if "event loop stalled" in line and "in blocking" in line]
    assert len(stalls) == len(blocked), "\n".join(stalls) or procs.logs()
    for line in stalls:
        assert "episode_fns.py" in line and "time.sleep" in line and "asyncio.to_thread" in line, line
        seconds = float(line.split("event loop stalled ")[1].split(" s")[0])
        assert seconds >= BLOCK * 0.9, line

    # Counted in the heartbeats, shown by inspect (a warning naming the producer), exported.
    async def beats_counted() -> dict[str, dict[str, object]] | None:
        raw = await redis.hgetall(keys.producers)
        beats = {k.decode(): json.loads(v) for k, v in raw.items()}
        return beats if sum(int(b["loop_stalls"]) for b in beats.values()) >= len(blocked) else None

    beats = await wait_until(beats_counted, message="the stalls in the heartbeats")
    stalled = [name for name, b in beats.items() if b["loop_stalls"]]
    for name in stalled:
        assert float(beats[name]["loop_stall_longest_s"]) >= BLOCK * 0.9  # type: ignore[arg-type]
        assert "in blocking" in str(beats[name]["loop_stall_where"])
        assert beats[name]["loop_stall_after_s"] == default_stall_after(LEASE)
    _, snap = await inspect_json(redis_url, ns)
    warnings = [w for w in snap["health"]["warnings"] if "event loop stalled" in w]
    assert sorted(w.split(":")[0] for w in warnings) == sorted(stalled), snap["health"]
    assert all("in blocking" in w for w in warnings)
    if "stall-0" in stalled:
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
        count = [line for line in text.splitlines() if line.startswith("rollstream_loop_stall_seconds_count")]
        assert count and float(count[0].split()[-1]) == beats["stall-0"]["loop_stalls"], text
    await procs.astop_all()
    assert all(p.returncode == 0 for p in producers), procs.logs()


async def test_the_watchdog_names_the_code_holding_the_loop(caplog: pytest.LogCaptureFixture) -> None:
    """In-process: a 0.5 s ``time.sleep`` on a loop watched with a 0.2 s threshold is one stall,
    logged once, sampled in the function that slept; lags under the threshold are not stalls."""
    logger = logging.getLogger("test.watchdog")
    watchdog = LoopWatchdog("test", 0.2, logger)

    def hold_the_loop() -> None:
        time.sleep(0.5)  # the stall under test

    task = asyncio.create_task(watchdog.run())
    try:
        await asyncio.sleep(0.3)
        with caplog.at_level(logging.WARNING, logger="test.watchdog"):
            hold_the_loop()
            await wait_until(lambda: watchdog.stalls, message="the stall")
            await asyncio.sleep(0.3)  # a few ordinary ticks: no second stall
    finally:
        task.cancel()
    assert watchdog.stalls == 1 and watchdog.longest is not None
    assert 0.4 <= watchdog.longest.seconds < 5
    assert "hold_the_loop" in watchdog.longest.where and "time.sleep" in watchdog.longest.where
    assert "test_the_watchdog_names_the_code_holding_the_loop" in watchdog.longest.task
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert len(caplog.records) == 1 and "hold_the_loop" in caplog.records[0].getMessage()


async def test_the_feeder_watches_its_loop_too(
    redis: Redis, ns: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The feeder's loop has its watchdog (threshold a fifth of the lease): a stall while it
    feeds is logged with its length and where the loop was held."""
    from rollstream.producer.feeder import Feeder, FeedSettings, load_jsonl

    await make_namespace(redis, ns, lease_seconds=1.0)  # threshold 0.2 s
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "label": str(i)}) + "\n" for i in range(4)))
    feeder = Feeder(redis, load_jsonl(data), FeedSettings(namespace=ns, epochs=None, window=2))
    task = asyncio.create_task(feeder.run())
    try:
        await wait_until(lambda: redis.xlen(Keys(ns).prompts), message="the feeder running")
        await asyncio.sleep(0.3)
        with caplog.at_level(logging.WARNING, logger="rollstream.producer.feeder"):
            time.sleep(0.6)  # noqa: ASYNC251 -- the stall under test
            await wait_until(lambda: any("event loop stalled" in r.getMessage() for r in caplog.records),
                             message="the stall logged")
    finally:
        feeder.stop()
        await asyncio.wait_for(task, 30)
    (line,) = [r.getMessage() for r in caplog.records if "event loop stalled" in r.getMessage()]
    assert line.startswith(f"feeder (ns {ns})") and "test_the_feeder_watches_its_loop_too" in line, line


_WATCHED_CHILD = """
import asyncio, logging, sys
from rollstream.common.watchdog import LoopWatchdog
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")

async def main():
    watchdog = LoopWatchdog("child", 0.4, logging.getLogger("child"))
    task = asyncio.create_task(watchdog.run())
    print("ready", flush=True)
    while not getattr(watchdog, "stops", 0) and not watchdog.stalls:  # stops: counted apart since issue 43
        await asyncio.sleep(0.05)
    print(f"stops={getattr(watchdog, 'stops', 0)} stalls={watchdog.stalls}", flush=True)
    task.cancel()

asyncio.run(main())
"""


async def test_a_stopped_process_is_reported_as_stopped_not_as_code_holding_the_loop() -> None:
    """A real process under SIGSTOP for 1.5 s (threshold 0.4 s): nothing in it ran, so no code
    is named; the line says the process was stopped. Was: "event loop stalled ... held at" the
    selector's wait, with the hint to move blocking calls off the loop."""
    import signal
    import subprocess
    import sys

    child = await asyncio.create_subprocess_exec(sys.executable, "-c", _WATCHED_CHILD, stdout=subprocess.PIPE,
                                                 stderr=subprocess.STDOUT)
    assert child.stdout is not None
    try:
        async with asyncio.timeout(30):
            assert (await child.stdout.readline()).strip() == b"ready"
            await asyncio.sleep(0.5)  # a few ordinary ticks first
            child.send_signal(signal.SIGSTOP)
            await asyncio.sleep(1.5)  # the stop under test
            child.send_signal(signal.SIGCONT)
            out = (await child.stdout.read()).decode()
            assert await child.wait() == 0, out
    finally:
        if child.returncode is None:
            child.kill()
    assert "stops=1 stalls=0" in out, out
    assert "whole process was stopped for 1." in out and "held at" not in out, out
