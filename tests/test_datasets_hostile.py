"""Datasets that change, or hold what msgpack cannot carry, under a running feeder (issue 49:
findings 7, 8, 10, 11 and 18): a truncated or deleted file stops the feed naming it, Parquet
dates and decimals are fed as plain values, every row obeys the 16 MiB cap, a very long line is
one dead letter, and a full permutation never loads the dataset."""

from __future__ import annotations

import asyncio
import datetime
import decimal
import json
import os
import random
import tracemalloc
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ProcessPool, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common.codec import decode_prompt_entry
from rollstream.common.datasets import open_dataset
from rollstream.common.errors import ConfigError
from rollstream.common.keys import Keys
from rollstream.common.shards import MAX_LINE_BYTES
from rollstream.common.walks import EpochWalk, Order
from rollstream.producer.feeder import Feeder, FeedSettings

PAD = "x" * 2000
"""Rows of ~2 KB: more than the reader's 8 KiB buffer holds, so a change to the file is seen."""


def _jsonl(path: Path, rows: int, pad: str = "") -> Path:
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "label": str(i), "pad": pad}) + "\n" for i in range(rows)))
    return path


async def _fed(redis: Redis, keys: Keys) -> list[Any]:
    return [decode_prompt_entry(f) for _, f in await redis.xrange(keys.prompts)]


async def _dead(redis: Redis, keys: Keys) -> list[dict[str, str]]:
    return [{k.decode(): v.decode(errors="replace") for k, v in f.items()} for _, f in await redis.xrange(keys.dead)]


async def _exit_code(child: Any) -> int:
    return int(await asyncio.to_thread(child.wait, 120))


async def test_a_jsonl_truncated_while_fed_stops_the_feed_naming_the_file(
    redis: Redis, redis_url: str, ns: str, tmp_path: Path, procs: ProcessPool
) -> None:
    """Finding 7: a 40-row file cut to 10 in place while `rollstream feed --window 5` waits: the
    feed fails (exit 2) naming the file and the row it ended before, not exit 0 with the epoch
    counted complete."""
    keys = Keys(ns)
    await make_namespace(redis, ns)
    data = _jsonl(tmp_path / "d.jsonl", 40, PAD)
    feeder = procs.start("feed", "--redis", redis_url, "--ns", ns, str(data), "--window", "5")
    await wait_until(lambda: _xlen(redis, keys.prompts, 5), message="the window filled\n" + procs.logs())
    lines = data.read_bytes().splitlines(keepends=True)
    os.truncate(data, sum(len(line) for line in lines[:10]))  # in place, as a writer truncating it would
    while feeder.poll() is None:  # keep the window open so the feeder reads on
        await redis.xtrim(keys.prompts, maxlen=0)
        await asyncio.sleep(0.05)
    log = procs.log_of(feeder)
    assert feeder.returncode == 2, log
    assert f"{data}: the dataset file changed while it was fed (it ends before row 11" in log, log
    assert "Traceback" not in log
    assert await redis.hget(keys.state, "feed_epoch") in (None, b"0")  # the epoch is not counted complete


async def test_a_parquet_file_deleted_while_fed_is_a_clear_error(
    redis: Redis, redis_url: str, ns: str, tmp_path: Path, procs: ProcessPool
) -> None:
    """Finding 7: a Parquet file deleted mid-feed: an error naming it and what to do, no raw
    FileNotFoundError traceback."""
    keys = Keys(ns)
    await make_namespace(redis, ns)
    data = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": [f"q{i}" for i in range(40)]}), data, row_group_size=8)
    feeder = procs.start("feed", "--redis", redis_url, "--ns", ns, str(data), "--window", "5")
    await wait_until(lambda: _xlen(redis, keys.prompts, 5), message="the window filled\n" + procs.logs())
    data.unlink()
    while feeder.poll() is None:
        await redis.xtrim(keys.prompts, maxlen=0)
        await asyncio.sleep(0.05)
    log = procs.log_of(feeder)
    assert feeder.returncode == 2, log
    assert f"{data}: the dataset file cannot be read any more" in log and "deleted or replaced" in log, log
    assert "Traceback" not in log


