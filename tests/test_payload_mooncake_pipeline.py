"""The payload plane end to end on a real Mooncake cluster (issue 48): a real ``mooncake_master``
and real store processes on loopback, real producer processes with MoE routing replay (48 layers
x top-8 of 128 experts, 256-token replies: ~96 KiB of replay per sample) against the simulator,
a real trainer, real Redis. Every prompt is trained exactly once, and when the run is over
Mooncake holds no object and the ledgers are empty; faults are real SIGKILLs of a producer and
of the store process holding the published groups' bytes."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import ProcessPool, add_prompts, make_namespace, stopped, take_all, wait_until
from redis.asyncio import Redis
from rollstream.common.keys import Keys, StateField
from rollstream.common.protocol.objects import PayloadLedger
from rollstream.consumer import GroupConsumer
from rollstream.testing.mooncake_cluster import MooncakeCluster, mooncake_unavailable
from rollstream.testing.sim.simulator import SimConfig, SimEngine, routed_expert

UNAVAILABLE = mooncake_unavailable()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"Mooncake cannot run here: {UNAVAILABLE}")

MOE = "48x8x128"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[MooncakeCluster]:
    """A short read lease (2 s: frees after a read are confirmed soon) and a dead store process
    dropped after 5 s (a live one's heartbeat must come within it, on a loaded machine too)."""
    with MooncakeCluster(tmp_path / "mooncake", segment="256MB", lease_ms=2000, client_ttl=5) as running:
        yield running


@pytest.fixture
async def r3_sim() -> AsyncIterator[SimEngine]:
    async with SimEngine(SimConfig(seed=1, mean_tokens=256, length_sigma=0.0, latency_per_token=0.0005,
                                   accuracy=0.5, moe=(48, 8, 128))) as engine:
        yield engine


async def nothing_left(redis: Redis, ns: str, cluster: MooncakeCluster) -> None:
    """No object in Mooncake and the ledgers empty: every fate's frees (confirmed by Mooncake,
    past its read leases) and the sweep caught up."""
    ledger = PayloadLedger(redis, Keys(ns))

    async def clean() -> bool:
        h = await ledger.held()
        keys = await asyncio.to_thread(cluster.keys)
        return not keys and (h.objects, h.bytes, h.intents, h.to_free) == (0, 0, 0, 0)

    await wait_until(clean, 60, interval=0.2, message="no payload object left in Mooncake")


async def counter(redis: Redis, ns: str, name: str) -> int:
    return int(await redis.hget(Keys(ns).state, name) or 0)


async def test_r3_groups_through_mooncake_lost_0_doubled_0_orphan_swept(
    redis: Redis, redis_url: str, ns: str, r3_sim: SimEngine, procs: ProcessPool, cluster: MooncakeCluster,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A producer SIGKILLed between its put and its PUBLISH leaves objects nobody claims in
    Mooncake; the others' reclaim turn sweeps them. 12 prompts, trained once each. (A lease of
    4 s: the two live producers renew theirs every 1.3 s, so a loaded machine does not make one
    take over the other's prompt, which the no-duplicate count below would see.)"""
    await make_namespace(redis, ns, lease_seconds=4, payload_store=cluster.url, payload_min_bytes=64 * 1024)
    await add_prompts(redis, ns, 12)
    monkeypatch.setenv("ROLLSTREAM_FAULT_STOP", "after_put")
    a = procs.producer(redis_url, ns, r3_sim.url, "--routed-experts", MOE, name="prod-a", concurrency=2)
    await wait_until(lambda: _true(stopped(a)), 60, message="prod-a stops after its put")
    orphans = await asyncio.to_thread(cluster.keys)
    assert len(orphans) == 2  # one group of two samples, one object each, in Mooncake
    a.send_signal(signal.SIGKILL)
    assert await asyncio.to_thread(a.wait, 10) == -signal.SIGKILL
    monkeypatch.delenv("ROLLSTREAM_FAULT_STOP")
    for name in ("prod-b", "prod-c"):
        procs.producer(redis_url, ns, r3_sim.url, "--routed-experts", MOE, "--reclaim-interval", "0.5",
                       name=name, concurrency=4)
    keys = Keys(ns)
    await wait_until(lambda: _xlen_at_least(redis, keys.groups, 1), 60, message="a group published")
    entry = (await redis.xrange(keys.groups, count=1))[0][1]
    assert int(entry[b"store_bytes"]) > 2 * 90_000 and int(entry[b"bytes"]) < 16 * 1024  # the bulk left Redis
    try:
        indexes = await take_all(redis_url, ns, 12, 4, timeout=120)
    except TimeoutError:
        raise AssertionError(procs.logs() + cluster.logs()) from None
    assert sorted(indexes) == list(range(12))  # lost 0, doubled 0
    await nothing_left(redis, ns, cluster)
    assert await counter(redis, ns, StateField.PAYLOAD_SWEPT) == 1  # the group's one object set
    assert await counter(redis, ns, StateField.DUPLICATES) == 0
    assert await counter(redis, ns, StateField.PAYLOAD_FREED) >= 24  # 12 groups x 2 objects, and the orphans


async def test_store_process_killed_groups_recycled_with_the_reason(
    redis: Redis, redis_url: str, ns: str, r3_sim: SimEngine, procs: ProcessPool, cluster: MooncakeCluster,
) -> None:
    """The store process holding every published group's bytes SIGKILLed (a second one up): the
    trainer's reads fail, each such group is recycled with the error naming the store and the
    key, generated again into the live store process, and trained once."""
    await make_namespace(redis, ns, lease_seconds=5, payload_store=cluster.url, payload_min_bytes=64 * 1024)
    await add_prompts(redis, ns, 4)
    procs.producer(redis_url, ns, r3_sim.url, "--routed-experts", MOE, "--reclaim-interval", "0.5",
                   name="prod-a", concurrency=4)
    keys = Keys(ns)
    await wait_until(lambda: _xlen_at_least(redis, keys.groups, 4), 60, message="4 groups published")
    held = await asyncio.to_thread(cluster.keys)
    assert len(held) == 8  # all of them in the one store process
    cluster.start_store()
    cluster.kill_store(0)
    await add_prompts(redis, ns, 4, start=4)
    try:
        indexes = await take_all(redis_url, ns, 8, 4, timeout=120)
    except TimeoutError:
        raise AssertionError(procs.logs() + cluster.logs()) from None
    assert sorted(indexes) == list(range(8))  # lost 0, doubled 0
    assert await counter(redis, ns, StateField.RECYCLED_PAYLOAD) == 4
    assert await counter(redis, ns, StateField.PAYLOAD_READ_FAILURES) == 4
    reason = (await redis.hget(keys.state, StateField.PAYLOAD_LAST_FAILURE) or b"").decode()
    assert f"payload store {cluster.url}: object '" in reason and any(key in reason for key in held), reason
    await nothing_left(redis, ns, cluster)
    assert all(child.poll() is None for child, _ in procs.children), procs.logs()  # no producer stopped


async def test_each_rank_fetches_its_share_from_mooncake_with_the_engines_rows(
    redis: Redis, redis_url: str, ns: str, r3_sim: SimEngine, procs: ProcessPool, cluster: MooncakeCluster,
) -> None:
    """``payload_check="size"``: take() only asks the master for the objects' sizes (no read
    lease taken, so the frees after commit are not refused), each rank's shard fetches its own
    groups on first access, and the routing rows are the engine's, byte for byte."""
    await make_namespace(redis, ns, payload_store=cluster.url, payload_min_bytes=64 * 1024)
    await add_prompts(redis, ns, 4)
    procs.producer(redis_url, ns, r3_sim.url, "--routed-experts", MOE, "--reclaim-interval", "0.5",
                   name="prod-a", concurrency=4)
    await wait_until(lambda: _xlen_at_least(redis, Keys(ns).groups, 4), 60, message="4 groups published")
    async with await GroupConsumer.connect(redis_url, ns, "trainer-t", payload_check="size") as consumer:
        async with asyncio.timeout(60):
            batch = await consumer.take(4)
        assert len(batch.unfetched) == 4
        shards = [batch.shard(rank, 2) for rank in range(2)]
        rank0 = shards[0].routed_experts_numpy()  # fetched on first access: rank 0's groups only
        assert all(view is not None and view.shape[1:] == (48, 8) for view in rank0)
        assert not shards[0].unfetched and len(batch.unfetched) == 2
        await shards[1].fetch()
        layers, topk, experts = 48, 8, 128
        for group in batch.groups:
            for sample in group.samples:
                assert sample.routed_experts is not None
                got = sample.routed_experts.numpy()
                tokens = np.frombuffer(sample.tokens, dtype=np.int32)[:-1]
                want = np.array([[[routed_expert(int(t), layer, k, experts) for k in range(topk)]
                                  for layer in range(layers)] for t in tokens], dtype=np.uint8)
                np.testing.assert_array_equal(got, want.reshape(got.shape))
        assert await consumer.commit(batch) == 4
    await nothing_left(redis, ns, cluster)


@pytest.mark.slow
async def test_master_killed_producer_fails_loudly_restarted_master_groups_recycled(
    redis: Redis, redis_url: str, ns: str, r3_sim: SimEngine, procs: ProcessPool, cluster: MooncakeCluster,
) -> None:
    """The master SIGKILLed with 4 groups published: the producer's next put fails (RPC_FAIL) and
    it stops loudly, handing its prompt back; the master restarted knows no object (no HA), so
    the 4 groups are recycled as missing and generated again by a new producer; each prompt is
    trained once, and the frees of the lost objects are confirmed (they are gone)."""
    await make_namespace(redis, ns, lease_seconds=5, payload_store=cluster.url, payload_min_bytes=64 * 1024)
    await add_prompts(redis, ns, 4)
    a = procs.producer(redis_url, ns, r3_sim.url, "--routed-experts", MOE, "--reclaim-interval", "0.5",
                       name="prod-a", concurrency=4)
    keys = Keys(ns)
    await wait_until(lambda: _xlen_at_least(redis, keys.groups, 4), 60, message="4 groups published")
    cluster.kill_master()
    await add_prompts(redis, ns, 4, start=4)
    assert await asyncio.to_thread(a.wait, 120) == 1, procs.log_of(a)
    assert "RPC_FAIL" in procs.log_of(a) and cluster.url in procs.log_of(a)
    await asyncio.to_thread(cluster.start_master)
    await asyncio.to_thread(cluster.wait_store, cluster.stores[0])
    procs.producer(redis_url, ns, r3_sim.url, "--routed-experts", MOE, "--reclaim-interval", "0.5",
                   name="prod-b", concurrency=4)
    indexes: list[int] = []
    async with await GroupConsumer.connect(redis_url, ns, "trainer-t", on_producer_failure="warn") as consumer:
        try:
            async with asyncio.timeout(180):
                while len(indexes) < 8:
                    batch = await consumer.take(min(4, 8 - len(indexes)))
                    indexes += [g.index for g in batch.groups]
                    assert await consumer.commit(batch) == len(batch)
        except TimeoutError:
            raise AssertionError(procs.logs() + cluster.logs()) from None
    assert sorted(indexes) == list(range(8))  # lost 0, doubled 0
    assert await counter(redis, ns, StateField.RECYCLED_PAYLOAD) == 4
    reason = (await redis.hget(keys.state, StateField.PAYLOAD_LAST_FAILURE) or b"").decode()
    assert f"payload store {cluster.url}: object '" in reason and "not in the Mooncake store" in reason, reason
    await nothing_left(redis, ns, cluster)


async def _true(value: bool) -> bool:
    return value


async def _xlen_at_least(redis: Redis, key: str, n: int) -> bool:
    return int(await redis.xlen(key)) >= n
