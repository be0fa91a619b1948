"""The archive of fates: every group's fate recorded by the script that decides it, bounded by a
byte budget (drops counted, shown, warned), and written to Parquet exactly once by
``rollstream archive``, across a SIGKILL of the archiver."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import ProcessPool, add_prompts, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common.archive_schema import (
    SCHEMA_VERSION,
    ArchiveRecord,
    archive_files,
    file_schema_version,
    publish_part,
    read_table,
    written_cursor,
)
from rollstream.common.codec import decode_group, group_fields, prompt_fields
from rollstream.common.config import PipelineConfig
from rollstream.common.connection import connect
from rollstream.common.errors import ConfigError
from rollstream.common.keys import TRAINER_GROUP, Keys, StateField
from rollstream.common.models import Prompt
from rollstream.common.protocol import ArchiveStream, GroupQueue, PromptQueue
from rollstream.consumer import GroupConsumer
from rollstream.ops.archiver import Archiver, ArchiveSettings
from rollstream.ops.snapshot import snapshot
from rollstream.testing.samples import full_group

pytest.importorskip("pyarrow")


async def _publish(redis: Redis, keys: Keys, index: int, **kwargs: int) -> bytes:
    group = full_group(n=2, index=index, **kwargs)
    entry_id: bytes = await redis.xadd(keys.groups, group_fields(group))
    return entry_id


async def _read(redis: Redis, keys: Keys) -> list[ArchiveRecord]:
    return [ArchiveRecord.parse(eid, fields) for eid, fields in await redis.xrange(keys.archive)]


async def test_each_fate_is_recorded_by_its_script(redis: Redis, ns: str, keys: Keys) -> None:
    await make_namespace(redis, ns, archive_bytes=50_000_000)
    await redis.hset(keys.state, StateField.WEIGHT_VERSION, 3)
    ids = [await _publish(redis, keys, i) for i in range(6)]
    await redis.xreadgroup(TRAINER_GROUP, "trainer-a", {keys.groups: ">"})
    queue = GroupQueue(redis, keys, "trainer-a")
    assert await queue.commit([ids[1], ids[0]]) == 2
    assert await queue.commit([ids[2]]) == 1
    assert await queue.drop_filtered(ids[3], "zero_std") == 1
    assert await queue.recycle(ids[4], StateField.RECYCLED_STALE, {"index": 4, "attempt": 1}, "stale: 2 > 1")
    assert await queue.dead_letter(ids[5], {"index": 5}, "wrong_group_size: 1 != 2")
    assert await queue.commit([ids[0]]) == 0  # nothing acknowledged: neither a record nor a step

    records = await _read(redis, keys)
    assert [(r.fate, r.entry_id, r.step, r.position) for r in records] == [
        ("trained", ids[1].decode(), 1, 0), ("trained", ids[0].decode(), 1, 1), ("trained", ids[2].decode(), 2, 0),
        ("filtered", ids[3].decode(), None, None), ("recycled", ids[4].decode(), None, None),
        ("dead_lettered", ids[5].decode(), None, None),
    ]
    assert [r.reason for r in records[3:]] == ["zero_std", "stale: 2 > 1", "wrong_group_size: 1 != 2"]
    assert {r.actor for r in records} == {"trainer-a"} and {r.trainer_version for r in records} == {3}
    assert decode_group(records[0].fields[b"data"]).index == 1  # the entry itself, copied before XDEL
    state = await redis.hgetall(keys.state)
    assert int(state[b"archive_recorded"]) == 6 and int(state[b"trained_steps"]) == 2
    assert int(state[b"archive_bytes"]) == sum(r.record_bytes for r in records)

    # a prompt the producer dead-letters is archived too, decided by the producer
    prompt_id = await redis.xadd(keys.prompts, prompt_fields(Prompt(index=9, prompt="p")))
    await redis.xreadgroup("producers", "producer-1", {keys.prompts: ">"})
    prompts = PromptQueue(redis, keys, "producer-1")
    assert await prompts.dead_letter(keys.prompts, prompt_id, {"index": 9}, "undecodable: bad")
    last = (await _read(redis, keys))[-1]
    assert (last.fate, last.actor, last.stream, last.reason) == ("dead_lettered", "producer-1", "prompts", "undecodable: bad")


async def test_no_budget_no_records(redis: Redis, ns: str, keys: Keys) -> None:
    await make_namespace(redis, ns)
    entry = await _publish(redis, keys, 0)
    await redis.xreadgroup(TRAINER_GROUP, "t", {keys.groups: ">"})
    assert await GroupQueue(redis, keys, "t").commit([entry]) == 1
    assert await redis.xlen(keys.archive) == 0 and await redis.hget(keys.state, StateField.ARCHIVE_RECORDED) is None


async def test_budget_drops_oldest_counted_and_shown(redis: Redis, redis_url: str, ns: str, keys: Keys) -> None:
    one = len(group_fields(full_group(n=2, index=0))["data"])  # type: ignore[arg-type]
    budget = int(one * 3.5)
    await make_namespace(redis, ns, archive_bytes=budget)
    ids = [await _publish(redis, keys, i) for i in range(10)]
    await redis.xreadgroup(TRAINER_GROUP, "t", {keys.groups: ">"})
    queue = GroupQueue(redis, keys, "t")
    for entry in ids:  # committing is never refused, whatever the archive holds
        assert await queue.commit([entry]) == 1
    records = await _read(redis, keys)
    state = await redis.hgetall(keys.state)
    assert int(state[b"archive_bytes"]) == sum(r.record_bytes for r in records) <= budget
    assert [r.entry_id for r in records] == [i.decode() for i in ids[-len(records):]]  # the newest kept
    dropped = int(state[b"archive_dropped"])
    assert dropped == 10 - len(records) > 0
    snap = await snapshot(redis, keys)
    assert snap["archive"]["dropped"] == dropped and snap["archive"]["length"] == len(records)
    assert any("archive_dropped" in w for w in snap["health"]["warnings"])
    shown = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "rollstream.cli", "inspect", "--redis", redis_url, "--ns", ns],
        capture_output=True, text=True, check=False, timeout=60, env={**os.environ, "COLUMNS": "400"},
    )
    assert f"archive_dropped {dropped}" in " ".join(shown.stdout.split()), shown.stdout + shown.stderr

    # a record larger than the whole budget is dropped itself, counted
    await make_namespace(redis, ns, archive_bytes=100)
    big = await _publish(redis, keys, 50)
    await redis.xreadgroup(TRAINER_GROUP, "t", {keys.groups: ">"})
    assert await queue.commit([big]) == 1
    assert int(await redis.hget(keys.state, StateField.ARCHIVE_DROPPED) or 0) > dropped


async def _archive_until(archiver: Archiver, redis: Redis, keys: Keys) -> None:
    """Run ``archiver`` until the archive stream is empty and confirmed, then stop it."""
    task = asyncio.create_task(archiver.run())
    try:
        await wait_until(
            lambda: _drained(redis, keys, task), message="the archiver to empty the archive stream"
        )
    finally:
        archiver.stop()
        await task


async def _drained(redis: Redis, keys: Keys, task: asyncio.Task[int]) -> bool:
    if task.done():
        task.result()
    recorded = int(await redis.hget(keys.state, StateField.ARCHIVE_RECORDED) or 0)
    archived = int(await redis.hget(keys.state, StateField.ARCHIVED) or 0)
    return await redis.xlen(keys.archive) == 0 and archived == recorded


async def test_archiver_resumes_after_files_written_but_not_confirmed(
    redis: Redis, redis_url: str, ns: str, keys: Keys, tmp_path: Path
) -> None:
    """The crash window: files renamed, records still in Redis. The restarted archiver confirms
    them from the files and writes nothing twice."""
    await make_namespace(redis, ns, archive_bytes=50_000_000)
    ids = [await _publish(redis, keys, i) for i in range(6)]
    await redis.xreadgroup(TRAINER_GROUP, "t", {keys.groups: ">"})
    queue = GroupQueue(redis, keys, "t")
    await queue.commit(ids[:4])
    settings = ArchiveSettings(namespace=ns, out=tmp_path / "arch", batch=100, flush_seconds=0.05)
    blocking = connect(redis_url, block_ms=1000)
    try:
        first = Archiver(redis, blocking, settings)
        (tmp_path / "arch").mkdir()
        stream = ArchiveStream(redis, keys)
        records = [ArchiveRecord.parse(e, f) for e, f in await stream.after("0-0", 100)]
        for tmp, final, _ in first._write(records, "0-0"):  # renamed, then killed before the confirm
            publish_part(tmp, final)
        (tmp_path / "arch" / "version=0" / "part_9-0_9-1.parquet.tmp").write_bytes(b"half a file")
        await queue.commit(ids[4:])
        await _archive_until(Archiver(redis, blocking, settings), redis, keys)
    finally:
        await blocking.aclose()
    table = read_table(tmp_path / "arch")
    assert table.column("entry_id").to_pylist() == [i.decode() for i in ids]
    assert len(set(table.column("archive_id").to_pylist())) == 6
    assert not list((tmp_path / "arch").rglob("*.tmp"))
    assert int(await redis.hget(keys.state, StateField.ARCHIVE_BYTES) or 0) == 0


async def test_schema_columns_and_arrays(redis: Redis, redis_url: str, ns: str, keys: Keys, tmp_path: Path) -> None:
    await make_namespace(redis, ns, archive_bytes=50_000_000)
    ids = []
    for i in range(2):
        group = full_group(n=2, index=i)
        assert group.samples[0].routed_experts is not None
        ids.append(await redis.xadd(keys.groups, group_fields(group)))
    await redis.xreadgroup(TRAINER_GROUP, "t", {keys.groups: ">"})
    await GroupQueue(redis, keys, "t").commit(ids)
    blocking = connect(redis_url, block_ms=1000)
    try:
        await _archive_until(
            Archiver(redis, blocking, ArchiveSettings(namespace=ns, out=tmp_path / "a", flush_seconds=0.05)), redis, keys
        )
    finally:
        await blocking.aclose()
    [path] = archive_files(tmp_path / "a")
    assert path.parent.name == "version=0" and file_schema_version(path) == SCHEMA_VERSION
    import pyarrow.parquet as pq

    assert pq.ParquetFile(path).metadata.row_group(0).column(0).compression == "ZSTD"
    rows = read_table(tmp_path / "a").to_pylist()
    assert [r["fate"] for r in rows] == ["trained", "trained"] and rows[0]["step"] == 1
    sample = rows[0]["samples"][0]
    assert sample["tokens"] and sample["loss_mask"] is not None and sample["weight_versions"]
    assert decode_group(rows[0]["data"]).samples[0].routed_experts is None  # dropped without --keep-arrays
    assert written_cursor(tmp_path / "a") == rows[-1]["archive_id"]


def test_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        ArchiveSettings(namespace="x", out=tmp_path, partition="day")
    with pytest.raises(ConfigError):
        ArchiveSettings(namespace="x", out=tmp_path, batch=0)
    with pytest.raises(ConfigError):
        ArchiveSettings(namespace="x", out=tmp_path, lease_seconds=0.5)
    with pytest.raises(ConfigError):
        ArchiveSettings(namespace="x", out=tmp_path, wait_seconds=-1)
    with pytest.raises(ConfigError):
        PipelineConfig(n_samples_per_prompt=1, batch_size=1, archive_bytes=-1)


async def test_archiver_refuses_a_namespace_without_archive(
    redis: Redis, redis_url: str, ns: str, tmp_path: Path
) -> None:
    await make_namespace(redis, ns)
    blocking = connect(redis_url, block_ms=1000)
    try:
        with pytest.raises(ConfigError, match="archive-bytes"):
            await Archiver(redis, blocking, ArchiveSettings(namespace=ns, out=tmp_path)).run()
    finally:
        await blocking.aclose()


async def test_pipeline_archive_exactly_once_across_sigkill(
    redis: Redis, redis_url: str, ns: str, keys: Keys, sim, procs: ProcessPool, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A real pipeline (producer process, simulator, trainer with a keep filter) and a real
    archiver process SIGKILLed while it works: every fate is in the files exactly once, and the
    trained records are the committed batches, in order."""
    caplog.set_level(logging.INFO)
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4, archive_bytes=200_000_000)
    await add_prompts(redis, ns, 48)
    procs.producer(redis_url, ns, sim.url)
    out = tmp_path / "archive"
    archiver_args = ["archive", "--redis", redis_url, "--ns", ns, "--out", str(out), "--batch", "3",
                     "--flush-seconds", "0.05", "--partition", "version", "--lease-seconds", "2", "--wait", "30"]
    archiver = procs.start(*archiver_args, log_name="archiver")
    batches: list[list[int]] = []
    killed = False
    async with await GroupConsumer.connect(redis_url, ns, "trainer-x", keep=lambda g: g.index % 5 != 0) as consumer:
        async with asyncio.timeout(120):
            fed = 48
            while sum(map(len, batches)) < 32 or not killed:
                batch = await consumer.take(4)
                batches.append([g.index for g in batch.groups])
                await consumer.commit(batch)
                await consumer.set_weight_version(len(batches) // 3)
                if not killed:  # the archiver may start slowly: the run goes on until it was killed
                    await add_prompts(redis, ns, 5, start=fed)
                    fed += 5
                if not killed and len(archive_files(out)) >= 3:
                    os.kill(archiver.pid, signal.SIGKILL)
                    archiver.wait()
                    killed = True
                    archiver = procs.start(*archiver_args, log_name="archiver")
    assert killed, procs.logs()
    await wait_until(lambda: _settled(redis, keys), message="every fate archived", timeout=90)
    table = read_table(out)
    rows = table.to_pylist()
    archive_ids = [r["archive_id"] for r in rows]
    assert len(archive_ids) == len(set(archive_ids)) == int(await redis.hget(keys.state, StateField.ARCHIVE_RECORDED))
    assert int(await redis.hget(keys.state, StateField.ARCHIVE_DROPPED) or 0) == 0
    trained: dict[int, list[tuple[int, int]]] = {}
    for r in rows:
        if r["fate"] == "trained":
            assert r["actor"] == "trainer-x"
            trained.setdefault(r["step"], []).append((r["position"], r["index"]))
    assert [[i for _, i in sorted(v)] for _, v in sorted(trained.items())] == batches
    filtered = {r["index"] for r in rows if r["fate"] == "filtered"}
    assert filtered and all(i % 5 == 0 for i in filtered)
    assert {p.parent.name for p in archive_files(out)} >= {"version=0", "version=1"}


async def _settled(redis: Redis, keys: Keys) -> bool:
    recorded = int(await redis.hget(keys.state, StateField.ARCHIVE_RECORDED) or 0)
    archived = int(await redis.hget(keys.state, StateField.ARCHIVED) or 0)
    return recorded > 0 and archived == recorded and await redis.xlen(keys.archive) == 0


def test_a_file_of_an_older_schema_stays_readable(tmp_path: Path) -> None:
    """A later schema version only adds columns: a file without one (as an older rollstream wrote
    it) reads with nulls there; a file of an unknown newer version is refused by name."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from rollstream.common.archive_schema import arrow_schema, part_name, record_row

    group = full_group(n=2, index=3)
    fields = {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in group_fields(group).items()}
    row = record_row(ArchiveRecord.parse(b"5-0", {b"fate": b"trained", b"kind": b"groups", b"step": b"1", **fields}))
    full = pa.Table.from_pylist([row], schema=arrow_schema())
    older = full.drop_columns(["decode_error", "arrays_kept"])  # as if added by a later version
    folder = tmp_path / "version=0"
    folder.mkdir()
    pq.write_table(older.replace_schema_metadata(full.schema.metadata), folder / part_name("5-0", "5-0"))
    [read] = read_table(tmp_path).to_pylist()
    assert read["decode_error"] is None and read["arrays_kept"] is None
    assert read["index"] == 3 and decode_group(read["data"]).index == 3

    newer = full.replace_schema_metadata({b"rollstream.archive": b'{"schema_version": 99}'})
    pq.write_table(newer, folder / part_name("6-0", "6-0"))
    with pytest.raises(ConfigError, match="newer"):
        read_table(tmp_path)


async def _holder(redis: Redis, keys: Keys) -> str:
    raw = await redis.get(keys.archiver_lease)
    return "" if raw is None else raw.decode()


async def test_one_archiver_per_namespace(redis: Redis, redis_url: str, ns: str, keys: Keys, tmp_path: Path) -> None:
    """A second archiver on a namespace is refused while the first runs, and starts once it stopped."""
    await make_namespace(redis, ns, archive_bytes=1_000_000)
    blocking = connect(redis_url, block_ms=1000)
    first = Archiver(redis, blocking, ArchiveSettings(namespace=ns, out=tmp_path / "a", lease_seconds=2))
    task = asyncio.create_task(first.run())
    try:
        await wait_until(lambda: _holder_is(redis, keys, first.lease.token), message="the first archiver's lease")
        second = Archiver(redis, blocking, ArchiveSettings(namespace=ns, out=tmp_path / "b", lease_seconds=2))
        with pytest.raises(ConfigError, match="another archiver holds"):
            await second.run()
        assert await _holder(redis, keys) == first.lease.token
    finally:
        first.stop()
        await task
        await blocking.aclose()
    assert await redis.get(keys.archiver_lease) is None  # released on stop, not left to lapse


async def _holder_is(redis: Redis, keys: Keys, token: str) -> bool:
    return await _holder(redis, keys) == token


async def test_a_killed_archivers_lease_lapses(
    redis: Redis, redis_url: str, ns: str, keys: Keys, procs: ProcessPool, tmp_path: Path
) -> None:
    """Real processes: a second `rollstream archive` exits refused; after a SIGKILL of the first,
    its lease lapses and a new one (with --wait) takes the namespace."""
    await make_namespace(redis, ns, archive_bytes=1_000_000)
    args = ["archive", "--redis", redis_url, "--ns", ns, "--out", str(tmp_path / "out"), "--lease-seconds", "2"]
    first = procs.start(*args, log_name="archiver")
    await wait_until(lambda: _held_by(redis, keys, first.pid), message="the first archiver's lease", timeout=60)
    refused = procs.start(*args, log_name="refused")
    code = await asyncio.wait_for(asyncio.to_thread(refused.wait), 60)
    assert code != 0 and "another archiver holds" in procs.log_of(refused), procs.logs()
    assert await _held_by(redis, keys, first.pid)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    assert await _held_by(redis, keys, first.pid)  # a killed holder's lease stays until it lapses
    later = procs.start(*args, "--wait", "30", log_name="later")
    await wait_until(lambda: _held_by(redis, keys, later.pid), message="the lapsed lease taken over", timeout=60)
    assert later.poll() is None, procs.logs()


async def _held_by(redis: Redis, keys: Keys, pid: int) -> bool:
    return f" pid {pid} " in await _holder(redis, keys)


async def _commit(redis: Redis, keys: Keys, count: int, start: int = 0, **kwargs: int) -> list[bytes]:
    """Publish ``count`` groups and commit them in one step (each an archive record)."""
    ids = [await _publish(redis, keys, start + i, **kwargs) for i in range(count)]
    await redis.xreadgroup(TRAINER_GROUP, "t", {keys.groups: ">"})
    assert await GroupQueue(redis, keys, "t").commit(ids) == count
    return ids


async def _exit_code(child: subprocess.Popen[bytes]) -> int:
    return await asyncio.wait_for(asyncio.to_thread(child.wait), 60)


async def test_an_archive_folder_belongs_to_one_namespace(
    redis: Redis, redis_url: str, ns: str, keys: Keys, procs: ProcessPool, tmp_path: Path
) -> None:
    """Issue 49 finding 1: a second namespace's archiver given the first one's folder is refused,
    naming the owner, and deletes nothing from Redis (it had written 1 row, deleted 8, said 8)."""
    other = Keys(f"{ns}-b")
    for k in (keys, other):
        await make_namespace(redis, k.namespace, archive_bytes=50_000_000)
    await _commit(redis, other, 8)  # older ids than the first namespace's
    await _commit(redis, keys, 8)
    out = tmp_path / "shared"
    args = ["archive", "--redis", redis_url, "--out", str(out), "--flush-seconds", "0.05"]
    first = procs.start(*args, "--ns", ns, log_name="first")
    await wait_until(lambda: _settled(redis, keys), message="the first namespace archived", timeout=60)
    first.send_signal(signal.SIGTERM)
    assert await _exit_code(first) == 0, procs.logs()
    second = procs.start(*args, "--ns", other.namespace, log_name="second")
    assert await _exit_code(second) == 2, procs.logs()
    assert f"is the archive folder of namespace {ns!r}, not {other.namespace!r}" in procs.log_of(second)
    assert "Traceback" not in procs.log_of(second)
    assert await redis.xlen(other.archive) == 8 and await redis.hget(other.state, StateField.ARCHIVED) is None
    assert read_table(out).num_rows == 8

    # its own folder works; files of two namespaces in one folder are refused by the readers
    own = tmp_path / "own"
    third = procs.start(*args[:-4], "--out", str(own), "--flush-seconds", "0.05", "--ns", other.namespace,
                        log_name="third")
    await wait_until(lambda: _settled(redis, other), message="the second namespace archived", timeout=60)
    third.send_signal(signal.SIGTERM)
    assert await _exit_code(third) == 0, procs.logs()
    [stray] = archive_files(own)
    (out / stray.parent.name / stray.name).write_bytes(stray.read_bytes())
    with pytest.raises(ConfigError, match="several namespaces"):
        read_table(out)


async def test_the_confirming_script_checks_the_lease(redis: Redis, ns: str, keys: Keys) -> None:
    """Issue 49 finding 2: ARCHIVED deletes nothing for an archiver whose lease another holds."""
    await make_namespace(redis, ns, archive_bytes=50_000_000)
    await _commit(redis, keys, 3)
    stream = ArchiveStream(redis, keys)
    pairs = [(eid, ArchiveRecord.parse(eid, f).record_bytes) for eid, f in await stream.after("0-0", 10)]
    await redis.set(keys.archiver_lease, "host pid 2 successor", px=10_000)
    assert await stream.confirm(pairs, "9-9", 1, "host pid 1 stalled") is False
    assert await redis.xlen(keys.archive) == 3 and await redis.hget(keys.state, StateField.ARCHIVE_CURSOR) is None
    assert await stream.confirm(pairs, "9-9", 1, "host pid 2 successor") is True
    assert await redis.xlen(keys.archive) == 0


async def test_an_archiver_stalled_past_its_lease_writes_nothing_twice(
    redis: Redis, redis_url: str, ns: str, keys: Keys, procs: ProcessPool, tmp_path: Path
) -> None:
    """Issue 49 finding 2, with real processes and signals: archiver A reads 10 records and is
    SIGSTOPped before its flush; B (--wait) takes the lapsed lease and archives them (files of 3); A, resumed
    with its flush due, checks the lease before its rename and stops without writing. Before the
    fix A wrote its 10 again: 20 rows for 10 ids."""
    await make_namespace(redis, ns, archive_bytes=50_000_000)
    out = tmp_path / "arch"
    args = ["archive", "--redis", redis_url, "--ns", ns, "--out", str(out), "--lease-seconds", "2",
            "--log-level", "DEBUG"]
    flush = 12.0
    stalled = procs.start(*args, "--flush-seconds", str(flush), "--batch", "1000", log_name="stalled")
    await wait_until(lambda: _held_by(redis, keys, stalled.pid), message="A's lease", timeout=60)
    await _commit(redis, keys, 10)
    await wait_until(lambda: "10 buffered" in procs.log_of(stalled), message="A holding 10 records", timeout=60)
    read_at = asyncio.get_running_loop().time()
    os.kill(stalled.pid, signal.SIGSTOP)
    try:
        assert archive_files(out) == [], "A flushed before it was stopped: the stall was not reproduced"
        procs.start(*args, "--flush-seconds", "0.05", "--batch", "3", "--wait", "60", log_name="successor")
        await wait_until(lambda: _settled(redis, keys), message="B archived the 10 records", timeout=90)
        await wait_until(lambda: asyncio.get_running_loop().time() - read_at > flush + 1,
                         message="A's flush due", timeout=flush + 5)
    finally:
        os.kill(stalled.pid, signal.SIGCONT)
    assert await _exit_code(stalled) == 2, procs.logs()
    assert "its lease lapsed and another archiver took the namespace" in procs.log_of(stalled)
    ids = read_table(out, ["archive_id"]).column("archive_id").to_pylist()
    assert len(ids) == len(set(ids)) == 10
    assert len(archive_files(out)) == 4  # B's files of 3, 3, 3 and 1 (A's one file of 10 would overlap them)
    assert not list(out.rglob("*.tmp"))


@pytest.fixture
def small_mount(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """A tmpfs mounted for the test (``size``, ``ro``): a real full disk or read-only folder.
    Needs root (the CI runs as root); skipped otherwise."""
    mounted: list[Path] = []

    def mount(name: str, options: str) -> Path:
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("mounting a small tmpfs (a real full or read-only disk) needs root")
        point = tmp_path / name
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
                              capture_output=True, text=True, check=False, timeout=30)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False, timeout=30)


async def test_archiver_errors_name_the_fix(
    redis: Redis, redis_url: str, ns: str, keys: Keys, procs: ProcessPool, tmp_path: Path,
    small_mount: Callable[..., Path],
) -> None:
    """Issue 49 finding 16: an --out that is a file, a read-only --out and a full disk each stop
    the archiver with one line naming the path and the fix (no traceback), nothing confirmed in
    Redis and no half-written file left."""
    await make_namespace(redis, ns, archive_bytes=200_000_000)
    args = ["archive", "--redis", redis_url, "--ns", ns, "--flush-seconds", "0.05"]

    async def refused(out: Path, *said: str) -> None:
        child = procs.start(*args, "--out", str(out), log_name="archiver")
        assert await _exit_code(child) == 2, procs.logs()
        log = procs.log_of(child)
        assert "Traceback" not in log and all(s in log for s in said), log

    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    await refused(a_file, f"--out {a_file}", "is a file, not a folder")
    await refused(a_file / "sub", f"{a_file} is a file, not a folder")
    read_only = small_mount("ro", "ro,size=1m")
    await refused(read_only, f"--out {read_only}", "read-only")

    full = small_mount("full", "size=256k")
    group = full_group(n=2, index=0)  # 200 kB of random text a sample: its file is more than the disk
    group = replace(group, samples=[replace(s, response=base64.b64encode(os.urandom(150_000)).decode())
                                    for s in group.samples])
    entry = await redis.xadd(keys.groups, group_fields(group))
    await redis.xreadgroup(TRAINER_GROUP, "t", {keys.groups: ">"})
    assert await GroupQueue(redis, keys, "t").commit([entry]) == 1
    await refused(full, str(full / "version=0"), "disk", "is full", "free space")
    assert await redis.xlen(keys.archive) == 1 and not list(full.rglob("*.tmp"))


def _documented_line(word: str) -> str:
    """The one-liner of docs/operations.md that uses ``word`` (the test runs what the docs say)."""
    docs = Path(__file__).resolve().parent.parent / "docs" / "operations.md"
    [line] = [line for line in docs.read_text().splitlines() if line.startswith(("import", "from")) and word in line]
    return line


@pytest.mark.parametrize(("package", "word", "check"), [
    ("duckdb", "duckdb.sql", ""),
    ("datasets", "load_dataset", "print('rows', ds.num_rows, sorted(set(ds['fate'])), ds[0]['samples'][0]['tokens'][:2])"),
])
async def test_the_documented_readers_read_an_archive(
    redis: Redis, redis_url: str, ns: str, keys: Keys, tmp_path: Path, package: str, word: str, check: str
) -> None:
    """The DuckDB and HF datasets one-liners of docs/operations.md, run as written (the folder
    replaced) in a real process on a real archive: fates counted, rows loaded. Skipped when the
    package is not installed (neither is a dependency of rollstream; duckdb is in the dev extra)."""
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (pip install {package})")
    await make_namespace(redis, ns, archive_bytes=50_000_000)
    await _commit(redis, keys, 3)
    ids = [await _publish(redis, keys, 10 + i) for i in range(2)]
    await redis.xreadgroup(TRAINER_GROUP, "t", {keys.groups: ">"})
    for entry in ids:
        assert await GroupQueue(redis, keys, "t").drop_filtered(entry, "zero_std") == 1
    out = tmp_path / "archive"
    blocking = connect(redis_url, block_ms=1000)
    try:
        await _archive_until(Archiver(redis, blocking, ArchiveSettings(namespace=ns, out=out, flush_seconds=0.05)),
                             redis, keys)
    finally:
        await blocking.aclose()
    (out / "index.html").write_text("a page beside the files")  # what `archive view` leaves there
    code = _documented_line(word).replace("/data/archive/NAME", str(out)) + "\n" + check
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", code], capture_output=True, text=True,
                                   check=False, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    if package == "duckdb":
        lines = [line for line in done.stdout.splitlines() if "filtered" in line or "trained" in line]
        assert len(lines) == 2 and " 2 " in lines[0] and " 3 " in lines[1], done.stdout
    else:
        assert "rows 5 ['filtered', 'trained']" in done.stdout, done.stdout + done.stderr
