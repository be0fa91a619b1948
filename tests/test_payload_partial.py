"""Partial rollout on the payload plane (issue 48): a group recycled with its partial samples
(ABORTED, a weight update) becomes a retry prompt that refers to the group's objects (``refs``,
version 4) instead of carrying its arrays; the producer reads them back (checksums verified) to
continue the samples; every fate of that prompt entry releases them exactly once. Real
redis-server, a real ``fs`` store, real producer processes against the simulator."""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from conftest import ProcessPool, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common.arrays import Packed, Unfetched
from rollstream.common.codec import DEFAULT_LIMITS, decode_group_entry, decode_prompt_entry, group_fields
from rollstream.common.keys import PRODUCERS_GROUP, Keys, StateField
from rollstream.common.models import Group, Sample, Status
from rollstream.common.payload.plane import PayloadPlane
from rollstream.common.payload.refs import group_member
from rollstream.common.protocol import PromptQueue
from rollstream.consumer import GroupConsumer
from rollstream.testing.samples import full_group
from rollstream.testing.sim.simulator import SimConfig, SimEngine
from test_payload_pipeline import _publish_offloaded, held, objects_in

MOE = (8, 4, 64)
"""Layers, top-k, experts of the producer's routing replay (32 bytes a token)."""
MIN_BYTES = 1024


@pytest.fixture
async def moe_sim() -> AsyncIterator[SimEngine]:
    async with SimEngine(SimConfig(seed=1, mean_tokens=60, length_sigma=0.0, latency_per_token=0.001,
                                   accuracy=0.5, moe=MOE)) as engine:
        yield engine


def _sample(index: int, status: Status, response: int, seed: int) -> Sample:
    rng = np.random.default_rng(seed)
    tokens = array("i", rng.integers(1, 1000, response + 1).tolist())
    layers, topk, experts = MOE
    return Sample(
        index=index, tokens=tokens, response=f"the answer is {index}", response_length=response, prompt_length=1,
        status=status, weight_versions=[0], loss_mask=array("B", [1] * response),
        rollout_log_probs=array("f", rng.random(response, dtype=np.float32)),
        routed_experts=Packed.of(rng.integers(0, experts, (response, layers, topk)).astype(np.uint8)),
    )


def aborted_r3_group(index: int = 0, attempt: int = 0) -> Group:
    """A group recycled as ABORTED: sample 0 finished (continued as it is: its arrays reach the next
    group unchanged), sample 1 aborted mid-reply; each sample's routing replay goes to the store."""
    samples = [_sample(0, Status.COMPLETED, 100, seed=index * 2), _sample(1, Status.ABORTED, 40, seed=index * 2 + 1)]
    return Group(index=index, prompt="Compute 0 + 1 and box it.", label="1", samples=samples, attempt=attempt)


async def recycle_through_a_trainer(
    redis: Redis, redis_url: str, ns: str, store: Path, aborted: Group, *, init: bool = True, **config: object
) -> tuple[list[list[str]], dict[bytes, bytes]]:
    """Publish ``aborted`` and a usable group as a producer does, let a real trainer take the
    usable one (recycling the aborted one with its partial samples) and commit it; the object keys
    of both groups, and the fields of the entry the recycle left (retry or dead stream)."""
    if init:
        await make_namespace(redis, ns, payload_store=f"fs://{store}", payload_min_bytes=MIN_BYTES,
                             partial_rollout=True, **config)
    keys = Keys(ns)
    published = await _publish_offloaded(redis, keys, [aborted, full_group(n=2, index=aborted.index + 1)], store)
    async with await GroupConsumer.connect(redis_url, ns, "trainer-t") as consumer:
        async with asyncio.timeout(30):
            batch = await consumer.take(1)
        assert [g.index for g in batch.groups] == [aborted.index + 1]
        assert await consumer.commit(batch) == 1
    rows = await redis.xrange(keys.retry) or await redis.xrange(keys.dead)
    [(_, fields)] = rows
    return published, fields


