"""The payload plane under faults (issue 48 item 5), with real processes, real signals and a
real ``fs`` store: a producer SIGKILLed between its put and its PUBLISH and right after it, a
damaged or missing object, a full directory (a real 1 MiB tmpfs, as root), a trainer SIGKILLed
between take and commit. Each run ends with every prompt trained exactly once, no object left
in the store and the ledgers empty."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ProcessPool, add_prompts, make_namespace, stopped, take_all, wait_until
from killable_trainer import run_trainer
from redis.asyncio import Redis
from rollstream.common.errors import ProducerFailed
from rollstream.common.events import now_ms
from rollstream.common.keys import Keys, StateField
from rollstream.common.payload.refs import member_keys
from rollstream.common.protocol.objects import PayloadLedger
from rollstream.consumer import GroupConsumer
from rollstream.testing.sim.simulator import SimConfig, SimEngine
from test_payload_pipeline import MOE, check_rows, objects_in
from tmpfs import mounted_tmpfs

MOE_FLAG = "x".join(map(str, MOE))


@pytest.fixture
async def moe_sim() -> AsyncIterator[SimEngine]:
    async with SimEngine(SimConfig(seed=1, mean_tokens=100, length_sigma=0.0, latency_per_token=0.001,
                                   accuracy=0.5, moe=MOE)) as engine:
        yield engine


async def kill_at(child: subprocess.Popen[bytes], procs: ProcessPool, what: str) -> None:
    await wait_until(lambda: _true(stopped(child)), 30, message=f"the producer stops {what}")
    child.send_signal(signal.SIGKILL)
    assert await asyncio.to_thread(child.wait, 10) == -signal.SIGKILL


async def _true(value: bool) -> bool:
    return value


async def nothing_left(redis: Redis, ns: str, store: Path) -> None:
    """No object in the store and the ledgers empty: the sweep and the frees caught up."""
    ledger = PayloadLedger(redis, Keys(ns))

    async def clean() -> bool:
        h = await ledger.held()
        return not objects_in(store) and (h.objects, h.bytes, h.intents, h.to_free) == (0, 0, 0, 0)

    await wait_until(clean, 30, message="no payload object left")


async def counter(redis: Redis, ns: str, name: str) -> int:
    return int(await redis.hget(Keys(ns).state, name) or 0)


@pytest.mark.parametrize("point", ["after_put", "after_publish"])
async def test_producer_killed_around_publish_loses_and_leaks_nothing(
    redis: Redis, redis_url: str, ns: str, moe_sim: SimEngine, procs: ProcessPool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, point: str,
) -> None:
    store = tmp_path / "store"
    await make_namespace(redis, ns, lease_seconds=2, payload_store=f"fs://{store}", payload_min_bytes=1024)
    await add_prompts(redis, ns, 4)
    monkeypatch.setenv("ROLLSTREAM_FAULT_STOP", point)
    a = procs.producer(redis_url, ns, moe_sim.url, "--routed-experts", MOE_FLAG, name="prod-a", concurrency=2)
    await kill_at(a, procs, point)
    monkeypatch.delenv("ROLLSTREAM_FAULT_STOP")
    keys = Keys(ns)
    written = objects_in(store)
    assert len(written) == 2  # the one group's two objects are in the store
    if point == "after_put":
        assert await redis.xlen(keys.groups) == 0
        intents = [k.decode() for k in await redis.zrange(keys.payload_intents, 0, -1)]
        assert len(intents) == 1 and member_keys(intents[0]) == written  # one intent for the group's set
    else:
        assert await redis.xlen(keys.groups) == 1
        assert await redis.zcard(keys.payload_intents) == 0 and await redis.hlen(keys.payload_held) == 1
    procs.producer(redis_url, ns, moe_sim.url, "--routed-experts", MOE_FLAG, "--reclaim-interval", "0.5",
                   name="prod-b", concurrency=4)
    try:
        indexes = await take_all(redis_url, ns, 4, 2, timeout=60)
    except TimeoutError:
        raise AssertionError(procs.logs()) from None
    assert sorted(indexes) == [0, 1, 2, 3]  # lost 0, doubled 0
    await nothing_left(redis, ns, store)
    assert await counter(redis, ns, StateField.PAYLOAD_SWEPT) == (1 if point == "after_put" else 0)  # one group's set
    assert await counter(redis, ns, StateField.DUPLICATES) == 0


@pytest.mark.parametrize("damage", ["checksum", "missing"])
async def test_an_unreadable_object_recycles_its_group_with_the_reason(
    redis: Redis, redis_url: str, ns: str, moe_sim: SimEngine, procs: ProcessPool, tmp_path: Path, damage: str,
) -> None:
    store = tmp_path / "store"
    await make_namespace(redis, ns, payload_store=f"fs://{store}", payload_min_bytes=1024)
    await add_prompts(redis, ns, 1)
    a = procs.producer(redis_url, ns, moe_sim.url, "--routed-experts", MOE_FLAG, name="prod-a")
    keys = Keys(ns)
    await wait_until(lambda: _xlen(redis, keys.groups, 1), 30, message="the group is published")
    procs.stop_all()
    assert await asyncio.to_thread(a.wait, 20) == 0
    victim = objects_in(store)[0]
    path = store / victim
    if damage == "checksum":
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0xFF  # same size, one byte wrong
        path.write_bytes(bytes(raw))
    else:
        path.unlink()
    await add_prompts(redis, ns, 1, start=1)
    procs.producer(redis_url, ns, moe_sim.url, "--routed-experts", MOE_FLAG, name="prod-b")
    async with await GroupConsumer.connect(redis_url, ns, "trainer-t") as consumer:
        async with asyncio.timeout(60):
            batch = await consumer.take(2)
        assert sorted(g.index for g in batch.groups) == [0, 1]  # prompt 0 again, generated anew
        again = next(g for g in batch.groups if g.index == 0)
        assert again.attempt == 0 and again.history[-1].startswith("payload: payload store")  # not the prompt's fault
        for group in batch.groups:
            check_rows(group)
        assert batch.metrics["recycled_payload"] == 1.0
        assert await consumer.commit(batch) == 2
    reason = (await redis.hget(keys.state, StateField.PAYLOAD_LAST_FAILURE) or b"").decode()
    assert f"payload store fs://{store}" in reason and victim in reason
    assert ("CRC-32" if damage == "checksum" else "no file") in reason
    assert await counter(redis, ns, StateField.PAYLOAD_READ_FAILURES) == 1
    assert await counter(redis, ns, StateField.RECYCLED_PAYLOAD) == 1
    await nothing_left(redis, ns, store)
    from rollstream.ops.snapshot import snapshot

    snap = await snapshot(redis, keys)
    assert snap["payload"]["read_failures"] == 1 and victim in snap["payload"]["last_failure"]
    assert any(w.startswith("payload_read_failures 1: ") and victim in w for w in snap["health"]["warnings"])


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs (mounting needs root)."""
    with mounted_tmpfs(tmp_path / "small", "1m") as mount:
        yield mount


