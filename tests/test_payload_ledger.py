"""The payload plane's ledgers hold one member per group (its object set), so the Redis work of a
group's publish and commit does not grow with its sample count; a set leaves the to-free ledger
only once the store confirmed every key of it gone (real redis-server, real ``fs`` store)."""

from __future__ import annotations

import shutil
from pathlib import Path

from conftest import make_namespace
from redis.asyncio import Redis
from rollstream.common.codec import group_fields_offloaded, prompt_fields
from rollstream.common.keys import PRODUCERS_GROUP, TRAINER_GROUP, Keys, StateField
from rollstream.common.models import Prompt
from rollstream.common.payload.plane import PayloadPlane
from rollstream.common.payload.refs import group_member, member_keys, member_of, object_keys
from rollstream.common.protocol import GroupQueue, PromptQueue
from rollstream.testing.samples import full_group
from test_payload_pipeline import objects_in


def test_a_group_member_names_its_keys_and_back() -> None:
    keys = object_keys("ns/abc", 3)
    assert keys == ["ns/abc-3.0", "ns/abc-3.1", "ns/abc-3.2"]
    assert group_member(keys) == "ns/abc-3" and member_keys("ns/abc-3") == keys
    assert [member_of(k) for k in keys] == ["ns/abc-3"] * 3
    assert member_of("ns/abc-3.3") == "ns/abc-3.3" and member_keys("ns/abc-3.3") == ["ns/abc-3.3"]  # not of the set
    assert group_member(["ns/0123abcd"]) == "ns/0123abcd" == member_of("ns/0123abcd")  # one key: its own member
    assert member_keys("my-ns/0123abcd") == ["my-ns/0123abcd"]


async def _commands(redis: Redis) -> dict[str, int]:
    stats = await redis.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}


async def _publish_and_commit(redis: Redis, keys: Keys, plane: PayloadPlane, index: int, samples: int) -> int:
    """One group of ``samples`` samples put, published, read by the trainer, committed and its
    objects freed; the Redis commands that cost (``INFO commandstats``, scripts' inner commands
    included), the stats reset first."""
    await redis.xadd(keys.prompts, prompt_fields(Prompt(index=index, prompt="p")))
    [[_, [(prompt_id, _)]]] = await redis.xreadgroup(PRODUCERS_GROUP, "p", {keys.prompts: ">"}, count=1)
    fields, objects = group_fields_offloaded(full_group(n=samples, index=index), 64, plane.new_key)
    assert len(objects) == samples  # one object per sample
    await redis.config_resetstat()
    await plane.put(objects)
    group_id = await PromptQueue(redis, keys, "p").publish(keys.prompts, prompt_id, fields, None,
                                                          [o.ref for o in objects])
    assert group_id
    await redis.xreadgroup(TRAINER_GROUP, "t", {keys.groups: ">"}, count=1)
    assert await GroupQueue(redis, keys, "t").commit([group_id]) == 1
    assert await plane.free(rounds=4) == samples  # as the trainer frees after a commit
    stats = await _commands(redis)
    assert stats.get("zrange") == 1, stats  # free: the to-free ledger read once (fewer than a batch: no more)
    # The reset itself is not the group's: Redis 6.2 names it ``config``, Redis 7 ``config|resetstat``.
    return sum(calls for name, calls in stats.items() if name not in ("info", "config", "config|resetstat"))