def assert_refers_to(fields: dict[bytes, bytes], keys: list[str], aborted: Group) -> None:
    """The prompt entry names the group's object set and carries none of its array bytes."""
    assert fields[b"refs"].decode() == group_member(keys)
    data = fields[b"data"]
    for sample in aborted.samples:
        assert sample.routed_experts is not None
        assert bytes(memoryview(sample.routed_experts.data).cast("B")) not in data
    assert len(data) < sum(len(memoryview(s.routed_experts.data).cast("B")) for s in aborted.samples if s.routed_experts)


async def test_a_recycled_groups_retry_prompt_refers_to_its_objects(
    redis: Redis, redis_url: str, ns: str, tmp_path: Path
) -> None:
    """No fetch, no copy on the trainer: the retry prompt names the group's objects, which stay
    held (by the prompt alone: an archived copy of the recycled group does not hold them too)."""
    store = tmp_path / "store"
    aborted = aborted_r3_group()
    [keys, _], fields = await recycle_through_a_trainer(redis, redis_url, ns, store, aborted, archive_bytes=50_000_000)
    assert_refers_to(fields, keys, aborted)
    prompt = decode_prompt_entry(fields)
    assert prompt.payload is not None and [r.key for r in prompt.payload.objects] == keys
    assert prompt.partial is not None and prompt.input_ids is None  # not fetched: placeholders, lengths known
    assert all(isinstance(s.routed_experts, Unfetched) and isinstance(s.tokens, Unfetched) for s in prompt.partial)
    assert [len(s.tokens) for s in prompt.partial] == [len(s.tokens) for s in aborted.samples]
    assert set(keys) <= set(objects_in(store))  # (the trained group's too: its archive record holds them)
    held_keys = [k.decode() for k in await redis.hkeys(Keys(ns).payload_held)]
    assert group_member(keys) in held_keys
    recycled = [f for _, f in await redis.xrange(Keys(ns).archive) if f[b"fate"] == b"recycled"]
    assert len(recycled) == 1 and b"refs" not in recycled[0]  # one holder per set: the retry prompt


@pytest.mark.parametrize("readable", [True, False])
async def test_the_producer_continues_the_partial_samples_with_their_exact_arrays(
    redis: Redis, redis_url: str, ns: str, tmp_path: Path, moe_sim: SimEngine, procs: ProcessPool, readable: bool
) -> None:
    """A real producer takes the retry prompt, reads its partial samples' arrays from the store
    and continues them: the finished sample reaches the trainer with the very arrays the recycled
    group had. An object it cannot read (its file deleted) -> the prompt is generated again from
    scratch, the reason in its history, never a short array. Either way one group, nothing lost or
    doubled, and every object freed exactly once after the commit."""
    store = tmp_path / "store"
    aborted = aborted_r3_group()
    [keys, other], fields = await recycle_through_a_trainer(redis, redis_url, ns, store, aborted)
    assert_refers_to(fields, keys, aborted)
    k = Keys(ns)
    if not readable:
        (store / keys[0]).unlink()
    procs.producer(redis_url, ns, moe_sim.url, "--routed-experts", "x".join(map(str, MOE)), "--reclaim-interval",
                   "0.5", name="prod-a")
    await wait_until(lambda: _xlen_is(redis, k.groups, 1), 60, message="the prompt's group published")
    assert await redis.xlen(k.retry) == 0 and await redis.xlen(k.dead) == 0
    [(_, entry)] = await redis.xrange(k.groups)
    group = decode_group_entry(entry)
    assert group.index == 0
    async with await GroupConsumer.connect(redis_url, ns, "trainer-t") as consumer:
        async with asyncio.timeout(30):
            batch = await consumer.take(1)
        [taken] = batch.groups
        first = taken.samples[0]
        assert first.routed_experts is not None and aborted.samples[0].routed_experts is not None
        if readable:  # continued as it was: the recycled group's arrays, byte for byte
            np.testing.assert_array_equal(first.routed_experts.numpy(), aborted.samples[0].routed_experts.numpy())
            assert list(first.tokens) == list(aborted.samples[0].tokens)
            assert not any("partial samples dropped" in h for h in taken.history)
        else:  # generated again: the engine's own sample, full length, and the reason kept
            assert list(first.tokens) != list(aborted.samples[0].tokens)
            assert "partial samples dropped" in taken.history[-1] and "no file" in taken.history[-1]
            assert int(await redis.hget(k.state, StateField.PAYLOAD_READ_FAILURES) or 0) == 1
        for sample in taken.samples:
            assert sample.routed_experts is not None and len(sample.routed_experts) == len(sample.tokens) - 1
        assert await consumer.commit(batch) == 1
    put = len(keys) + int(entry.get(b"objects", 0)) + len(other)  # the recycled group's, the new group's, group 1's
    await wait_until(lambda: _true(not objects_in(store)), 30, message="every object freed")
    assert await held(redis, ns) == (0, 0, 0, 0)
    freed = int(await redis.hget(k.state, StateField.PAYLOAD_FREED) or 0)
    assert freed == put, (freed, put)  # each once (a key found already gone counts as freed)


