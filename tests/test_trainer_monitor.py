"""``TrainerMonitor``: a waiting take's diagnosis is one pipelined round trip on real Redis and reads
what the single reads read; the stall and health checks of ``take()`` use nothing else."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from conftest import add_prompts, make_namespace
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from rollstream.common.events import FATAL, now_ms, recent_events, record_event
from rollstream.common.keys import Keys, StateField
from rollstream.common.namespace import read_state
from rollstream.common.protocol import Heartbeat, Heartbeats, TrainerMonitor
from rollstream.consumer import GroupConsumer, PipelineStalled


class RoundTrips:
    """Counts the round trips of one client: its commands and its pipelines' executions."""

    def __init__(self, redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
        self.commands: list[Any] = []
        self.pipelines = 0
        command = redis.execute_command

        async def counted_command(*args: Any, **kwargs: Any) -> Any:
            self.commands.append(args[0])
            return await command(*args, **kwargs)

        execute = Pipeline.execute

        async def counted_execute(pipe: Pipeline, *args: Any, **kwargs: Any) -> Any:
            self.pipelines += 1
            return await execute(pipe, *args, **kwargs)

        monkeypatch.setattr(redis, "execute_command", counted_command)
        monkeypatch.setattr(Pipeline, "execute", counted_execute)

    @property
    def total(self) -> int:
        return len(self.commands) + self.pipelines


async def test_diagnose_is_one_round_trip_and_reads_what_the_single_reads_read(
    redis: Redis, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = await make_namespace(redis, ns, max_staleness=1)
    keys = Keys(ns)
    await add_prompts(redis, ns, 3)
    beat = Heartbeat(host="h", pid=1, state="running", in_flight_samples=4, engine_retries=2, last_seen_ms=now_ms())
    await Heartbeats(redis, keys).write("p0", beat)
    await record_event(redis, keys, FATAL, source="p0", message="engine gone")
    for i in range(30):  # the first fatal event falls out of the newest 20 events read
        await record_event(redis, keys, "warning", source="p0", message=f"w{i}")
    await record_event(redis, keys, FATAL, source="p1", message="reward broken")
    await redis.hset(keys.state, mapping={StateField.COMMITTED: 6, StateField.PAUSED: 1})
    monitor = TrainerMonitor(redis, keys)
    await monitor.admission_terms(config)  # the guard's first call reads the server's run_id

    trips = RoundTrips(redis, monkeypatch)
    diagnosis = await monitor.diagnose(config)
    assert trips.total == 1 and trips.pipelines == 1, trips.commands
    monkeypatch.undo()

    assert diagnosis.heartbeats == await Heartbeats(redis, keys).raw()
    assert diagnosis.state == await read_state(redis, keys)
    assert diagnosis.terms == await TrainerMonitor(redis, keys).admission_terms(config)
    assert (diagnosis.queued, diagnosis.groups_length, diagnosis.waiting) == (3, 0, 0)
    newest_fatal = await recent_events(redis, keys, count=1, kind=FATAL)
    assert diagnosis.fatal == newest_fatal[0] and diagnosis.fatal.message == "reward broken"
    for _ in range(20):  # the newest fatal event falls out of the newest 20: neither finds it
        await record_event(redis, keys, "warning", source="p0", message="later")
    assert (await monitor.diagnose(config)).fatal is None and not await recent_events(redis, keys, 1, FATAL)


async def test_a_stalled_take_diagnoses_in_one_round_trip(
    redis: Redis, redis_url: str, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no producer past ``stall_timeout``, the take's stall check and its health check together
    read Redis once (they made seven sequential round trips before the diagnosis was one read)."""
    await make_namespace(redis, ns)
    async with GroupConsumer.connect(redis_url, ns, "trainer", stall_timeout=0.2) as consumer:
        with pytest.raises(PipelineStalled):
            async with asyncio.timeout(30):
                while True:  # short takes: the stall clock runs across them
                    try:
                        async with asyncio.timeout(0.1):
                            await consumer.take(1)
                    except TimeoutError:
                        pass
        consumer._stall.checked = 0.0  # due again at once
        trips = RoundTrips(consumer.redis, monkeypatch)
        with pytest.raises(PipelineStalled):
            await consumer.take(1)
        monkeypatch.undo()
        # (the name lease's renewal, a script every 2.5 s, may run meanwhile)
        assert trips.pipelines == 1 and not [c for c in trips.commands if c not in ("EVALSHA", "EVAL")], trips.commands
