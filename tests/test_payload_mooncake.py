"""The ``mooncake://`` payload store against a real Mooncake cluster on loopback: a real
``mooncake_master`` and real store processes (``mooncake_client``) contributing memory, this test
process joining with a segment of 0. Faults are real SIGKILLs of the store process and the master.

Skips, saying why, where Mooncake cannot run (not Linux x86_64, the ``mooncake`` extra missing,
or libibverbs1 / libnuma1 not installed: ``.ci/run`` installs them)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from conftest import wait_until
from rollstream.common.errors import (
    ConfigError,
    ExtraNotInstalled,
    PayloadCorrupt,
    PayloadError,
    PayloadMissing,
    PayloadStoreFull,
    PayloadUnreadable,
)
from rollstream.common.payload import PayloadStore, checksum, open_store
from rollstream.common.payload.mooncake import MooncakeStore, parse_url
from rollstream.runtime.redis_server import free_port
from rollstream.testing.mooncake_cluster import MooncakeCluster, mooncake_unavailable

UNAVAILABLE = mooncake_unavailable()
needs_mooncake = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"Mooncake cannot run here: {UNAVAILABLE}")

LEASE_MS = 5000
"""The master's read lease in these clusters: long enough that a remove right after a get is
refused on a loaded machine, short enough that waiting it out stays cheap."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeCluster]:
    if UNAVAILABLE is not None:
        pytest.skip(f"Mooncake cannot run here: {UNAVAILABLE}")
    with MooncakeCluster(tmp_path_factory.mktemp("mooncake"), segment="256MB", lease_ms=LEASE_MS) as running:
        yield running


@pytest.fixture
def fault_cluster(tmp_path: Path) -> Iterator[MooncakeCluster]:
    """A cluster of its own for a test that kills its processes; the master notices a dead store
    process after 5 s (``--client_ttl``)."""
    if UNAVAILABLE is not None:
        pytest.skip(f"Mooncake cannot run here: {UNAVAILABLE}")
    with MooncakeCluster(tmp_path / "mooncake", segment="128MB", lease_ms=LEASE_MS, client_ttl=5) as running:
        yield running


@pytest.fixture
async def store(cluster: MooncakeCluster) -> AsyncIterator[PayloadStore]:
    opened = open_store(cluster.url)
    yield opened
    await opened.close()


async def deleted(store: PayloadStore, keys: list[str], timeout: float = 30.0) -> None:
    """Until every key's removal is confirmed (read leases run out)."""
    remaining = list(keys)

    async def attempt() -> bool:
        confirmed = await store.delete(remaining)
        remaining[:] = [key for key in remaining if key not in confirmed]
        return not remaining

    await wait_until(attempt, timeout=timeout, interval=0.2)


@needs_mooncake
async def test_round_trip_through_open_store(store: PayloadStore, cluster: MooncakeCluster) -> None:
    assert isinstance(store, MooncakeStore)
    assert store.url == cluster.url
    parts = [b"hello ", memoryview(b"big world")[4:], bytearray(b"!"), memoryview(b"\x01\x00\x02\x00").cast("H")]
    await store.put("rt/a", parts)
    expected = b"hello world!\x01\x00\x02\x00"
    view = await store.get("rt/a", len(expected))
    assert isinstance(view, memoryview) and view.readonly and bytes(view) == expected
    assert checksum([view]) == checksum(parts)
    await store.put("rt/empty", [])
    assert bytes(await store.get("rt/empty", 0)) == b""
    assert await store.stat("rt/a") == len(expected)
    assert await store.stat("rt/empty") == 0
    assert await store.stat("rt/never") is None
    assert [item async for item in store.list("rt/")] == [("rt/a", len(expected)), ("rt/empty", 0)]
    await deleted(store, ["rt/a", "rt/empty", "rt/never"])
    assert [item async for item in store.list("rt/")] == []
    assert "rt/a" not in cluster.keys()
    with pytest.raises(PayloadMissing, match=rf"payload store {re.escape(cluster.url)}: object 'rt/a': not in"):
        await store.get("rt/a", len(expected))
    assert bytes(view) == expected  # a buffer already returned stays valid after the object goes


@needs_mooncake
async def test_a_big_object_in_several_parts(store: PayloadStore) -> None:
    parts = [os.urandom(7 << 20), os.urandom(1), os.urandom(13 << 20)]
    size = sum(len(part) for part in parts)
    await store.put("big/x", parts)
    view = await store.get("big/x", size)
    assert view == b"".join(parts)
    await deleted(store, ["big/x"])