async def test_every_fate_of_the_prompt_entry_keeps_or_releases_its_objects(
    redis: Redis, redis_url: str, ns: str, tmp_path: Path
) -> None:
    """Returned by a drain (MOVE prompt -> retry) the refs follow it; dead-lettered by a producer
    they stay held by the dead letter; requeued (a fresh attempt, no partial samples) or
    dropped they are released; PUBLISH of a group for the prompt releases them."""
    from rollstream.ops.deadletter import dead_entries, drop_dead, requeue_dead

    store = tmp_path / "store"
    [keys, _], _ = await recycle_through_a_trainer(redis, redis_url, ns, store, aborted_r3_group())
    member = group_member(keys)
    k = Keys(ns)
    queue = PromptQueue(redis, k, "p")
    plane = PayloadPlane.open(f"fs://{store}", redis, k)

    async def take() -> tuple[bytes, dict[bytes, bytes]]:
        [(_, [(entry_id, got)])] = await redis.xreadgroup(PRODUCERS_GROUP, "p", {k.retry: ">"}, count=1)
        return entry_id, got

    async def holds() -> bool:
        return bool(await redis.hexists(k.payload_held, member)) and await redis.zscore(k.payload_free, member) is None

    async def freed() -> bool:
        return await plane.free() == len(keys) and not objects_in(store) and not await redis.hlen(k.payload_held)

    entry_id, got = await take()
    assert await queue.give_back(k.retry, entry_id, got)  # the drain's give-back
    assert await holds()
    entry_id, got = await take()
    assert got[b"refs"] == member.encode()
    assert await queue.dead_letter(k.retry, entry_id, got, "decode failed")  # a producer's dead letter
    [dead] = await dead_entries(redis, k)
    assert await holds() and await plane.free() == 0 and objects_in(store) == sorted(keys)
    assert await requeue_dead(redis, k, dead)  # a fresh attempt without partial samples: released
    assert not await holds() and await freed()
    [(requeued, _)] = await redis.xrange(k.retry)
    await redis.xdel(k.retry, requeued)

    [keys, _], _ = await recycle_through_a_trainer(redis, redis_url, ns, store, aborted_r3_group(index=5),
                                                        init=False)
    member = group_member(keys)
    entry_id, got = await take()
    assert await queue.dead_letter(k.retry, entry_id, got, "decode failed")
    [dead] = await dead_entries(redis, k)
    assert await holds()
    assert await drop_dead(redis, k, [dead.id]) == 1
    assert not await holds() and await freed()

    [keys, _], _ = await recycle_through_a_trainer(redis, redis_url, ns, store, aborted_r3_group(index=8),
                                                        init=False)
    member = group_member(keys)
    entry_id, got = await take()
    assert await holds()
    assert await queue.publish(k.retry, entry_id, group_fields(full_group(n=2, index=8)), prompt_fields=got)
    assert not await holds() and await freed()
    await plane.close()