def _typed_table(rows: range, big: int | None = None) -> pa.Table:
    """Columns msgpack cannot carry as Python gives them: timestamps (with a zone, and in ns),
    dates, times, durations, decimals, and a date inside a list of structs."""
    base = datetime.datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=datetime.UTC)
    return pa.table({
        "prompt": [f"q{i}" if i != big else "y" * (MAX_LINE_BYTES + 4096) for i in rows],
        "label": [str(i) for i in rows],
        "at": pa.array([base + datetime.timedelta(days=i) for i in rows], pa.timestamp("us", tz="UTC")),
        "at_ns": pa.array([1_700_000_000_000_000_001 + i for i in rows], pa.timestamp("ns")),
        "day": pa.array([datetime.date(2024, 1, 1) + datetime.timedelta(days=i) for i in rows], pa.date32()),
        "clock": pa.array([datetime.time(12, 30, i % 60) for i in rows], pa.time64("us")),
        "took": pa.array([datetime.timedelta(seconds=i, milliseconds=500) for i in rows], pa.duration("ms")),
        "price": pa.array([decimal.Decimal(f"{i}.25") for i in rows], pa.decimal128(10, 2)),
        "events": [[{"on": datetime.date(2020, 1, 1 + i % 28)}] for i in rows],
    })


async def test_parquet_dates_and_decimals_in_a_later_shard_are_fed_as_plain_values(
    redis: Redis, redis_url: str, ns: str, tmp_path: Path, procs: ProcessPool
) -> None:
    """Finding 8, real processes: a folder whose second shard, a pyarrow-written Parquet file,
    has timestamp, date, time, duration and decimal columns: every row is fed (ISO 8601 text,
    seconds, exact decimal text), where the feeder crashed with a traceback on every restart."""
    keys = Keys(ns)
    await make_namespace(redis, ns)
    folder = tmp_path / "shards"
    folder.mkdir()
    _jsonl(folder / "a-0.jsonl", 5)
    pq.write_table(_typed_table(range(5, 25)), folder / "a-1.parquet", row_group_size=6)
    feeder = procs.start("feed", "--redis", redis_url, "--ns", ns, str(folder), "--shuffle", "--window", "100")
    assert await _exit_code(feeder) == 0, procs.logs()
    fed = {p.metadata["dataset_index"]: p for p in await _fed(redis, keys)}
    assert sorted(fed) == list(range(25)) and await _dead(redis, keys) == []
    meta = fed[7].metadata
    assert meta["at"] == "2024-05-13T07:08:09.123456+00:00"
    assert meta["at_ns"] == "2023-11-14T22:13:20"  # nanoseconds cut to the microsecond
    assert meta["day"] == "2024-01-08" and meta["clock"] == "12:30:07"
    assert meta["took"] == 7.5 and meta["price"] == "7.25"
    assert meta["events"] == [{"on": "2020-01-08"}]


async def test_the_start_check_encodes_and_a_later_unencodable_row_is_a_dead_letter(
    redis: Redis, redis_url: str, ns: str, tmp_path: Path, procs: ProcessPool
) -> None:
    """Finding 8: the start-up check encodes the first rows, not only parses them (an integer
    msgpack cannot carry is a ConfigError naming file and row, before anything is fed); the same
    row later in the file is a dead letter with the reason, and the epoch goes on."""
    keys = Keys(ns)
    await make_namespace(redis, ns)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "q0", "n": 2**70}) + "\n" + json.dumps({"prompt": "q1"}) + "\n")
    child = procs.start("feed", "--redis", redis_url, "--ns", ns, str(bad), log_name="bad")
    assert await _exit_code(child) == 2, procs.logs()
    log = procs.log_of(child)
    assert f"{bad}:1: cannot be encoded for the prompt stream" in log and "Traceback" not in log, log
    assert await redis.xlen(keys.prompts) == 0

    later = tmp_path / "later.jsonl"
    rows = [{"prompt": f"q{i}", **({"n": 2**70} if i == 12 else {})} for i in range(15)]
    later.write_text("".join(json.dumps(r) + "\n" for r in rows))
    await make_namespace(redis, ns + "b")
    child = procs.start("feed", "--redis", redis_url, "--ns", ns + "b", str(later), log_name="later")
    assert await _exit_code(child) == 0, procs.logs()
    b = Keys(ns + "b")
    assert [p.metadata["dataset_index"] for p in await _fed(redis, b)] == [i for i in range(15) if i != 12]
    dead = await _dead(redis, b)
    assert len(dead) == 1 and dead[0]["reason"].startswith(f"{later}:13: cannot be encoded"), dead