@needs_mooncake
async def test_delete_is_refused_under_a_read_lease_and_confirmed_after(store: PayloadStore) -> None:
    """Mooncake refuses to remove an object it leased to a reader (OBJECT_HAS_LEASE): the delete
    does not report it gone, the object stays whole, and a later delete confirms it."""
    await store.put("lease/a", [b"abc"])
    await store.put("lease/b", [b"def"])
    assert bytes(await store.get("lease/a", 3)) == b"abc"
    assert await store.delete(["lease/a", "lease/b", "lease/absent"]) == ["lease/b", "lease/absent"]
    assert bytes(await store.get("lease/a", 3)) == b"abc"  # refused means untouched
    await deleted(store, ["lease/a"])
    assert await store.stat("lease/a") is None


@needs_mooncake
async def test_a_wrong_size_is_corrupt_never_short(store: PayloadStore, cluster: MooncakeCluster) -> None:
    await store.put("size/k", [b"abc"])
    with pytest.raises(PayloadCorrupt, match="holds 3 bytes, its entry says 4"):
        await store.get("size/k", 4)
    with pytest.raises(PayloadCorrupt, match="holds 3 bytes, its entry says 2"):
        await store.get("size/k", 2)
    # a put over an existing key keeps the stored object (Mooncake's put is insert-only): a reader
    # of the second put's size is told, never handed the first put's bytes as its own
    await store.put("size/k", [b"wxyz"])
    with pytest.raises(PayloadCorrupt, match="holds 3 bytes, its entry says 4"):
        await store.get("size/k", 4)
    await deleted(store, ["size/k"])


@needs_mooncake
async def test_get_many_reads_objects_in_one_batch_each_checked_as_get_checks_it(store: PayloadStore) -> None:
    """One ``batch_get_into`` into one mapping (huge pages past 2 MiB): the bytes in order,
    read-only; a missing or wrong-sized key among good ones is that key's error, never a short
    buffer, and the first failing key (in order) is the one raised."""
    blobs = {"many1/big": os.urandom(5 << 20), "many1/empty": b"", "many1/small": b"abc", "many1/mid": os.urandom(70_000)}
    for key, blob in blobs.items():
        await store.put(key, [blob])
    views = await store.get_many([(key, len(blob)) for key, blob in blobs.items()])
    assert [bytes(view) for view in views] == list(blobs.values()) and all(view.readonly for view in views)
    assert await store.get_many([]) == []
    with pytest.raises(PayloadMissing, match="object 'many1/absent': not in the Mooncake store"):
        await store.get_many([("many1/small", 3), ("many1/absent", 9), ("many1/big", 5 << 20)])
    with pytest.raises(PayloadCorrupt, match="object 'many1/small': holds 3 bytes, its entry says 4"):
        await store.get_many([("many1/big", 5 << 20), ("many1/small", 4), ("many1/absent", 9)])
    with pytest.raises(PayloadCorrupt, match="object 'many1/mid': holds 70000 bytes, its entry says 69999"):
        await store.get_many([("many1/mid", 69_999)])
    await deleted(store, list(blobs))


@needs_mooncake
async def test_read_memory_is_reused_only_once_nothing_refers_to_it(store: PayloadStore) -> None:
    """Gets reuse the memory of earlier reads (no fresh pages to fault in and zero), but never
    while a view of it, or a numpy array on one, is alive: the bytes a trainer holds stay its."""
    import numpy as np
    from rollstream.common.payload.mooncake import address

    blobs = {f"pool/{i}": os.urandom(3 << 20) for i in range(3)}
    for key, blob in blobs.items():
        await store.put(key, [blob])
    size = 3 << 20
    # the views stay out of the asserts: with pytest's assertion pass hook on (tests/assert_count.py)
    # a passing assert's explanation keeps what it named alive, and the memory with it
    first = await store.get("pool/0", size)
    where, read = address(first), bytes(first)
    second = await store.get("pool/1", size)
    assert address(second) != where and read == blobs["pool/0"]
    held = np.frombuffer(first, dtype=np.uint8)[1:]
    del first
    third = await store.get("pool/2", size)
    kept = held.tobytes()
    del held
    assert address(third) != where and kept == blobs["pool/0"][1:]  # the array kept it
    again = await store.get("pool/1", size)
    assert address(again) == where and bytes(again) == blobs["pool/1"]  # free: reused
    (batch,) = await store.get_many([("pool/2", size)])
    assert address(batch) != where and bytes(batch) == bytes(third) == blobs["pool/2"]
    await deleted(store, list(blobs))


