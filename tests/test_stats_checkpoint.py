"""The row statistics and the mix's carry travel with a checkpoint: slime's and miles' stand-in rollout
managers save and load them through rollstream's data source, against a real redis-server."""

from __future__ import annotations

import asyncio
import gzip
import importlib
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from conftest import make_namespace
from integration_helpers import miles_args, set_env, slime_args
from redis.asyncio import Redis
from rollstream.common.connection import Outage
from rollstream.common.errors import ConfigError
from rollstream.common.keys import Keys, SourceField
from rollstream.common.protocol.groups import GroupQueue
from rollstream.consumer.mixing import Mixer
from rollstream.integrations.stats_checkpoint import CHUNK, stats_path

WEIGHTS = {"a": 2.0, "b": 1.0}


async def _finish(redis: Redis, ns: str, items: list[tuple[str, float, float, int, int]]) -> None:
    """Groups finished for these rows (ROW_STATS, as after a commit), K = 2 kept."""
    await GroupQueue(redis, Keys(ns), "trainer").record_rows(2, items)


async def _commit(redis: Redis, ns: str, counts: dict[str, int]) -> None:
    for name, count in counts.items():
        await redis.hincrby(Keys(ns).sources, SourceField.of(name, "committed"), count)


async def _carry(redis: Redis, ns: str) -> dict[str, int]:
    """The next batch of 4's quotas (the carry shows in them)."""
    mixer = Mixer(redis, Keys(ns), WEIGHTS, Outage(logging.getLogger(__name__), "test"),
                  logging.LoggerAdapter(logging.getLogger(__name__), {}))
    return await mixer.quotas(4)


async def _rows(redis: Redis, ns: str) -> dict[bytes, bytes]:
    return await redis.hgetall(Keys(ns).rows)


def _manager(framework: str, **args: Any) -> Any:
    if framework == "slime":
        return importlib.import_module("slime.ray.rollout").RolloutManager(slime_args(**args))
    return importlib.import_module("miles.ray.rollout.rollout_manager").RolloutManager(miles_args(**args))


@pytest.mark.parametrize("framework", ["slime", "miles"])
async def test_a_restored_run_sees_the_statistics_of_its_checkpoint(
    redis: Redis, ns: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, framework: str
) -> None:
    keys = Keys(ns)
    await make_namespace(redis, ns, row_stats=2, mix="a=2,b=1")
    set_env(monkeypatch, redis_url, ns)
    rows = CHUNK * 2 + 7  # more than one HSCAN chunk and one restore chunk
    await _finish(redis, ns, [(f"a:{i}", 0.5, 0.25, 1, 0) for i in range(rows)])
    await _carry(redis, ns)  # the mix's baseline
    await _commit(redis, ns, {"a": 3, "b": 2})  # carry: a owes 1/3, b is ahead by 1/3
    at_k, carry_at_k = await _rows(redis, ns), await _carry(redis, ns)
    assert carry_at_k == {"a": 3, "b": 1}

    manager = await asyncio.to_thread(_manager, framework, save=str(tmp_path))
    await asyncio.to_thread(manager.save, 3)
    path = stats_path(tmp_path, 3)
    with gzip.open(path, "rt") as handle:
        header = json.loads(handle.readline())
        assert sum(1 for _ in handle) == rows
    assert header["rollout_id"] == 3 and header["mix"] == {"base_set": "a,b", "since": {"a": 3, "b": 2}}

    # training goes on past the checkpoint: statistics move, new rows appear, the carry changes
    await _finish(redis, ns, [("a:0", 1.0, 0.0, 5, 1), ("b:9", 0.0, 0.0, 5, 1)])
    await _commit(redis, ns, {"a": 2})
    assert await _rows(redis, ns) != at_k
    assert await _carry(redis, ns) != carry_at_k
    await asyncio.to_thread(manager.data_source.close)

    resumed = await asyncio.to_thread(_manager, framework, load=str(tmp_path))
    await asyncio.to_thread(resumed.load, 3)
    assert await _rows(redis, ns) == at_k
    assert await _carry(redis, ns) == carry_at_k
    assert not await redis.exists(keys.rows_restoring)
    # later statistics build on the checkpoint's
    await _finish(redis, ns, [("a:0", 1.0, 0.0, 6, 1)])
    assert json.loads((await redis.hget(keys.rows, "a:0")) or b"{}") == {"t": 2, "r": [0.5, 1.0], "v": [0.25, 0.0],
                                                                        "w": 6, "e": 1}
    await asyncio.to_thread(resumed.data_source.close)


async def test_a_checkpoint_without_a_statistics_file_keeps_redis_and_a_damaged_one_is_refused(
    redis: Redis, ns: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    await make_namespace(redis, ns, row_stats=2)
    set_env(monkeypatch, redis_url, ns)
    await _finish(redis, ns, [(":1", 0.5, 0.25, 1, 0)])
    before = await _rows(redis, ns)
    manager = await asyncio.to_thread(_manager, "slime", load=str(tmp_path))
    with caplog.at_level(logging.WARNING, "rollstream.integrations.stats_checkpoint"):
        await asyncio.to_thread(manager.load, 2)
    assert "has no" in caplog.text and await _rows(redis, ns) == before

    path = stats_path(tmp_path, 4)
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as handle:
        handle.write('{"format": "something else"}\n')
    with pytest.raises(ConfigError, match="not a rollstream statistics file"):
        await asyncio.to_thread(manager.load, 4)
    assert await _rows(redis, ns) == before
    await asyncio.to_thread(manager.data_source.close)