@pytest.fixture
async def big_moe_sim() -> AsyncIterator[SimEngine]:
    async with SimEngine(SimConfig(seed=1, mean_tokens=100, length_sigma=0.0, latency_per_token=0.001,
                                   accuracy=0.5, moe=(48, 8, 128))) as engine:
        yield engine


async def test_a_full_store_fails_the_producer_loudly_and_loses_nothing(
    redis: Redis, redis_url: str, ns: str, big_moe_sim: SimEngine, procs: ProcessPool, small_tmpfs: Path,
) -> None:
    """20 groups of 2 x ~44 KiB objects do not fit in 1 MiB: the producer retries a few times,
    backing off, then fails (recorded, exit 1, its prompts returned); the trainer takes what was
    published (freeing room), and a new producer finishes the rest."""
    await make_namespace(redis, ns, payload_store=f"fs://{small_tmpfs}", payload_min_bytes=1024, max_backlog=64)
    await add_prompts(redis, ns, 20)
    moe = "48x8x128"  # 384 bytes of routing a token: ~40 KiB per 100-token sample
    a = procs.producer(redis_url, ns, big_moe_sim.url, "--routed-experts", moe, name="prod-a", concurrency=2)
    keys = Keys(ns)
    consumer = await GroupConsumer.connect(redis_url, ns, "trainer-t", on_producer_failure="raise")
    try:
        with pytest.raises(ProducerFailed, match="no room"):
            async with asyncio.timeout(90):
                while True:  # wait, never taking: the store fills up
                    await consumer.take(64)
        assert await asyncio.to_thread(a.wait, 30) == 1
        log = procs.log_of(a)
        assert log.count("payload store full, retrying") == 3  # backed off, did not spin
        assert not [p for p in objects_in(small_tmpfs, hidden=True) if "/." in f"/{p}"]  # no partial object left
        published = int(await redis.xlen(keys.groups))
        assert 0 < published < 20
    finally:
        await consumer.aclose()
    procs.producer(redis_url, ns, big_moe_sim.url, "--routed-experts", moe, name="prod-b", concurrency=2)
    indexes: list[int] = []
    # the same trainer again (prod-a's failure is known: warned, not raised)
    async with await GroupConsumer.connect(redis_url, ns, "trainer-t", on_producer_failure="warn") as consumer:
        async with asyncio.timeout(90):
            while len(indexes) < 20:  # committing frees room: prod-b goes on
                batch = await consumer.take(1)
                indexes += [g.index for g in batch.groups]
                await consumer.commit(batch)
    assert sorted(indexes) == list(range(20))
    await nothing_left(redis, ns, small_tmpfs)