@needs_mooncake
async def test_the_plane_fetches_a_group_in_batches_and_checks_every_crc(store: PayloadStore) -> None:
    """A group's objects past :data:`FETCH_BATCH_BYTES` are read in several batches, each
    object's CRC-32 verified: a wrong one is ``PayloadCorrupt`` naming its key."""
    from redis.asyncio import Redis
    from rollstream.common.keys import Keys
    from rollstream.common.payload.plane import FETCH_BATCH_BYTES, PayloadPlane
    from rollstream.common.payload.refs import GroupPayload, ObjectRef

    assert store.batch_reads
    plane = PayloadPlane(store, Redis(), Keys("plane-batches"))  # fetch asks Redis nothing
    blobs = {f"many2/{i}": os.urandom(3 << 20) for i in range(2 * FETCH_BATCH_BYTES // (3 << 20) + 1)}
    for key, blob in blobs.items():
        await store.put(key, [blob])
    refs = [ObjectRef(key, len(blob), checksum([blob])) for key, blob in blobs.items()]
    got = await plane.fetch(GroupPayload(tuple(refs), ()))
    assert {key: bytes(view) for key, view in got.items()} == blobs
    wrong = refs[-1].key
    refs[-1] = ObjectRef(wrong, refs[-1].size, refs[-1].checksum ^ 1)
    with pytest.raises(PayloadCorrupt, match=f"object '{wrong}': CRC-32 "):
        await plane.fetch(GroupPayload(tuple(refs), ()))
    await deleted(store, list(blobs))


@needs_mooncake
async def test_listing_and_stat_take_no_read_lease(store: PayloadStore) -> None:
    """The sweep lists, then deletes what nobody claims: listing must not lease the objects (a
    client size query would, and the delete would be refused for the lease's 5 s)."""
    await store.put("sweep/a", [b"abc"])
    assert await store.stat("sweep/a") == 3
    assert [item async for item in store.list("sweep/")] == [("sweep/a", 3)]
    assert await store.delete(["sweep/a"]) == ["sweep/a"]


@needs_mooncake
async def test_concurrent_puts_and_gets(store: PayloadStore) -> None:
    blobs = {f"many/{i}": os.urandom(256 << 10) for i in range(12)}
    await asyncio.gather(*(store.put(key, [blob]) for key, blob in blobs.items()))
    views = await asyncio.gather(*(store.get(key, len(blob)) for key, blob in blobs.items()))
    assert [bytes(view) for view in views] == list(blobs.values())
    await deleted(store, list(blobs))


@needs_mooncake
async def test_objects_outlive_the_producer_that_put_them(store: PayloadStore, cluster: MooncakeCluster,
                                                           tmp_path: Path) -> None:
    """A producer joins with a segment of 0: the bytes it puts live in the store process, so
    SIGKILLing the producer right after its put loses nothing."""
    script = textwrap.dedent(f"""
        import asyncio, os, sys
        from rollstream.common.payload import open_store
        async def main():
            store = open_store({cluster.url!r})
            await store.put("producer/obj", [b"x" * 100_000, b"y"])
            print("put", flush=True)
            await asyncio.sleep(600)
        asyncio.run(main())
    """)
    with (tmp_path / "producer.log").open("wb") as log:
        producer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=log)  # noqa: ASYNC220
    try:
        assert producer.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(producer.stdout.readline), 60)
        assert line == b"put\n", (tmp_path / "producer.log").read_text()[-2000:]
    finally:
        producer.send_signal(signal.SIGKILL)
        producer.wait()
    assert bytes(await store.get("producer/obj", 100_001)) == b"x" * 100_000 + b"y"
    await deleted(store, ["producer/obj"])


@needs_mooncake
async def test_store_process_killed_reads_fail_loudly_then_recover(fault_cluster: MooncakeCluster) -> None:
    """The store process holding the objects SIGKILLed: every read of them fails naming the store
    and the key (first the transfer fails, then, once the master drops the segment, the object is
    missing), nothing comes back short; a put finds no room until a store process is back; the
    lost objects' deletion is confirmed (they are gone)."""
    store = open_store(fault_cluster.url)
    try:
        keys = [f"fault/{i}" for i in range(4)]
        for key in keys:
            await store.put(key, [os.urandom(1 << 20)])
        fault_cluster.kill_store()
        # still mounted (the master drops it after --client_ttl): a put placed there is revoked and
        # tried again, then reported as no room (the producer backs off) instead of a fatal error;
        # on a loaded machine the master may have dropped the segment already: no room either way
        with pytest.raises(PayloadStoreFull, match=r"3 tries were placed on store processes that do not answer|no room"):
            await store.put("fault/during", [b"x"])
        with pytest.raises((PayloadUnreadable, PayloadMissing)) as caught:
            await store.get(keys[0], 1 << 20)
        assert caught.value.store == fault_cluster.url and caught.value.key == keys[0]
        assert f"payload store {fault_cluster.url}: object '{keys[0]}'" in str(caught.value)
        fault_cluster.wait_segment_gone()
        for key in keys:
            with pytest.raises(PayloadMissing, match=re.escape(key)):
                await store.get(key, 1 << 20)
        with pytest.raises(PayloadStoreFull, match="no room for 10 bytes: the store processes' segments are full, or none"):
            await store.put("fault/new", [b"0123456789"])
        assert await store.delete(keys) == keys
        fault_cluster.start_store()
        await store.put("fault/new", [b"0123456789"])
        assert bytes(await store.get("fault/new", 10)) == b"0123456789"
    finally:
        await store.close()


