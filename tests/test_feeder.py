"""The feeder: window, global indexes, epochs, and exact resume from the cursor in Redis."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from conftest import make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common.codec import decode_prompt_entry
from rollstream.common.datasets import open_dataset
from rollstream.common.errors import ConfigError
from rollstream.common.keys import Keys
from rollstream.producer.feeder import Feeder, FeedSettings, load_jsonl


def write_dataset(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "label": str(i), "src": "t"}) + "\n" for i in range(count)))
    return path


async def drain(redis: Redis, keys: Keys) -> list[tuple[int, int, str]]:
    """Read and delete everything queued: (index, epoch, prompt)."""
    rows = await redis.xrange(keys.prompts)
    if rows:
        await redis.xdel(keys.prompts, *[r[0] for r in rows])
    out = []
    for _, fields in rows:
        prompt = decode_prompt_entry(fields)
        out.append((prompt.index, prompt.epoch, str(prompt.prompt)))
    return out


async def test_window_epochs_and_exact_resume(redis: Redis, ns: str, tmp_path: Path) -> None:
    keys = Keys(ns)
    await make_namespace(redis, ns)
    records = load_jsonl(write_dataset(tmp_path / "d.jsonl", 5))
    settings = FeedSettings(namespace=ns, epochs=2, shuffle=True, seed=3, window=3, poll_interval=0.02)
    seen: list[tuple[int, int, str]] = []

    feeder = Feeder(redis, records, settings)
    task = asyncio.create_task(feeder.run())
    await wait_until(lambda: _xlen_at_least(redis, keys.prompts, 3), message="the window filled")
    await asyncio.sleep(0.3)  # ~15 more polls on an idle machine: it stays full, never more
    assert await redis.xlen(keys.prompts) == 3  # the window holds
    feeder.stop()
    await task
    seen += await drain(redis, keys)

    restarted = Feeder(redis, records, settings)  # a new process would do the same
    task = asyncio.create_task(restarted.run())
    while not task.done():
        seen += await drain(redis, keys)
        await asyncio.sleep(0.02)
    seen += await drain(redis, keys)

    assert [s[0] for s in seen] == list(range(10))  # global, increasing, no gap, no repeat
    assert [s[1] for s in seen] == [0] * 5 + [1] * 5
    first, second = [s[2] for s in seen[:5]], [s[2] for s in seen[5:]]
    assert sorted(first) == sorted(second) == [f"q{i}" for i in range(5)]
    state = await redis.hgetall(keys.state)
    assert int(state[b"fed"]) == 10 and int(state[b"feed_next_index"]) == 10


async def test_a_different_dataset_is_refused(redis: Redis, ns: str, tmp_path: Path) -> None:
    await make_namespace(redis, ns)
    await Feeder(redis, load_jsonl(write_dataset(tmp_path / "a.jsonl", 2)), FeedSettings(namespace=ns)).run()
    other = load_jsonl(write_dataset(tmp_path / "b.jsonl", 3))
    with pytest.raises(ConfigError, match="another dataset"):
        await Feeder(redis, other, FeedSettings(namespace=ns)).run()


def test_bad_dataset_lines_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": 5}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2"):
        load_jsonl(path)
    path.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(ConfigError, match=r":2: not JSON"):
        load_jsonl(path)
    with pytest.raises(ConfigError):
        FeedSettings(namespace="x", window=0)


async def _xlen_at_least(redis: Redis, key: str, count: int) -> bool:
    return await redis.xlen(key) >= count


async def test_a_namespace_fed_before_streaming_resumes_in_its_order(redis: Redis, ns: str, tmp_path: Path) -> None:
    """Builds before streaming wrote a digest of every record as the dataset id: such a namespace
    resumes where it stood, in the same order; another dataset is still refused."""
    import hashlib
    import random

    keys = Keys(ns)
    await make_namespace(redis, ns)
    path = write_dataset(tmp_path / "d.jsonl", 6)
    digest = hashlib.sha1(usedforsecurity=False)
    for i in range(6):
        digest.update(json.dumps([f"q{i}", str(i)], sort_keys=True).encode())
    await redis.hset(keys.state, mapping={
        "feed_dataset": f"{digest.hexdigest()[:12]}:6:s3", "feed_next_index": 2, "feed_epoch": 0, "feed_position": 2,
    })
    settings = FeedSettings(namespace=ns, epochs=1, shuffle=True, seed=3, window=100)
    with pytest.raises(ConfigError, match="another dataset"):
        await Feeder(redis, open_dataset(write_dataset(tmp_path / "e.jsonl", 7)), settings).run()
    feeder = Feeder(redis, open_dataset(path), settings)  # streamed: its own id is no digest of records
    assert feeder.dataset != f"{digest.hexdigest()[:12]}:6:s3"
    assert await feeder.run() == 4
    order = list(range(6))
    random.Random("3:0").shuffle(order)  # the earlier build's permutation
    assert [s[2] for s in await drain(redis, keys)] == [f"q{i}" for i in order[2:]]
    assert (await redis.hget(keys.state, "feed_dataset")).decode() == feeder.dataset  # rewritten
