"""The payload store interface and its ``fs`` backend, on real directories (and a real small
tmpfs for the full-disk case when the suite runs as root)."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from rollstream.common.errors import (
    ConfigError,
    PayloadCorrupt,
    PayloadError,
    PayloadMissing,
    PayloadStoreFull,
    RollstreamError,
)
from rollstream.common.payload import ObjectRef, check_key, checksum, open_store
from rollstream.common.payload.fs import FsStore
from tmpfs import mounted_tmpfs


async def test_put_get_delete_list_round_trip(tmp_path: Path) -> None:
    store = open_store(f"fs://{tmp_path}")
    assert isinstance(store, FsStore)
    await store.put("ns/a", [b"hello ", memoryview(b"world")])
    view = await store.get("ns/a", 11)
    assert bytes(view) == b"hello world"
    assert await store.stat("ns/a") == 11
    assert await store.stat("ns/b") is None
    await store.put("ns/b", [])
    assert bytes(await store.get("ns/b", 0)) == b""
    assert [item async for item in store.list("ns/")] == [("ns/a", 11), ("ns/b", 0)]
    assert await store.delete(["ns/a", "ns/never"]) == ["ns/a", "ns/never"]  # absent counts as gone
    with pytest.raises(PayloadMissing, match=r"payload store fs://.*object 'ns/a'"):
        await store.get("ns/a", 11)
    assert bytes(view) == b"hello world"  # a mapped object stays readable after its file is removed
    await store.close()


async def test_get_refuses_a_wrong_size(tmp_path: Path) -> None:
    store = open_store(f"fs://{tmp_path}")
    await store.put("k", [b"abc"])
    with pytest.raises(PayloadCorrupt, match="holds 3 bytes, its entry says 4"):
        await store.get("k", 4)


async def test_a_put_is_never_seen_half_written(tmp_path: Path) -> None:
    """The object's name appears only once every byte is there: a leftover temporary file (a
    writer killed mid-put) is neither listed nor readable, and deleting the key removes it."""
    store = FsStore(f"fs://{tmp_path}")
    (tmp_path / "ns").mkdir()
    partial = tmp_path / "ns" / ".obj.abc123.part"
    partial.write_bytes(b"half")
    assert [item async for item in store.list("")] == []
    with pytest.raises(PayloadMissing):
        await store.get("ns/obj", 4)
    assert await store.delete(["ns/obj"]) == ["ns/obj"]
    assert not partial.exists()


def test_keys_cannot_leave_the_directory() -> None:
    for bad in ("../etc/passwd", "/abs", "a/../b", ".hidden", "a//b", "", "x" * 201, "a b", "-x"):
        with pytest.raises(ConfigError):
            check_key(bad)
    assert check_key("ns-1/producer.a/0123_x") == "ns-1/producer.a/0123_x"


def test_urls() -> None:
    with pytest.raises(ConfigError, match="expected fs:///absolute"):
        open_store("fs://relative/dir")
    with pytest.raises(ConfigError, match="only option is fsync"):
        open_store("fs:///tmp/x?sync=1")
    with pytest.raises(ConfigError, match="scheme 's3'"):
        open_store("s3://bucket")
    with pytest.raises(ConfigError):
        open_store("")
    assert FsStore("fs:///tmp/x?fsync=1").fsync


def test_object_refs_and_checksum() -> None:
    assert checksum([b"ab", b"c"]) == zlib.crc32(b"abc")
    ref = ObjectRef("ns/k", 3, zlib.crc32(b"abc"))
    assert ObjectRef.from_wire(ref.to_wire()) == ref
    for bad in (["../k", 3, 0], ["k", -1, 0], ["k", 3, 1 << 32], ["k", True, 0], ("k", 3)):
        with pytest.raises(ValueError):
            ObjectRef.from_wire(bad)


def test_payload_errors_name_store_and_key() -> None:
    error = PayloadMissing("fs:///x", "ns/k", "gone")
    assert isinstance(error, PayloadError) and isinstance(error, RollstreamError)
    assert (error.store, error.key, str(error)) == ("fs:///x", "ns/k", "payload store fs:///x: object 'ns/k': gone")


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs (mounting needs root)."""
    with mounted_tmpfs(tmp_path / "small", "1m") as mount:
        yield mount


async def test_a_full_directory_is_store_full_and_leaves_nothing(small_tmpfs: Path) -> None:
    store = open_store(f"fs://{small_tmpfs}")
    await store.put("ns/small", [b"x" * 1000])
    with pytest.raises(PayloadStoreFull, match="no room"):
        await store.put("ns/big", [b"y" * (2 << 20)])
    assert [key async for key, _ in store.list("")] == ["ns/small"]
    assert not [p for p in (small_tmpfs / "ns").iterdir() if p.name.startswith(".")]  # no partial left
    assert await store.stat("ns/big") is None
