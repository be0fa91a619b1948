"""Streamed datasets: JSONL, Parquet, shards, slices, the buffered shuffle's exact resume, bad rows."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ProcessPool, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common import datasets
from rollstream.common import shards as shard_readers
from rollstream.common.codec import decode_prompt_entry
from rollstream.common.datasets import RowFormat, open_dataset
from rollstream.common.errors import ConfigError
from rollstream.common.keys import Keys
from rollstream.common.walks import EpochWalk, Order
from rollstream.producer.feeder import Feeder, FeedSettings


def write_parquet(path: Path, rows: range, row_group_size: int = 10) -> Path:
    table = pa.table({
        "prompt": [f"q{i}" for i in rows],
        "label": [str(i) for i in rows],
        "messages": [[{"role": "user", "content": f"m{i}"}] for i in rows],
    })
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def write_jsonl(path: Path, rows: range) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "label": str(i)}) + "\n" for i in rows))
    return path


@pytest.fixture
def small_units(monkeypatch: pytest.MonkeyPatch) -> None:
    """JSONL units of ~64 bytes (a few lines each): many units in a small file."""
    monkeypatch.setattr(shard_readers, "UNIT_BYTES", 64)


def shards(tmp_path: Path) -> Path:
    """A folder of 4 shards, 2 JSONL and 2 Parquet, rows q0..q99 in order across them."""
    folder = tmp_path / "shards"
    folder.mkdir()
    write_jsonl(folder / "a-0.jsonl", range(0, 23))
    write_parquet(folder / "a-1.parquet", range(23, 50), row_group_size=6)
    write_jsonl(folder / "a-2.jsonl", range(50, 81))
    write_parquet(folder / "a-3.parquet", range(81, 100), row_group_size=7)
    (folder / "notes.txt").write_text("not a shard")
    return folder


def prompts_of(dataset: datasets.Dataset, walk: EpochWalk) -> list[str]:
    out = []
    for _, rid, raw in walk:
        record = dataset.record(rid, raw)
        assert record is not None
        out.append(str(record.prompt))
    return out


def test_a_folder_a_glob_and_a_slice_read_every_shard_in_order(tmp_path: Path, small_units: None) -> None:
    folder = shards(tmp_path)
    whole = open_dataset(folder)
    assert whole.rows == 100 and len(whole.units) > 10  # many units: none of it was read whole
    assert prompts_of(whole, EpochWalk(whole, Order(), 0, 0)) == [f"q{i}" for i in range(100)]
    globbed = open_dataset(f"{folder}/a-[13].parquet")
    assert prompts_of(globbed, EpochWalk(globbed, Order(), 0, 0)) == [f"q{i}" for i in (*range(23, 50), *range(81, 100))]
    sliced = open_dataset(f"{folder}@[20:90]")
    walk = EpochWalk(sliced, Order(), 0, 0)
    assert prompts_of(sliced, walk) == [f"q{i}" for i in range(20, 90)]
    one = open_dataset(f"{folder / 'a-1.parquet'}@[-5:]", RowFormat(prompt_key="messages", label_key="label"))
    records = [one.record(rid, raw) for _, rid, raw in EpochWalk(one, Order(), 0, 0)]
    assert [r.prompt for r in records if r] == [[{"role": "user", "content": f"m{i}"}] for i in range(45, 50)]
    with pytest.raises(ConfigError, match="glob matches no file"):
        open_dataset(f"{folder}/*.csv")
    with pytest.raises(ConfigError, match="no records"):
        open_dataset(f"{folder}@[200:]")


@pytest.mark.parametrize("buffer", [1, 7, 1000])
def test_the_shuffle_resumes_exactly_at_any_position(tmp_path: Path, small_units: None, buffer: int) -> None:
    """Buffered (1, 7: smaller than the dataset) and full (1000) shuffles: an epoch is a permutation,
    seeded per epoch, and a walk started at position p gives exactly the rest of the epoch."""
    dataset = open_dataset(shards(tmp_path))
    order = Order(shuffle=True, seed=5, buffer=buffer)
    epochs = [prompts_of(dataset, EpochWalk(dataset, order, epoch, 0)) for epoch in range(2)]
    for epoch in epochs:
        assert sorted(epoch) == sorted(f"q{i}" for i in range(100))
        assert epoch != [f"q{i}" for i in range(100)]
    assert epochs[0] != epochs[1]
    assert prompts_of(dataset, EpochWalk(dataset, order, 0, 0)) == epochs[0]  # seeded: the same again
    for position in (1, 13, 50, 77, 99, 100):
        assert prompts_of(dataset, EpochWalk(dataset, order, 1, position)) == epochs[1][position:]


async def test_feeding_parquet_shards_resumes_exactly_after_a_stop(
    redis: Redis, ns: str, tmp_path: Path, small_units: None
) -> None:
    keys = Keys(ns)
    await make_namespace(redis, ns)
    dataset = open_dataset(shards(tmp_path))
    settings = FeedSettings(namespace=ns, epochs=2, shuffle=True, seed=3, window=9, poll_interval=0.02,
                            chunk=4, shuffle_buffer=7)
    expected = []
    for epoch in range(2):
        expected += prompts_of(dataset, EpochWalk(dataset, Order(True, 3, buffer=7), epoch, 0))
    seen: list[str] = []
    for stop_after in (9, 40, 120):  # stopped three times, at places inside units and epochs
        feeder = Feeder(redis, open_dataset(shards_path := tmp_path / "shards"), settings)
        task = asyncio.create_task(feeder.run())
        while len(seen) < stop_after and not task.done():
            seen += await drain(redis, keys)
            await asyncio.sleep(0.01)
        feeder.stop()
        await task
        seen += await drain(redis, keys)
    final = Feeder(redis, open_dataset(shards_path), settings)
    task = asyncio.create_task(final.run())
    while not task.done():
        seen += await drain(redis, keys)
        await asyncio.sleep(0.01)
    seen += await drain(redis, keys)
    assert seen == expected


async def drain(redis: Redis, keys: Keys) -> list[str]:
    rows = await redis.xrange(keys.prompts)
    if rows:
        await redis.xdel(keys.prompts, *[r[0] for r in rows])
    return [str(decode_prompt_entry(fields).prompt) for _, fields in rows]


async def test_a_bad_row_mid_file_is_a_dead_letter_and_the_epoch_goes_on(
    redis: Redis, ns: str, tmp_path: Path
) -> None:
    keys = Keys(ns)
    await make_namespace(redis, ns)
    path = write_jsonl(tmp_path / "d.jsonl", range(30))
    lines = path.read_text().splitlines()
    lines[20] = "{not json"
    lines[25] = json.dumps({"question": "no prompt key"})
    path.write_text("\n".join(lines) + "\n\n")
    fed = await Feeder(redis, open_dataset(path), FeedSettings(namespace=ns, window=100)).run()
    assert fed == 28
    dead = await redis.xrange(keys.dead)
    reasons = [fields[b"reason"].decode() for _, fields in dead]
    assert reasons[0].startswith(f"{path}:21: not JSON") and f"{path}:26: expected an object" in reasons[1]
    assert dead[0][1][b"row"] == b"{not json\n" and dead[0][1][b"source"] == b"feed"
    assert int(await redis.hget(keys.state, "dead_lettered")) == 2
    assert [str(decode_prompt_entry(f).prompt) for _, f in await redis.xrange(keys.prompts)] == [
        f"q{i}" for i in range(30) if i not in (20, 25)
    ]


async def test_the_feed_command_streams_parquet_and_refuses_a_bad_start(
    redis: Redis, redis_url: str, ns: str, tmp_path: Path, procs: ProcessPool
) -> None:
    """Real processes: `rollstream feed x.parquet` feeds every row; a dataset whose first rows lack
    the prompt key is a ConfigError naming file and row, before anything is fed."""
    keys = Keys(ns)
    await make_namespace(redis, ns)
    data = write_parquet(tmp_path / "d.parquet", range(40), row_group_size=8)
    feeder = procs.start("feed", "--redis", redis_url, "--ns", ns, str(data), "--shuffle", "--shuffle-buffer", "5")
    assert await asyncio.to_thread(feeder.wait, 60) == 0, procs.logs()
    fed = [decode_prompt_entry(f) for _, f in await redis.xrange(keys.prompts)]
    assert sorted(p.index for p in fed) == list(range(40))
    assert sorted(int(p.label) for p in fed) == list(range(40))
    assert [p.metadata["dataset_index"] for p in fed] == [int(p.label) for p in fed]
    await make_namespace(redis, ns + "x")
    bad = procs.start("feed", "--redis", redis_url, "--ns", ns + "x", str(data), "--prompt-key", "input",
                      log_name="bad")
    assert await asyncio.to_thread(bad.wait, 60) != 0
    await wait_until(lambda: "expected an object with a 'input' field" in procs.log_of(bad), message=procs.logs())
    assert f"{data} row 0" in procs.log_of(bad)
    assert await redis.xlen(Keys(ns + "x").prompts) == 0


def test_parquet_needs_pyarrow_only_when_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = write_parquet(tmp_path / "d.parquet", range(3))
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ConfigError, match=r"rollstream\[parquet\]"):
        open_dataset(data)
    assert open_dataset(write_jsonl(tmp_path / "d.jsonl", range(3))).rows == 3