async def test_a_groups_publish_and_commit_cost_the_same_redis_commands_whatever_its_samples(
    redis: Redis, ns: str, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    await make_namespace(redis, ns, payload_store=f"fs://{store}", payload_min_bytes=64)
    keys = Keys(ns)
    plane = PayloadPlane.open(f"fs://{store}", redis, keys)
    try:
        await _publish_and_commit(redis, keys, plane, 0, 1)  # warm-up: the scripts loaded
        costs = {n: await _publish_and_commit(redis, keys, plane, n, n) for n in (2, 16)}
    finally:
        await plane.close()
    assert costs[2] == costs[16] == 43, costs  # one ledger member per group: intent, claim, release, free
    assert objects_in(store) == []
    assert int(await redis.hget(keys.state, StateField.PAYLOAD_FREED) or 0) == 1 + 2 + 16  # objects, counted
    assert await redis.hlen(keys.payload_refs) == 0 and await redis.hlen(keys.payload_held) == 0


async def test_a_set_leaves_the_to_free_ledger_only_once_every_key_is_confirmed_gone(
    redis: Redis, ns: str, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    await make_namespace(redis, ns, payload_store=f"fs://{store}", payload_min_bytes=64)
    keys = Keys(ns)
    plane = PayloadPlane.open(f"fs://{store}", redis, keys)
    try:
        _, objects = group_fields_offloaded(full_group(n=3), 64, plane.new_key)
        await plane.put(objects)
        member = group_member([o.ref.key for o in objects])
        await plane.ledger.abandon([member], 0)
        stuck = store / objects[1].ref.key  # the store refuses to remove it (a directory in its place)
        stuck.unlink()
        stuck.mkdir()
        (stuck / "x").write_bytes(b"x")
        assert await plane.free() == 0
        assert [k.decode() for k in await redis.zrange(keys.payload_free, 0, -1)] == [member]  # kept
        assert objects_in(store) == [f"{objects[1].ref.key}/x"]  # the other keys went
        shutil.rmtree(stuck)
        assert await plane.free() == 3  # tried again: the gone keys count as gone
        assert await redis.zcard(keys.payload_free) == 0
    finally:
        await plane.close()


async def test_an_archive_record_dropped_for_room_releases_its_objects(redis: Redis, ns: str, tmp_path: Path) -> None:
    """The archive budget drops the oldest record to make room: its object set leaves ``held``
    (and ``payload_bytes``) for ``free`` (``_archive.lua`` once passed its byte count as the held
    ledger's key: the set stayed claimed forever)."""
    from test_payload_pipeline import _publish_offloaded

    store = tmp_path / "store"
    await make_namespace(redis, ns, payload_store=f"fs://{store}", payload_min_bytes=64, archive_bytes=1 << 30)
    keys = Keys(ns)
    published = await _publish_offloaded(redis, keys, [full_group(n=2, index=i) for i in range(2)], store)
    entries = await redis.xrange(keys.groups)
    size = max(int(f[b"bytes"]) + int(f[b"store_bytes"]) for _, f in entries)  # a record: this and ~300
    await redis.hset(keys.config, "archive_bytes", size * 3 // 2)  # room for one record, not two
    delivered = await redis.xreadgroup(TRAINER_GROUP, "t", {keys.groups: ">"})
    ids = [entry_id for entry_id, _ in delivered[0][1]]
    assert await GroupQueue(redis, keys, "t").commit(ids) == 2
    records = [int(f[b"record_bytes"]) for _, f in await redis.xrange(keys.archive)]
    assert len(records) == 1, (records, size)  # the first record dropped for the second
    assert int(await redis.hget(keys.state, StateField.ARCHIVE_DROPPED) or 0) == 1
    assert [k.decode() for k in await redis.hkeys(keys.payload_held)] == [group_member(published[1])]
    second = int(entries[1][1][b"store_bytes"])
    assert int(await redis.hget(keys.state, StateField.PAYLOAD_BYTES) or 0) == second
    plane = PayloadPlane.open(f"fs://{store}", redis, keys)
    try:
        assert await plane.free() == len(published[0])
    finally:
        await plane.close()
    assert objects_in(store) == sorted(published[1])


async def test_a_group_deleted_by_hand_releases_its_objects_when_the_trainer_finds_it_gone(
    redis: Redis, ns: str, tmp_path: Path
) -> None:
    """A delivered group entry deleted by hand (``XDEL``): FORGET finds its object set in
    ``payload:refs`` (the entry is gone) and releases it, so nothing stays claimed."""
    from test_payload_pipeline import _publish_offloaded

    store = tmp_path / "store"
    await make_namespace(redis, ns, payload_store=f"fs://{store}", payload_min_bytes=64)
    keys = Keys(ns)
    [published] = await _publish_offloaded(redis, keys, [full_group(n=3)], store)
    [[_, [(entry_id, _)]]] = await redis.xreadgroup(TRAINER_GROUP, "t", {keys.groups: ">"})
    await redis.xdel(keys.groups, entry_id)
    await GroupQueue(redis, keys, "t").ack_deleted(entry_id)
    assert await redis.hlen(keys.payload_held) == 0 and await redis.hlen(keys.payload_refs) == 0
    assert int(await redis.hget(keys.state, StateField.PAYLOAD_BYTES) or 0) == 0
    plane = PayloadPlane.open(f"fs://{store}", redis, keys)
    try:
        assert await plane.free() == len(published) == 3
    finally:
        await plane.close()
    assert objects_in(store) == []