@needs_mooncake
async def test_master_killed_calls_fail_then_a_restarted_master_knows_nothing(fault_cluster: MooncakeCluster) -> None:
    """The master SIGKILLed: reads fail (PayloadUnreadable), nothing is confirmed deleted, listing
    fails. Restarted (no HA: its object table is gone), the store process mounts again, the old
    objects are missing (recycled, never short), their deletion is confirmed, puts work."""
    store = open_store(fault_cluster.url)
    try:
        await store.put("m/a", [b"abc"])
        fault_cluster.kill_master()
        with pytest.raises(PayloadUnreadable, match=r"object 'm/a': cannot read it: RPC_FAIL"):
            await store.get("m/a", 3)
        assert await store.delete(["m/a"]) == []
        with pytest.raises(PayloadUnreadable, match=r"cannot ask the master's admin server"):
            [item async for item in store.list("m/")]
        fault_cluster.start_master()
        fault_cluster.wait_store(fault_cluster.stores[0])
        with pytest.raises(PayloadMissing, match="object 'm/a'"):
            await store.get("m/a", 3)
        assert await store.delete(["m/a"]) == ["m/a"]
        await store.put("m/b", [b"back"])
        assert bytes(await store.get("m/b", 4)) == b"back"
    finally:
        await store.close()


@needs_mooncake
async def test_no_master_is_a_fast_loud_error() -> None:
    store = open_store(f"mooncake://127.0.0.1:{free_port()}?metadata=P2PHANDSHAKE&timeout=20")
    with pytest.raises(PayloadUnreadable, match=r"object 'x/k': cannot reach mooncake_master at 127\.0\.0\.1:\d+"):
        await store.put("x/k", [b"v"])
    await store.close()


async def test_without_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    store = open_store("mooncake://127.0.0.1:1?metadata=P2PHANDSHAKE")
    with pytest.raises(ExtraNotInstalled, match=r"pip install 'rollstream\[mooncake\]'"):
        await store.get("x/k", 1)
    await store.close()


def test_urls() -> None:
    options = parse_url("mooncake://m.example:7000?metadata=http://m.example:8080/metadata&replicas=2&timeout=5")
    assert (options.master, options.admin, options.replicas, options.timeout) == (
        "m.example:7000", "m.example:9003", 2, 5.0)
    assert parse_url("mooncake://m?metadata=P2PHANDSHAKE").master == "m:50051"
    assert parse_url("mooncake://[::1]:1?metadata=P2PHANDSHAKE&admin=[::1]:2").admin == "[::1]:2"
    bad = {
        "mooncake://m:1": "metadata= must be",
        "mooncake://m:1?metadata=etcd-host:2379": "metadata= must be",
        "mooncake://m:1?metadata=P2PHANDSHAKE&speed=9": "unknown option 'speed'",
        "mooncake://m:1?metadata=P2PHANDSHAKE&protocol=udp": "protocol= is tcp or rdma",
        "mooncake://m:1?metadata=P2PHANDSHAKE&replicas=0": "replicas= must be at least 1",
        "mooncake://m:1?metadata=P2PHANDSHAKE&timeout=soon": "timeout= must be a number",
        "mooncake://m:1?metadata=P2PHANDSHAKE&admin=nohost": "admin= is HOST:PORT",
        "mooncake://u:secret@m:1?metadata=P2PHANDSHAKE": "no user or password",
        "mooncake://m:1/path?metadata=P2PHANDSHAKE": "no path",
        "mooncake://m:99999?metadata=P2PHANDSHAKE": "out of range",
        "mooncake://?metadata=P2PHANDSHAKE": "expected mooncake://",
    }
    for url, message in bad.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            open_store(url)
    with pytest.raises(ConfigError) as caught:
        open_store("mooncake://u:secret@m:1?metadata=P2PHANDSHAKE")
    assert "secret" not in str(caught.value)


def test_payload_errors_are_one_family() -> None:
    for error in (PayloadMissing, PayloadUnreadable, PayloadCorrupt, PayloadStoreFull):
        assert issubclass(error, PayloadError)
