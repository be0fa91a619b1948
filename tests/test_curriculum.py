"""The curriculum: per-row statistics kept by the trainer's scripts, and the feeder deferring rows
whose last groups taught nothing, never for ever. Real redis-server, producer and feeder processes."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest
from conftest import ProcessPool, make_namespace
from redis.asyncio import Redis
from rollstream.common.errors import ConfigError
from rollstream.common.keys import Keys
from rollstream.consumer import GroupConsumer
from rollstream.consumer.filters import reward_variance
from rollstream.producer.curriculum import RowStats, ZeroVarianceDeferral, load_sampler
from rollstream.producer.feeder import Feeder, FeedSettings, load_jsonl
from rollstream.testing.sim import SimEngine

REWARDS = Path(__file__).parent / "reward_fns.py"


def test_zero_variance_deferral_defers_only_what_taught_nothing_and_never_for_ever() -> None:
    sampler = ZeroVarianceDeferral(k=2, offer=0.25, max_gap=3)
    solved = RowStats(trained=4, rewards=(1.0, 1.0), variances=(0.0, 0.0), last_version=3, last_epoch=4)
    assert sampler(None, 0, 0.99)  # no history: fed
    assert sampler(RowStats(1, (1.0,), (0.0,), 0, 0), 1, 0.99)  # fewer than k groups: fed
    assert sampler(RowStats(2, (1.0, 0.5), (0.0, 0.25), 0, 1), 2, 0.99)  # one group with signal: fed
    assert not sampler(solved, 5, 0.99) and sampler(solved, 5, 0.1)  # deferred, offered with p = 0.25
    assert sampler(solved, 7, 0.99)  # 3 epochs since its last group: fed whatever its history
    assert RowStats.parse(b"not json") is None and RowStats.parse(None) is None
    assert RowStats.parse('{"t": 2, "r": {}, "v": [0], "w": 1, "e": 2}') == RowStats(2, (), (0.0,), 1, 2)
    with pytest.raises(ConfigError):
        ZeroVarianceDeferral(offer=0)
    with pytest.raises(ConfigError, match="curriculum sampler"):
        load_sampler("no_such_module_x:fn")


async def test_a_curriculum_needs_row_statistics(redis: Redis, ns: str, tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "label": "1"}\n')
    await make_namespace(redis, ns)
    settings = FeedSettings(namespace=ns, curriculum=ZeroVarianceDeferral())
    with pytest.raises(ConfigError, match="row-stats"):
        await Feeder(redis, load_jsonl(path), settings).run()


async def test_rows_that_are_always_solved_are_deferred_and_come_back(
    redis: Redis, redis_url: str, ns: str, procs: ProcessPool, tmp_path: Path, sim: SimEngine
) -> None:
    """Half the rows are always solved (reward 1 for every sample: zero variance, filtered). From
    the epoch after their first group they are fed far less often, the others every epoch; every
    row is fed again by its ``max_gap``-th epoch. Statistics keyed by row, kept for filtered and
    trained groups alike."""
    keys = Keys(ns)
    rows = 24
    await make_namespace(redis, ns, n_samples_per_prompt=4, batch_size=4, row_stats=1)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "label": "easy" if i % 2 else "hard"}) + "\n"
                            for i in range(rows)))
    procs.start("feed", "--redis", redis_url, "--ns", ns, str(path), "--epochs", "5", "--window", "8",
                "--curriculum", "zero-variance", "--curriculum-offer", "0.1", "--curriculum-max-gap", "3",
                log_name="feeder")
    procs.producer(redis_url, ns, sim.url, reward=f"{REWARDS}:easy_or_alternating")
    fed: Counter[tuple[int, str]] = Counter()

    def keep(group: object) -> object:
        fed[(group.epoch, group.label)] += 1  # type: ignore[attr-defined]
        return reward_variance(group)  # type: ignore[arg-type]

    async with await GroupConsumer.connect(redis_url, ns, "trainer", keep=keep) as consumer:
        trained = 0
        while trained < 5 * rows // 2:  # every hard row, every epoch
            batch = await asyncio.wait_for(consumer.take(4), 120)
            assert all(g.label == "hard" for g in batch.groups)
            trained += len(batch.groups)
            await consumer.commit(batch)
    assert fed[(0, "easy")] == rows // 2 and all(fed[(e, "hard")] == rows // 2 for e in range(5))
    assert fed[(1, "easy")] + fed[(2, "easy")] <= rows // 2  # deferred (offered with p = 0.1)
    # rows not fed since epoch 0 are back by max_gap (epoch 3): none dropped for ever
    assert fed[(3, "easy")] >= rows // 2 - fed[(1, "easy")] - fed[(2, "easy")]
    stats = RowStats.parse(await redis.hget(keys.rows, ":1"))
    assert stats is not None and stats.variances[-1] == 0 and stats.rewards[-1] == 1.0
    hard = RowStats.parse(await redis.hget(keys.rows, ":0"))
    assert hard is not None and hard.trained == 5 and hard.variances[-1] > 0 and hard.last_epoch == 4