async def test_a_dead_lettered_partial_prompt_keeps_its_objects_until_dropped(
    redis: Redis, redis_url: str, ns: str, tmp_path: Path
) -> None:
    """Past max_attempts the trainer dead-letters the prompt with its partial samples: the dead
    letter refers to the objects (no array bytes), which stay until ``dead drop``."""
    from rollstream.ops.deadletter import dead_entries, drop_dead

    store = tmp_path / "store"
    aborted = aborted_r3_group(attempt=5)
    [keys, _], fields = await recycle_through_a_trainer(redis, redis_url, ns, store, aborted, max_attempts=3)
    k = Keys(ns)
    assert await redis.xlen(k.retry) == 0
    assert_refers_to(fields, keys, aborted)
    [dead] = await dead_entries(redis, k)
    assert dead.prompt is not None and dead.prompt.partial is not None and dead.prompt.payload is not None
    assert objects_in(store) == sorted(keys) and (await held(redis, ns))[0] == 1
    assert await drop_dead(redis, k, [dead.id]) == 1
    plane = PayloadPlane.open(f"fs://{store}", redis, k)
    assert await plane.free() == len(keys)
    await plane.close()
    assert objects_in(store) == [] and await held(redis, ns) == (0, 0, 0, 0)


def test_the_retry_prompt_round_trips_and_attaches_the_exact_arrays() -> None:
    """The codec alone: a recycled group's prompt encodes its partial samples as references
    (version 4), decodes them back with the same references, and ``attach`` puts the very arrays
    back; a prompt without partial samples (``dead requeue``) carries no references."""
    import dataclasses
    import itertools

    from rollstream.common.codec import OFFLOAD_VERSION, group_fields_offloaded, prompt_fields
    from rollstream.common.codec.wire import unpack
    from rollstream.common.models import retry_prompt

    counter = itertools.count()
    aborted = aborted_r3_group()
    fields, objects = group_fields_offloaded(aborted, MIN_BYTES, lambda: f"ns/obj{next(counter)}")
    raw = {name.encode(): value if isinstance(value, bytes) else str(value).encode() for name, value in fields.items()}
    recycled = decode_group_entry(raw, views=True)
    prompt = retry_prompt(recycled, "aborted: x", keep_partial=True)
    entry = prompt_fields(prompt)
    assert entry["refs"] == fields["refs"] and unpack(entry["data"], DEFAULT_LIMITS)["v"] == OFFLOAD_VERSION
    back = decode_prompt_entry({name.encode(): value if isinstance(value, bytes) else str(value).encode()
                                for name, value in entry.items()})
    assert back.payload is not None and back.payload.objects == recycled.payload.objects  # type: ignore[union-attr]
    assert back.partial is not None
    buffers = {o.ref.key: memoryview(b"".join(bytes(p) for p in o.parts)) for o in objects}
    back.payload.attach(Group(index=0, prompt="p", samples=back.partial), buffers)
    for mine, theirs in zip(back.partial, aborted.samples, strict=True):
        assert mine == theirs
    assert "refs" not in prompt_fields(dataclasses.replace(prompt, partial=None))


async def _xlen_is(redis: Redis, key: str, n: int) -> bool:
    return int(await redis.xlen(key)) == n


async def _true(value: bool) -> bool:
    return value