async def test_a_parquet_row_over_the_row_cap_is_a_dead_letter(redis: Redis, ns: str, tmp_path: Path) -> None:
    """Finding 10: the 16 MiB cap on a JSONL line holds for a Parquet row too: a prompt over it
    is a dead letter naming the file and row, not a prompt no producer can read back."""
    keys = Keys(ns)
    await make_namespace(redis, ns)
    data = tmp_path / "big.parquet"
    pq.write_table(pa.table({"prompt": [f"q{i}" if i != 10 else "y" * (MAX_LINE_BYTES + 4096) for i in range(13)]}),
                   data, row_group_size=5)
    assert await Feeder(redis, open_dataset(data), FeedSettings(namespace=ns, window=100)).run() == 12
    assert [p.metadata["dataset_index"] for p in await _fed(redis, keys)] == [i for i in range(13) if i != 10]
    dead = await _dead(redis, keys)
    assert len(dead) == 1 and dead[0]["reason"].startswith(f"{data} row 10: the row is "), dead
    assert f"over the {MAX_LINE_BYTES}-byte cap" in dead[0]["reason"]


async def test_a_line_over_17_mib_is_one_dead_letter_and_later_rows_keep_their_numbers(
    redis: Redis, ns: str, tmp_path: Path
) -> None:
    """Finding 11: a 20 MiB line (longer than the cap plus a scan unit) is one row: one dead
    letter, and every later row keeps its dataset_index (and file line in errors)."""
    keys = Keys(ns)
    await make_namespace(redis, ns)
    data = tmp_path / "long.jsonl"
    lines = [json.dumps({"prompt": f"q{i}", "label": str(i)}) + "\n" for i in range(16)]
    lines[10] = json.dumps({"prompt": "z" * (20 * 1024 * 1024)}) + "\n"
    lines[14] = "{not json\n"
    data.write_text("".join(lines))
    dataset = open_dataset(data)
    assert dataset.rows == 16
    assert await Feeder(redis, dataset, FeedSettings(namespace=ns, window=100)).run() == 14
    fed = await _fed(redis, keys)
    assert [(p.metadata["dataset_index"], p.prompt) for p in fed] == [
        (i, f"q{i}") for i in range(16) if i not in (10, 14)
    ]
    reasons = [d["reason"] for d in await _dead(redis, keys)]
    assert len(reasons) == 2, reasons
    assert reasons[0] == f"{data}:11: line longer than {MAX_LINE_BYTES} bytes"
    assert reasons[1].startswith(f"{data}:15: not JSON")


@pytest.mark.parametrize("order", [Order(shuffle=True, seed=4, scheme="slime"),
                                   Order(shuffle=True, seed=4, buffer=100_000)])
def test_a_full_permutation_reads_rows_a_block_at_a_time(tmp_path: Path, order: Order) -> None:
    """Finding 18: slime's scheme, and a --shuffle-buffer at least the row count, used to load
    every row at the start of an epoch (54 MiB traced for 200k rows, bench/shuffle_memory.py).
    Now the order is the same permutation (slime's: random.seed(seed + epoch), resumed exactly),
    and the walk holds the permutation and a block of rows: under 4 MiB for 100k rows of ~100
    bytes (the old walk traced ~30 MiB)."""
    data = tmp_path / "d.jsonl"
    with open(data, "w") as handle:
        for i in range(100_000):
            handle.write(json.dumps({"prompt": f"q{i}", "pad": PAD[:64]}) + "\n")
    dataset = open_dataset(data)
    ids = list(range(100_000))
    random.Random(4 + 1 if order.scheme == "slime" else "4:1").shuffle(ids)
    tracemalloc.start()
    try:
        walk = EpochWalk(dataset, order, 1, 50_000)
        got = [(position, rid, json.loads(raw)["prompt"]) for position, rid, raw in _first(walk, 3000)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == [(50_001 + k, rid, f"q{rid}") for k, rid in enumerate(ids[50_000:53_000])]
    assert peak < 4 * 2**20, f"{peak / 2**20:.1f} MiB traced"
    data.write_bytes(data.read_bytes()[: 1000 * len(data.read_bytes()) // 100_000])  # cut under the walk
    with pytest.raises(ConfigError, match="changed while it was fed"):
        for _ in EpochWalk(dataset, order, 1, 0):
            pass


def _first(walk: EpochWalk, count: int) -> list[tuple[int, int, Any]]:
    out = []
    for item in walk:
        out.append(item)
        if len(out) == count:
            break
    return out


async def _xlen(redis: Redis, key: str, count: int) -> bool:
    return bool(await redis.xlen(key) >= count)