async def test_trainer_killed_between_take_and_commit_gets_its_batch_and_arrays_again(
    redis: Redis, redis_url: str, ns: str, moe_sim: SimEngine, procs: ProcessPool, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    await make_namespace(redis, ns, payload_store=f"fs://{store}", payload_min_bytes=1024)
    await add_prompts(redis, ns, 4)
    procs.producer(redis_url, ns, moe_sim.url, "--routed-experts", MOE_FLAG, name="prod-a")
    await wait_until(lambda: _xlen(redis, Keys(ns).groups, 4), 30, message="4 groups published")
    first, taken = await asyncio.to_thread(run_trainer, redis_url, ns, "hang", rows=True)
    first.send_signal(signal.SIGKILL)
    await asyncio.to_thread(first.wait, 10)
    assert len(objects_in(store)) == 8  # nothing freed: the batch is not committed
    second, again = await asyncio.to_thread(run_trainer, redis_url, ns, "commit", rows=True)
    assert await asyncio.to_thread(second.wait, 30) == 0
    assert again == {**taken, "redelivered": True}  # the same batch, the same arrays
    assert all(r > 0 for r in again["rows"])
    third, rest = await asyncio.to_thread(run_trainer, redis_url, ns, "commit", rows=True)
    assert await asyncio.to_thread(third.wait, 30) == 0
    assert sorted(taken["indexes"] + rest["indexes"]) == [0, 1, 2, 3]
    await nothing_left(redis, ns, store)


async def _xlen(redis: Redis, key: str, n: int) -> bool:
    return int(await redis.xlen(key)) == n


async def test_a_duplicate_publish_frees_its_own_objects(
    redis: Redis, redis_url: str, ns: str, moe_sim: SimEngine, procs: ProcessPool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A producer stopped between its put and its PUBLISH past the lease: another takes the prompt
    over and publishes it; the first wakes up, its PUBLISH finds the XACK done (a duplicate) and
    its objects are freed, never claimed: one group trained, no object left. The stopped
    producer's intent is pushed an hour out while it sleeps (the same ZADD its put makes): however
    slow a loaded machine makes the take-over, the sweep never reaches it first (with its own
    deadline, two leases after the put, it did once), so the duplicate's PUBLISH is what frees it."""
    store = tmp_path / "store"
    await make_namespace(redis, ns, lease_seconds=4, payload_store=f"fs://{store}", payload_min_bytes=1024)
    await add_prompts(redis, ns, 1)
    monkeypatch.setenv("ROLLSTREAM_FAULT_STOP", "after_put")
    a = procs.producer(redis_url, ns, moe_sim.url, "--routed-experts", MOE_FLAG, name="prod-a", concurrency=2)
    await wait_until(lambda: _true(stopped(a)), 30, message="prod-a stops after its put")
    monkeypatch.delenv("ROLLSTREAM_FAULT_STOP")
    a_objects = objects_in(store)
    keys = Keys(ns)
    (intent,) = [k.decode() for k in await redis.zrange(keys.payload_intents, 0, -1)]
    assert member_keys(intent) == a_objects  # the group's one intent, the sweep's to take past its deadline
    await PayloadLedger(redis, keys).intend([intent], now_ms() + 3_600_000)
    try:
        procs.producer(redis_url, ns, moe_sim.url, "--routed-experts", MOE_FLAG, name="prod-b", concurrency=2)
        await wait_until(lambda: _xlen(redis, keys.groups, 1), 30, message="prod-b publishes the prompt")
    finally:
        a.send_signal(signal.SIGCONT)
    await wait_until(lambda: _at_least(redis, ns, StateField.DUPLICATES, 1), 30, message="prod-a's duplicate")
    # the counter is PUBLISH's (in Redis); the log line comes after the script returns
    await wait_until(lambda: _true("duplicate group discarded" in procs.log_of(a)), 30, message="prod-a says so")
    assert await take_all(redis_url, ns, 1, 1, timeout=30) == [0]
    await nothing_left(redis, ns, store)
    assert len(a_objects) == 2
    assert await counter(redis, ns, StateField.PAYLOAD_SWEPT) == 0  # freed as a duplicate's, not as orphans
    assert await counter(redis, ns, StateField.PUBLISHED) == 1


async def _at_least(redis: Redis, ns: str, name: str, n: int) -> bool:
    return await counter(redis, ns, name) >= n


async def test_a_resumed_episode_reads_its_journal_steps_from_the_store(
    redis: Redis, redis_url: str, ns: str, procs: ProcessPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Durable episodes with a payload store: the steps (replies with their routing rows) are
    objects, the journal holds references; the producer that takes the prompt over after the
    first is stopped reads them back and asks the engine nothing; the journal's objects go with
    the publish."""
    from rollstream.testing.sim.simulator import routed_expert
    from test_durable_episodes import _tool_lines, fn
    from test_payload_pipeline import held

    layers, topk, experts = moe = (4, 2, 16)
    store = tmp_path / "store"
    tool_log = tmp_path / "tools.log"
    await make_namespace(redis, ns, n_samples_per_prompt=1, batch_size=1, lease_seconds=3.0, durable_episodes=True,
                         payload_store=f"fs://{store}", payload_min_bytes=64)
    await add_prompts(redis, ns, 1, text="Compute 2 + 2.")
    monkeypatch.setenv("TOOL_LOG", str(tool_log))
    monkeypatch.setenv("BLOCK_AT", "end")
    r3 = ("--generate", fn("turns_then_tool"), "--routed-experts", "x".join(map(str, moe)))
    keys = Keys(ns)
    async with SimEngine(SimConfig(seed=1, mean_tokens=16, latency_per_token=0.001, accuracy=0.5, moe=moe)) as sim:
        first = procs.producer(redis_url, ns, sim.url, *r3, name="a")
        await wait_until(lambda: _true(any(rest == "final tool" for _, rest in _tool_lines(tool_log))), 60,
                         message="every engine call journaled, in the last tool")
        journal = await redis.hgetall(keys.episode(0, 0))
        refs = [v for k, v in journal.items() if k.startswith(b"0:") and v.startswith(b"\xc1")]
        assert refs and sorted(journal[b"objects"].decode().split()) == objects_in(store)
        first.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(first.wait, 30) == 0, procs.log_of(first)
        monkeypatch.delenv("BLOCK_AT")
        calls = sim.state.requests
        procs.producer(redis_url, ns, sim.url, *r3, name="b")
        async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
            async with asyncio.timeout(90):
                batch = await consumer.take(1)
            (group,) = batch.groups
            (sample,) = group.samples
            assert group.producer == "b" and sample.routed_experts is not None
            want = [[[routed_expert(int(t), layer, k, experts) for k in range(topk)] for layer in range(layers)]
                    for t in sample.tokens[:-1]]
            assert sample.routed_experts.tolist() == want  # the rows read back from the store
            await consumer.commit(batch)
        assert sim.state.requests == calls == 3  # b asked the engine nothing
    assert not await redis.exists(keys.episode(0, 0))
    await wait_until(lambda: _true(not objects_in(store)), 30, message="the journal's and group's objects freed")
    await wait_until(lambda: _true_async(held(redis, ns), (0, 0, 0, 0)), 30, message="the ledgers empty")


async def _true_async(value: Any, want: Any) -> bool:
    return await value == want