async def test_a_producers_dead_letter_puts_its_partial_samples_arrays_in_the_store(
    redis: Redis, ns: str, tmp_path: Path
) -> None:
    """A prompt a producer dead-letters past max_attempts keeps the partial samples it generated:
    their large arrays go to the store as a group's would (intent, put), the dead letter names them
    and MOVE claims them in the same step; they come back exact, and stay until ``dead drop``. A
    dead letter that finds the prompt already handed over queues its objects to be freed."""
    from rollstream.common.codec import prompt_fields, prompt_fields_offloaded
    from rollstream.common.models import Prompt
    from rollstream.ops.deadletter import dead_entries, drop_dead

    store = tmp_path / "store"
    await make_namespace(redis, ns, payload_store=f"fs://{store}", payload_min_bytes=MIN_BYTES, partial_rollout=True)
    k = Keys(ns)
    plane = PayloadPlane.open(f"fs://{store}", redis, k)
    queue = PromptQueue(redis, k, "p")
    await redis.xadd(k.prompts, prompt_fields(Prompt(index=0, prompt="p")))
    [(_, [(entry_id, _)])] = await redis.xreadgroup(PRODUCERS_GROUP, "p", {k.prompts: ">"})
    aborted = aborted_r3_group()
    last = Prompt(index=0, prompt="p", attempt=4, partial=aborted.samples, history=["aborted: x"])
    fields, objects = prompt_fields_offloaded(last, MIN_BYTES, plane.new_key)
    assert len(objects) == 2 and fields["refs"] == group_member([o.ref.key for o in objects])
    await plane.put(objects)
    assert await queue.dead_letter(k.prompts, entry_id, fields, "past max_attempts", None, [o.ref for o in objects])
    [(_, raw)] = await redis.xrange(k.dead)
    assert_refers_to(raw, [o.ref.key for o in objects], aborted)
    assert await held(redis, ns) == (1, sum(o.ref.size for o in objects), 0, 0)  # claimed: intent -> held
    [dead] = await dead_entries(redis, k)
    assert dead.prompt is not None and dead.prompt.payload is not None and dead.prompt.partial is not None
    dead.prompt.payload.attach(Group(index=0, prompt="p", samples=dead.prompt.partial),
                               await plane.fetch(dead.prompt.payload))
    assert dead.prompt.partial == aborted.samples  # the very arrays
    assert await drop_dead(redis, k, [dead.id]) == 1
    assert await plane.free() == 2 and objects_in(store) == [] and await held(redis, ns) == (0, 0, 0, 0)

    fields, objects = prompt_fields_offloaded(last, MIN_BYTES, plane.new_key)
    await plane.put(objects)  # the prompt is no longer ours: nothing claims them
    assert not await queue.dead_letter(k.prompts, entry_id, fields, "again", None, [o.ref for o in objects])
    assert await plane.free() == 2 and objects_in(store) == [] and await held(redis, ns) == (0, 0, 0, 0)
    await plane.close()


def test_a_prompt_with_inconsistent_references_is_refused() -> None:
    """The prompt decoder checks a partial sample's references as the group decoder does: ``objs``
    without partial samples, ``ofl`` outside a version-4 prompt, an object no sample uses, a
    version an older build cannot read."""
    import itertools

    import msgpack
    from rollstream.common.codec import decode_prompt, encode_prompt, group_fields_offloaded
    from rollstream.common.codec.wire import unpack
    from rollstream.common.errors import DecodeError
    from rollstream.common.models import retry_prompt

    counter = itertools.count()
    fields, _ = group_fields_offloaded(aborted_r3_group(), MIN_BYTES, lambda: f"ns/obj{next(counter)}")
    raw = {name.encode(): value if isinstance(value, bytes) else str(value).encode() for name, value in fields.items()}
    good = unpack(encode_prompt(retry_prompt(decode_group_entry(raw), "aborted: x", keep_partial=True)), DEFAULT_LIMITS)
    decode_prompt(msgpack.packb(good))

    def tampered(change: dict[str, object]) -> bytes:
        return msgpack.packb({**good, **change})

    with pytest.raises(DecodeError, match="objs without partial"):
        decode_prompt(tampered({"partial": None}))
    with pytest.raises(DecodeError, match="ofl outside"):
        decode_prompt(tampered({"v": 3, "objs": None}))
    with pytest.raises(DecodeError, match="an object no partial sample"):
        decode_prompt(tampered({"objs": [*good["objs"], ["ns/extra", 8, 0]]}))
    with pytest.raises(DecodeError, match="schema version 5"):
        decode_prompt(tampered({"v": 5}))
