"""Sentinel failover: a primary, a replica and three sentinels (Redis 7) on this machine. Two
producer processes and the trainer use a ``redis+sentinel://`` URL; the primary is SIGKILLed
mid-run, Sentinel promotes the replica, and everyone reconnects to it on their own.

Redis replication is asynchronous: writes the primary acknowledged but had not yet sent to the
replica are lost at failover. The test measures what that costs rollstream (groups lost,
prompts reclaimed, duplicates discarded, groups the trainer received twice, recovery time), with
and without ``wait_replicas=1`` (every script waits for the replica; its cost is measured too).
Marked slow.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from conftest import ProcessPool, add_prompts, make_namespace, wait_until
from redis_nodes import SentinelSet, redis7_binary
from rollstream.common.connection import connect
from rollstream.common.keys import PRODUCERS_GROUP, TRAINER_GROUP, Keys
from rollstream.consumer import GroupConsumer
from rollstream.testing.sim import SimConfig, SimEngine

pytestmark = pytest.mark.slow

PROMPTS = 96
BATCH = 4


@pytest.fixture
async def sentinels(tmp_path: Path) -> AsyncIterator[SentinelSet]:
    topology = SentinelSet(redis7_binary(), tmp_path / "sentinel").start()
    yield topology
    topology.stop()


@pytest.fixture
async def half_second_sim() -> AsyncIterator[SimEngine]:
    config = SimConfig(seed=3, mean_tokens=10, length_sigma=0.0, latency_per_token=0.05, accuracy=0.5)
    async with SimEngine(config) as engine:
        yield engine


@pytest.mark.parametrize("wait", [0, 1], ids=["async-replication", "wait-replicas-1"])
async def test_primary_killed_mid_run(
    sentinels: SentinelSet, half_second_sim: SimEngine, procs: ProcessPool, ns: str, wait: int
) -> None:
    url = sentinels.url + (f"?wait_replicas={wait}&wait_timeout_ms=1000" if wait else "")
    keys = Keys(ns)
    admin = connect(sentinels.url)
    await make_namespace(admin, ns, n_samples_per_prompt=2, batch_size=BATCH, lease_seconds=3.0, max_backlog=64)
    await add_prompts(admin, ns, PROMPTS)
    for name in ("s1", "s2"):
        procs.producer(url, ns, half_second_sim.url, name=name)
    taken: list[int] = []
    batch_times: list[float] = []
    killed_at = None
    old_port = sentinels.master_port()
    async with await GroupConsumer.connect(url, ns, "trainer", stall_timeout=120) as consumer:
        async with asyncio.timeout(150):
            while len(set(taken)) < PROMPTS:
                batch = await consumer.take(min(BATCH, PROMPTS - len(set(taken))))
                taken += [g.index for g in batch.groups]
                await consumer.commit(batch)
                batch_times.append(time.monotonic())
                if killed_at is None and len(taken) >= PROMPTS // 3:
                    sentinels.primary.kill()
                    killed_at = time.monotonic()
                    rejoin = asyncio.create_task(_rejoin_as_replica(sentinels, old_port))
    assert killed_at is not None
    await rejoin
    new_port = sentinels.master_port()
    assert new_port == sentinels.replica.port != old_port
    after = [t for t in batch_times if t > killed_at]
    recovery = after[0] - killed_at
    await procs.astop_all()
    for child, _ in procs.children:
        assert child.returncode == 0, procs.logs()
    state = {k.decode(): int(v) for k, v in (await admin.hgetall(keys.state)).items() if v.isdigit()}
    doubled = sum(c - 1 for c in Counter(taken).values() if c > 1)
    leftover_pending = (await admin.xpending(keys.groups, TRAINER_GROUP))["pending"]
    figures = {
        "mode": "wait_replicas=1" if wait else "async replication",
        "groups_lost": PROMPTS - len(set(taken)), "groups_taken_twice": doubled,
        "duplicates_discarded": state.get("duplicates_discarded", 0), "prompts_reclaimed": state.get("reclaimed", 0),
        "recovery_s": round(recovery, 2), "run_s": round(batch_times[-1] - batch_times[0], 2),
        "commits_left_pending": leftover_pending,
        "prompts_left_pending": (await admin.xpending(keys.prompts, PRODUCERS_GROUP))["pending"],
    }
    print("SENTINEL FIGURES", json.dumps(figures))
    await admin.aclose()
    assert set(taken) == set(range(PROMPTS)), "no group lost"
    for child, _ in procs.children:  # each producer rode the failover out by itself
        log = procs.log_of(child)
        assert "lost Redis" in log and "Redis is back" in log, log[-3000:]


async def _rejoin_as_replica(sentinels: SentinelSet, old_port: int) -> None:
    """What systemd or Kubernetes does: the killed primary comes back (empty, no persistence
    here) once the failover is done, and Sentinel turns it into the new primary's replica."""

    async def failed_over() -> bool:
        # every sentinel must name the new primary first: a client asking one that does not yet
        # would be sent to the old port, where the restarted (empty) primary answers
        ports = await asyncio.to_thread(sentinels.master_ports)
        return len(ports) == 1 and old_port not in ports

    await wait_until(failed_over, timeout=60, interval=0.2, message="Sentinel's failover")
    await asyncio.to_thread(sentinels.primary.start)


async def test_wait_replicas_cost(sentinels: SentinelSet, ns: str) -> None:
    """Latency of one script call with and without ``WAIT 1`` (replica on loopback)."""
    results = {}
    for wait in (0, 1):
        client = connect(sentinels.url + (f"?wait_replicas={wait}" if wait else ""))
        script = client.register_script("return redis.call('HINCRBY', KEYS[1], 'n', 1)")
        await script(keys=[Keys(ns).state])
        samples = []
        for _ in range(500):
            started = time.perf_counter()
            await script(keys=[Keys(ns).state])
            samples.append((time.perf_counter() - started) * 1000)
        samples.sort()
        results[wait] = {"p50_ms": round(statistics.median(samples), 3), "p99_ms": round(samples[494], 3)}
        await client.aclose()
    print("WAIT COST", json.dumps(results))
    assert results[1]["p50_ms"] >= results[0]["p50_ms"] * 0.8  # waited, so not faster
