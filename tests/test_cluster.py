"""Redis Cluster: three primaries with a replica each (Redis 7), started by the test.

Every key of a namespace carries the hash tag ``{ns}``, so each Lua script and each
transaction touches one slot. Three namespaces whose slots live on three different primaries
run at once, each with a producer process and a trainer on a ``redis+cluster://`` URL; the
trainers' pause/resume/version messages (pub/sub, which Cluster broadcasts to every node) reach
each producer; then the primary serving one namespace is SIGKILLed mid-run, its replica takes
over, and all three pipelines finish with every prompt exactly once; the failed-over namespace's
producer hears control messages again (from the promoted replica). Marked slow.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from conftest import ProcessPool, add_prompts, make_namespace
from redis_nodes import Cluster, redis7_binary
from rollstream.common.connection import MAX_CONNECTIONS, connect
from rollstream.common.keys import PRODUCERS_GROUP, TRAINER_GROUP, Keys, StateField
from rollstream.common.protocol import EpisodeJournals, PromptQueue
from rollstream.consumer import GroupConsumer
from rollstream.testing.sim import SimConfig, SimEngine

pytestmark = pytest.mark.slow

PROMPTS = 32
BATCH = 4


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    topology = await asyncio.to_thread(Cluster(redis7_binary(), tmp_path / "cluster").start)
    yield topology
    topology.stop()


@pytest.fixture
async def paced_sim() -> AsyncIterator[SimEngine]:
    config = SimConfig(seed=4, mean_tokens=10, length_sigma=0.0, latency_per_token=0.03, accuracy=0.5)
    async with SimEngine(config) as engine:
        yield engine


def spread_namespaces(cluster: Cluster, prefix: str) -> list[str]:
    """Three namespaces whose hash slots are served by three different primaries."""
    chosen: dict[int, str] = {}
    for i in range(200):
        name = f"{prefix}-{i}"
        port = cluster.owner_of(Keys(name).state).port
        chosen.setdefault(port, name)
        if len(chosen) == 3:
            return list(chosen.values())
    raise AssertionError("could not spread namespaces over three primaries")


async def test_three_namespaces_on_three_primaries_survive_a_primary_failover(
    cluster: Cluster, paced_sim: SimEngine, procs: ProcessPool, ns: str
) -> None:
    url = cluster.url
    names = spread_namespaces(cluster, ns)
    admin = connect(url)
    for name in names:
        await make_namespace(admin, name, n_samples_per_prompt=2, batch_size=BATCH, lease_seconds=3.0)
        await add_prompts(admin, name, PROMPTS)
        procs.producer(url, name, paced_sim.url, name=f"prod-{name}")
    victim = cluster.owner_of(Keys(names[0]).state)
    taken: dict[str, list[int]] = {name: [] for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    killed_at: list[float] = []

    async def train(name: str) -> None:
        async with await GroupConsumer.connect(url, name, "trainer", stall_timeout=120) as consumer:
            step = 0
            while len(set(taken[name])) < PROMPTS:
                batch = await consumer.take(min(BATCH, PROMPTS - len(set(taken[name]))))
                taken[name] += [g.index for g in batch.groups]
                await consumer.commit(batch)
                times[name].append(time.monotonic())
                step += 1
                if step == 1:
                    await consumer.pause()
                    await asyncio.sleep(0.3)
                    await consumer.resume(step)
                else:
                    await consumer.set_weight_version(step)
                if name == names[0] and not killed_at and len(taken[name]) >= PROMPTS // 3:
                    victim.kill()
                    killed_at.append(time.monotonic())

    async with asyncio.timeout(60):
        await asyncio.gather(*(train(name) for name in names))
    promoted = cluster.owner_of(Keys(names[0]).state)
    assert promoted.port != victim.port
    # The failed-over namespace's producer listens again: its control channel now lives on the
    # promoted replica, and a new version message reaches it.
    victim_log = procs.children[0][0]
    async with await GroupConsumer.connect(url, names[0], "trainer") as consumer:
        deadline = time.monotonic() + 20
        for version in range(100, 200):
            await consumer.set_weight_version(version)
            await asyncio.sleep(0.5)
            if "control message b'version 1" in procs.log_of(victim_log):
                break
            assert time.monotonic() < deadline, procs.log_of(victim_log)[-3000:]
    await procs.astop_all()
    for child, _ in procs.children:
        assert child.returncode == 0, procs.logs()
    figures = {}
    for name in names:
        keys = Keys(name)
        state = {k.decode(): int(v) for k, v in (await admin.hgetall(keys.state)).items() if v.isdigit()}
        figures[name] = {
            "groups_lost": PROMPTS - len(set(taken[name])),
            "groups_taken_twice": sum(c - 1 for c in Counter(taken[name]).values() if c > 1),
            "duplicates_discarded": state.get("duplicates_discarded", 0),
            "prompts_reclaimed": state.get("reclaimed", 0),
            "left_pending": (await admin.xpending(keys.prompts, PRODUCERS_GROUP))["pending"]
            + (await admin.xpending(keys.groups, TRAINER_GROUP))["pending"],
        }
        assert set(taken[name]) == set(range(PROMPTS)), name
        log = procs.log_of(procs.children[names.index(name)][0])
        for message in ("b'pause'", "b'resume 1'", "b'version 2'"):
            assert f"control message {message}" in log, (name, message, log[-2000:])
    after = [t for t in times[names[0]] if t > killed_at[0]]
    figures["failover_recovery_s"] = round(after[0] - killed_at[0], 2)  # type: ignore[assignment]
    print("CLUSTER FIGURES", json.dumps(figures))
    await admin.aclose()


async def test_more_commands_at_once_than_a_nodes_pool_holds_wait_instead_of_failing(cluster: Cluster) -> None:
    """redis-py's cluster pools hold 100 connections per node and raise MaxConnectionsError past
    them; a producer has a command in flight per busy task (~220 at 1024 episodes): the client
    keeps at most MAX_CONNECTIONS commands in flight, the others wait."""
    client = connect(cluster.url, name="rollstream-cluster-pool-test")
    commands = 3 * 100
    try:
        # one hash tag: every key on one node; each BLPOP holds its connection for 0.2 s
        results = await asyncio.gather(*(client.blpop([f"{{pool}}-{i}"], timeout=0.2) for i in range(commands)))
        assert results == [None] * commands
        owner = connect(f"redis://127.0.0.1:{cluster.owner_of('{pool}').port}/0")
        try:
            opened = [c for c in await owner.client_list() if c.get("name") == "rollstream-cluster-pool-test"]
        finally:
            await owner.aclose()
        # one more than the bound: the connection that read the topology (CLUSTER SLOTS)
        assert 0 < len(opened) <= MAX_CONNECTIONS + 1, f"{len(opened)} connections to one node"
    finally:
        await client.aclose()


async def test_the_journal_sweep_checks_the_entry_a_journal_names_on_cluster(cluster: Cluster) -> None:
    """The sweep's keys are only the namespace's (journals found by a SCAN of the slot's node, the
    stream a journal names one of the script's declared keys): it runs on a Cluster."""
    client = connect(cluster.url)
    ns = "sweep-cluster"
    keys = Keys(ns)
    try:
        await make_namespace(client, ns, durable_episodes=True)
        kept = await client.xadd(keys.prompts, {"index": 0, "epoch": 0})
        gone = await client.xadd(keys.prompts, {"index": 1, "epoch": 0})
        await client.xreadgroup(PRODUCERS_GROUP, "a", {keys.prompts: ">"}, count=2)
        journals = EpisodeJournals(client, keys, "a")
        for index, entry_id in ((0, kept), (1, gone)):
            assert await journals.append(stream=keys.prompts, entry_id=entry_id, index=index, epoch=0, member=0,
                                         seq=0, budget=0, step=b"s") == "ok"
        assert await PromptQueue(client, keys, "a").give_back(keys.prompts, kept, {"index": 0, "epoch": 0})
        await client.xdel(keys.prompts, gone)
        await client.hset(keys.episode(2, 0), mapping={"0:0": b"s", "n:0": 1, "bytes": 1})  # no pointer, no prompt
        # an eval prompt of index 0 beside training's: its journal in the namespace's slot too
        lane = await client.xadd(keys.eval_prompts, {"index": 0, "epoch": 0, "eval": "ev"})
        await client.xreadgroup(PRODUCERS_GROUP, "a", {keys.eval_prompts: ">"}, count=1)
        assert await journals.append(stream=keys.eval_prompts, entry_id=lane, index=0, epoch=0, member=0, seq=0,
                                     budget=0, step=b"e", eval_name="ev") == "ok"
        swept = 0
        async with asyncio.timeout(30):
            while True:
                swept += await journals.sweep(100)
                if not int(await client.hget(keys.state, StateField.JOURNAL_SWEEP_CURSOR) or 0):
                    break
        assert swept == 2
        assert await client.exists(keys.episode(0, 0), keys.episode(0, 0, "ev")) == 2
        assert await client.exists(keys.episode(1, 0), keys.episode(2, 0)) == 0
    finally:
        await client.aclose()
