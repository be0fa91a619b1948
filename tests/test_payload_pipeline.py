"""The payload plane end to end on a real ``fs`` store (a temporary directory): real producer
processes with R3 against the simulator, a real trainer, real Redis. Where the bytes are, that
the trainer's arrays are the engine's, and that every fate frees the objects exactly when nothing
refers to them any more."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from conftest import ProcessPool, add_prompts, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common.arrays import Unfetched
from rollstream.common.errors import PayloadNotFetched
from rollstream.common.keys import Keys, StateField
from rollstream.common.models import Group
from rollstream.common.payload.refs import member_keys
from rollstream.common.protocol.objects import PayloadLedger
from rollstream.consumer import GroupConsumer
from rollstream.testing.sim.simulator import SimConfig, SimEngine, routed_expert

MOE = (8, 4, 64)
"""Layers, top-k, experts: 32 bytes of routing a token, so a 100-token reply's replay is ~3 KiB."""
MIN_BYTES = 1024


@pytest.fixture
async def moe_sim() -> AsyncIterator[SimEngine]:
    async with SimEngine(SimConfig(seed=1, mean_tokens=100, length_sigma=0.0, latency_per_token=0.001,
                                   accuracy=0.5, moe=MOE)) as engine:
        yield engine


def objects_in(store: Path, hidden: bool = False) -> list[str]:
    """The files under ``store`` (the objects; with ``hidden``, unfinished puts too)."""
    found = sorted(p.relative_to(store).as_posix() for p in store.rglob("*") if p.is_file())
    return found if hidden else [f for f in found if "/." not in f"/{f}"]


async def held(redis: Redis, ns: str) -> tuple[int, int, int, int]:
    """(objects claimed, bytes claimed, intents, to free)."""
    h = await PayloadLedger(redis, Keys(ns)).held()
    return h.objects, h.bytes, h.intents, h.to_free


def check_rows(group: Group) -> None:
    layers, topk, experts = MOE
    for sample in group.samples:
        assert sample.routed_experts is not None
        got = sample.routed_experts.numpy()
        assert got.shape == (len(sample.tokens) - 1, layers, topk) and got.dtype == np.uint8
        tokens = np.frombuffer(sample.tokens, dtype=np.int32)[:-1]
        want = np.array([[[routed_expert(int(t), layer, k, experts) for k in range(topk)] for layer in range(layers)]
                         for t in tokens])
        np.testing.assert_array_equal(got, want.reshape(got.shape))


async def start(redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool, store: Path,
                prompts: int, **config: object) -> None:
    await make_namespace(redis, ns, payload_store=f"fs://{store}", payload_min_bytes=MIN_BYTES, **config)
    await add_prompts(redis, ns, prompts)
    procs.producer(redis_url, ns, sim.url, "--routed-experts", "x".join(map(str, MOE)), name="prod-a")


async def test_arrays_live_in_the_store_and_commit_frees_them(
    redis: Redis, redis_url: str, ns: str, moe_sim: SimEngine, procs: ProcessPool, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    await start(redis, redis_url, ns, moe_sim, procs, store, 4)
    keys = Keys(ns)
    await wait_until(lambda: _xlen_is(redis, keys.groups, 4), 30, message="4 groups published")
    entries = await redis.xrange(keys.groups)
    refs = [k for _, f in entries for k in member_keys(f[b"refs"].decode())]
    assert all(int(f[b"objects"]) == 2 for _, f in entries)  # one object per sample
    assert objects_in(store) == sorted(refs) and len(refs) == 8
    store_bytes = sum(int(f[b"store_bytes"]) for _, f in entries)
    assert all(int(f[b"bytes"]) < int(f[b"store_bytes"]) for _, f in entries)  # the bulk left Redis
    assert await held(redis, ns) == (4, store_bytes, 0, 0)  # one ledger member per group
    for _, f in entries:  # the entry as Redis holds it: no token, log-prob or mask bytes, the lengths kept
        for wire in msgpack.unpackb(f[b"data"])["samples"]:
            assert not {"tok", "lp", "lm", "re"} & set(wire), sorted(wire)
            assert {"tok", "lp", "lm", "re"} <= set(wire["ofl"][1])
            assert wire["ofl"][1]["tok"][3] == [wire["pl"] + wire["rlen"]]
    assert int(await redis.hget(keys.state, StateField.GROUP_BYTES) or 0) >= store_bytes  # the byte budget counts them
    async with await GroupConsumer.connect(redis_url, ns, "trainer-t") as consumer:
        async with asyncio.timeout(30):
            batch = await consumer.take(4)
        assert batch.store_bytes == store_bytes and not batch.unfetched  # checksum mode: fetched at take
        for group in batch.groups:
            check_rows(group)
        views = batch.routed_experts_numpy()
        assert await consumer.commit(batch) == 4
    assert objects_in(store) == []
    assert await held(redis, ns) == (0, 0, 0, 0)
    assert int(await redis.hget(keys.state, StateField.PAYLOAD_FREED) or 0) == 8
    assert all(v is not None and v.shape[1:] == MOE[:2] for v in views)  # mapped pages outlive their files
    assert int(np.sum([v.sum() for v in views if v is not None])) > 0


async def test_lazy_fetch_each_rank_its_share(
    redis: Redis, redis_url: str, ns: str, moe_sim: SimEngine, procs: ProcessPool, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    await start(redis, redis_url, ns, moe_sim, procs, store, 4)
    await wait_until(lambda: _xlen_is(redis, Keys(ns).groups, 4), 30, message="4 groups published")
    async with await GroupConsumer.connect(redis_url, ns, "trainer-t", payload_check="size") as consumer:
        async with asyncio.timeout(30):
            batch = await consumer.take(4)
        assert len(batch.unfetched) == 4
        sample = batch.groups[0].samples[0]
        for name in ("tokens", "rollout_log_probs", "loss_mask", "routed_experts"):
            assert all(isinstance(getattr(s, name), Unfetched) for g in batch.groups for s in g.samples), name
        assert len(sample.tokens) == sample.prompt_length + sample.response_length > 1  # lengths before the fetch
        with pytest.raises(PayloadNotFetched, match=r"await batch\.fetch\(\)"):
            sample.tokens[0]
        shards = [batch.shard(rank, 2) for rank in range(2)]  # balanced by tokens: lengths only
        assert len(batch.unfetched) == 4  # the split fetched nothing
        assert sorted(i for s in shards for i in s.entry_ids) == sorted(batch.entry_ids)
        assert [len(s) for s in shards] == [2, 2]
        rank0 = shards[0].routed_experts_numpy()  # fetched on first access: rank 0's groups only
        assert all(v is not None for v in rank0)
        assert not shards[0].unfetched and len(batch.unfetched) == 2
        await shards[1].fetch()
        for group in batch.groups:
            check_rows(group)
            for s in group.samples:  # the exact arrays: as long as the entry said, the mask the producer's
                assert isinstance(s.tokens, memoryview) and len(s.tokens) == s.prompt_length + s.response_length
                assert s.loss_mask is not None and s.loss_mask.tolist() == [1] * s.response_length
                assert s.rollout_log_probs is not None and len(s.rollout_log_probs) == s.response_length
        assert sample.tokens[0] == sample.tokens.tolist()[0]
        assert await consumer.commit(batch) == 4
    assert objects_in(store) == []


async def _xlen_is(redis: Redis, key: str, n: int) -> bool:
    return int(await redis.xlen(key)) == n


@pytest.mark.parametrize("keep_arrays", [True, False])
async def test_the_archive_holds_the_objects_until_archived(
    redis: Redis, redis_url: str, ns: str, moe_sim: SimEngine, procs: ProcessPool, tmp_path: Path, keep_arrays: bool
) -> None:
    """A trained group's archive record refers to its objects (they outlive the commit); the
    archiver with ``--keep-arrays`` reads them into its Parquet rows before it confirms, and the
    confirmation frees them."""
    pytest.importorskip("pyarrow")
    from rollstream.common.archive_schema import read_table
    from rollstream.common.codec import decode_group
    from rollstream.common.connection import connect
    from rollstream.ops.archiver import Archiver, ArchiveSettings

    store = tmp_path / "store"
    await start(redis, redis_url, ns, moe_sim, procs, store, 2, archive_bytes=50_000_000)
    keys = Keys(ns)
    await wait_until(lambda: _xlen_is(redis, keys.groups, 2), 30, message="2 groups published")
    async with await GroupConsumer.connect(redis_url, ns, "trainer-t") as consumer:
        async with asyncio.timeout(30):
            batch = await consumer.take(2)
        trained = {g.index: g for g in batch.groups}
        assert await consumer.commit(batch) == 2
    assert len(objects_in(store)) == 4 and (await held(redis, ns))[0] == 2  # the archive records hold them
    blocking = connect(redis_url, block_ms=1000)
    archiver = Archiver(redis, blocking, ArchiveSettings(namespace=ns, out=tmp_path / "archive", flush_seconds=0.05,
                                                         keep_arrays=keep_arrays))
    task = asyncio.create_task(archiver.run())
    try:
        await wait_until(lambda: _xlen_is(redis, keys.archive, 0), 30, message="the archive confirmed")
        await wait_until(lambda: _true(not objects_in(store)), 30, message="the objects freed")
    finally:
        archiver.stop()
        await task
        await blocking.aclose()
    assert await held(redis, ns) == (0, 0, 0, 0)
    rows = read_table(tmp_path / "archive").to_pylist()
    assert sorted(r["index"] for r in rows) == sorted(trained)
    for row in rows:
        group = decode_group(row["data"])
        assert group.payload is None  # no reference to an object that is gone
        if keep_arrays:
            for mine, theirs in zip(group.samples, trained[row["index"]].samples, strict=True):
                assert mine.routed_experts == theirs.routed_experts
        else:
            assert all(s.routed_experts is None for s in group.samples)
        for mine, theirs, cells in zip(group.samples, trained[row["index"]].samples, row["samples"], strict=True):
            # tokens, mask and log-probs left the entry with the routing: the rows hold them all the same
            assert mine.tokens.tolist() == theirs.tokens.tolist() == cells["tokens"]
            assert theirs.loss_mask is not None and theirs.loss_mask.tolist() == cells["loss_mask"]
            assert theirs.rollout_log_probs is not None
            assert cells["rollout_log_probs"] == pytest.approx(theirs.rollout_log_probs.tolist())


async def _true(value: bool) -> bool:
    return value


async def test_a_dead_letter_keeps_a_raw_groups_objects_until_dropped(
    redis: Redis, redis_url: str, ns: str, tmp_path: Path
) -> None:
    """An undecodable group is dead-lettered as it came, ``refs`` included: its objects stay
    claimed (the dead letter refers to them) until ``dead drop`` releases them. A decodable group's
    dead letter is its prompt (what ``dead requeue`` puts back): no arrays, its objects freed."""
    from rollstream.common.codec import group_fields_offloaded, prompt_fields
    from rollstream.common.keys import PRODUCERS_GROUP
    from rollstream.common.models import Prompt
    from rollstream.common.payload.plane import PayloadPlane
    from rollstream.common.protocol import PromptQueue
    from rollstream.ops.deadletter import dead_entries, drop_dead
    from rollstream.testing.samples import full_group

    store = tmp_path / "store"
    await make_namespace(redis, ns, n_samples_per_prompt=2, payload_store=f"fs://{store}", payload_min_bytes=64)
    keys = Keys(ns)
    plane = PayloadPlane.open(f"fs://{store}", redis, keys)
    queue = PromptQueue(redis, keys, "p")
    for index in range(2):
        await redis.xadd(keys.prompts, prompt_fields(Prompt(index=index, prompt="p")))
    delivered = await redis.xreadgroup(PRODUCERS_GROUP, "p", {keys.prompts: ">"})
    published = {}
    for (prompt_id, _), index in zip(delivered[0][1], range(2), strict=True):
        fields, objects = group_fields_offloaded(full_group(n=2, index=index), 64, plane.new_key)
        assert objects
        if index == 0:
            fields = {**fields, "data": b"\x81\xa1v\x63"}  # not a group: dead-lettered as it came
        await plane.put(objects)
        assert await queue.publish(keys.prompts, prompt_id, fields, None, [o.ref for o in objects])
        published[index] = [o.ref.key for o in objects]
    async with await GroupConsumer.connect(redis_url, ns, "trainer-t") as consumer:
        async with asyncio.timeout(30):
            batch = await consumer.take(1)
        assert [g.index for g in batch.groups] == [1]
        assert await consumer.commit(batch) == 1
    [dead] = await dead_entries(redis, keys)
    assert dead.prompt is None and dead.index == 0
    [(_, raw)] = await redis.xrange(keys.dead)
    assert member_keys(raw[b"refs"].decode()) == published[0]
    assert objects_in(store) == sorted(published[0])  # the dead letter's objects stay, the trained one's went
    assert (await held(redis, ns))[0] == 1
    assert await drop_dead(redis, keys, [dead.id]) == 1
    assert await plane.free() == len(published[0])
    assert objects_in(store) == [] and await held(redis, ns) == (0, 0, 0, 0)


async def test_the_full_sweep_frees_what_no_entry_refers_to_and_ns_delete_empties_the_store(
    redis: Redis, ns: str, tmp_path: Path
) -> None:
    """Objects no ledger knows (Redis lost its ledgers: restarted without persistence, the
    namespace deleted and made again) are freed by the full sweep (the reclaim turn's
    ``reconcile``, rare: it lists the store), and nothing in use (an object being put, one an
    entry holds); ``ns delete`` empties the store."""
    from rollstream.common.codec import group_fields_offloaded, prompt_fields
    from rollstream.common.keys import PRODUCERS_GROUP
    from rollstream.common.models import Prompt
    from rollstream.common.payload.plane import PayloadPlane
    from rollstream.common.payload.refs import group_member
    from rollstream.common.protocol import PromptQueue
    from rollstream.ops import delete_payload_objects
    from rollstream.testing.samples import full_group

    store = tmp_path / "store"
    await make_namespace(redis, ns, payload_store=f"fs://{store}", payload_min_bytes=64)
    keys = Keys(ns)
    plane = PayloadPlane.open(f"fs://{store}", redis, keys)
    for index in range(2):
        await redis.xadd(keys.prompts, prompt_fields(Prompt(index=index, prompt="p")))
    delivered = await redis.xreadgroup(PRODUCERS_GROUP, "p", {keys.prompts: ">"})
    queue = PromptQueue(redis, keys, "p")
    entries = []
    for (prompt_id, _), index in zip(delivered[0][1], range(2), strict=True):
        fields, objects = group_fields_offloaded(full_group(n=2, index=index), 64, plane.new_key)
        await plane.put(objects)
        entries.append((await queue.publish(keys.prompts, prompt_id, fields, None, [o.ref for o in objects]),
                        [o.ref.key for o in objects]))
    _, being_put = group_fields_offloaded(full_group(n=2, index=9), 64, plane.new_key)
    await plane.ledger.intend([group_member([o.ref.key for o in being_put])], 2**62)  # a put under way: its intent first
    await plane.store.put(being_put[0].ref.key, being_put[0].parts)
    (gone_id, gone_keys), (_, kept_keys) = entries
    await redis.xdel(keys.groups, gone_id)  # its entry and its claims lost with Redis' data
    await redis.hdel(keys.payload_held, group_member(gone_keys))
    assert await plane.reconcile() == 1  # the lost group's one object set
    assert objects_in(store) == sorted([*kept_keys, being_put[0].ref.key])
    assert await plane.reconcile() == 0
    assert int(await redis.hget(keys.state, StateField.PAYLOAD_SWEPT) or 0) == 1
    assert await delete_payload_objects(redis, keys) == len(kept_keys) + 1
    assert objects_in(store) == []


async def _publish_offloaded(redis: Redis, keys: Keys, groups: list[Group], store: Path) -> list[list[str]]:
    """Publish ``groups`` as a producer does (intents, puts, PUBLISH), each for a prompt of its
    own; the object keys of each."""
    from rollstream.common.codec import group_fields_offloaded, prompt_fields
    from rollstream.common.keys import PRODUCERS_GROUP
    from rollstream.common.models import Prompt
    from rollstream.common.payload.plane import PayloadPlane
    from rollstream.common.protocol import PromptQueue

    plane = PayloadPlane.open(f"fs://{store}", redis, keys)
    for group in groups:
        await redis.xadd(keys.prompts, prompt_fields(Prompt(index=group.index, prompt="p")))
    delivered = await redis.xreadgroup(PRODUCERS_GROUP, "p", {keys.prompts: ">"})
    out = []
    for (prompt_id, _), group in zip(delivered[0][1], groups, strict=True):
        fields, objects = group_fields_offloaded(group, 64, plane.new_key)
        await plane.put(objects)
        assert await PromptQueue(redis, keys, "p").publish(keys.prompts, prompt_id, fields, None,
                                                           [o.ref for o in objects])
        out.append([o.ref.key for o in objects])
    return out


async def test_init_flags_set_the_store_and_refuse_a_bad_one(
    redis: Redis, redis_url: str, ns: str, procs: ProcessPool, tmp_path: Path
) -> None:
    from rollstream.common.config import PipelineConfig

    init = procs.start("init", "--redis", redis_url, "--ns", ns, "--n-samples", "2", "--batch-size", "4",
                       "--payload-store", f"fs://{tmp_path}/store", "--payload-min-bytes", "16KiB", log_name="init")
    assert await asyncio.to_thread(init.wait, 120) == 0, procs.logs()
    config = PipelineConfig.from_redis(await redis.hgetall(Keys(ns).config))
    assert (config.payload_store, config.payload_min_bytes) == (f"fs://{tmp_path}/store", 16384)
    bad = procs.start("init", "--redis", redis_url, "--ns", f"{ns}-b", "--n-samples", "2", "--batch-size", "4",
                      "--payload-store", "s3://bucket", log_name="bad")
    assert await asyncio.to_thread(bad.wait, 120) == 2, procs.logs()
    assert "scheme 's3' is not one of fs://, mooncake://" in procs.log_of(bad)


@pytest.fixture
def mooncake(tmp_path: Path) -> Any:
    """A real Mooncake cluster on loopback (master + one store process), or a skip saying why."""
    from rollstream.testing.mooncake_cluster import MooncakeCluster, mooncake_unavailable

    why = mooncake_unavailable()
    if why is not None:
        pytest.skip(f"Mooncake cannot run here: {why}")
    with MooncakeCluster(tmp_path / "mooncake", segment="256MB", lease_ms=2000) as cluster:
        yield cluster


async def test_the_pipeline_on_mooncake(
    redis: Redis, redis_url: str, ns: str, moe_sim: SimEngine, procs: ProcessPool, mooncake: Any
) -> None:
    """The same run on ``mooncake://``: the arrays the engine sent reach the trainer, and every
    object is gone once committed (deletes refused under Mooncake's read lease are retried by the
    reclaim turn until confirmed)."""
    from rollstream.common.payload import open_store

    await make_namespace(redis, ns, payload_store=mooncake.url, payload_min_bytes=MIN_BYTES)
    await add_prompts(redis, ns, 4)
    procs.producer(redis_url, ns, moe_sim.url, "--routed-experts", "x".join(map(str, MOE)), "--reclaim-interval",
                   "0.5", name="prod-a")
    keys = Keys(ns)
    await wait_until(lambda: _xlen_is(redis, keys.groups, 4), 60, message="4 groups published")
    entries = await redis.xrange(keys.groups)
    refs = sorted(k for _, f in entries for k in member_keys(f[b"refs"].decode()))
    store = open_store(mooncake.url)
    try:
        assert sorted([k async for k, _ in store.list(f"{ns}/")]) == refs
        async with await GroupConsumer.connect(redis_url, ns, "trainer-t") as consumer:
            async with asyncio.timeout(60):
                batch = await consumer.take(4)
            for group in batch.groups:
                check_rows(group)
            assert await consumer.commit(batch) == 4
        await wait_until(lambda: _all_freed(redis, ns), 60, message="every object confirmed deleted")
        assert [k async for k, _ in store.list(f"{ns}/")] == []
    finally:
        await store.close()


async def _all_freed(redis: Redis, ns: str) -> bool:
    return await held(redis, ns) == (0, 0, 0, 0)


async def test_durable_episode_journal_steps_live_in_the_store(redis: Redis, ns: str, tmp_path: Path) -> None:
    """A large journal step goes to the store and the journal keeps a reference: claimed when
    written, read back (checksum verified) by the producer that resumes the episode, released when
    replaced, when the append is refused (the lease lost) and with the journal at PUBLISH."""
    from rollstream.common.codec import group_fields, prompt_fields
    from rollstream.common.keys import PRODUCERS_GROUP
    from rollstream.common.models import Prompt
    from rollstream.common.payload.plane import PayloadPlane
    from rollstream.common.protocol import EpisodeJournals, PromptQueue
    from rollstream.testing.samples import full_group

    store = tmp_path / "store"
    await make_namespace(redis, ns, payload_store=f"fs://{store}", payload_min_bytes=1024, durable_episodes=True)
    keys = Keys(ns)
    plane = PayloadPlane.open(f"fs://{store}", redis, keys)
    await redis.xadd(keys.prompts, prompt_fields(Prompt(index=0, prompt="p")))
    [(_, [(prompt_id, _)])] = await redis.xreadgroup(PRODUCERS_GROUP, "p", {keys.prompts: ">"})
    journals = EpisodeJournals(redis, keys, "p")

    async def append(step: bytes, seq: int, entry_id: bytes = prompt_id) -> str:
        value, objects = await plane.offload_step(step, 1024)
        return await journals.append(stream=keys.prompts, entry_id=entry_id, index=0, epoch=0, member=0, seq=seq,
                                     budget=0, step=value, objects=objects)

    first, second, small = b"\x81" + b"a" * 5000, b"\x81" + b"b" * 6000, b"\x81small"
    assert await append(first, 0) == "ok" and await append(small, 1) == "ok"
    journal = keys.episode(0, 0)
    assert len(objects_in(store)) == 1 and (await held(redis, ns))[:2] == (1, len(first))
    assert await plane.resolve_steps(await journals.load(0, 0)) == {0: [first, small]}
    assert int(await redis.hget(journal, "bytes") or 0) >= len(first)  # the budget counts the object
    assert await append(second, 0) == "ok"  # replaces steps 0.. of member 0: the first object released
    assert await plane.resolve_steps(await journals.load(0, 0)) == {0: [second]}
    assert await append(second, 1, entry_id=b"1-1") == "lost"  # not ours: its object released at once
    assert await plane.free() == 2
    assert len(objects_in(store)) == 1 and (await held(redis, ns))[0] == 1
    fields = group_fields(full_group(n=2, index=0))
    assert await PromptQueue(redis, keys, "p").publish(keys.prompts, prompt_id, fields, journal)
    assert not await redis.exists(journal)
    assert await plane.free() == 1
    assert objects_in(store) == [] and await held(redis, ns) == (0, 0, 0, 0)
