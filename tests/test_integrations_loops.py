"""The slime and miles drop-ins end to end: real redis-server, real producer processes, the simulator,
and the stand-in frameworks' rollout managers calling rollstream's functions as the real ones do."""

from __future__ import annotations

import asyncio
import importlib
import os
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest
from conftest import ProcessPool, add_prompts, make_namespace
from integration_helpers import STANDINS, miles_args, set_env, slime_args
from redis.asyncio import Redis
from rollstream.common.codec import decode_group_entry, decode_prompt_entry, group_fields
from rollstream.common.errors import ConfigError
from rollstream.common.keys import TRAINER_GROUP, Keys
from rollstream.common.models import Group, Sample
from rollstream.integrations.convert import SLIME
from rollstream.integrations.environment import Settings
from rollstream.integrations.journal import Journal, JournalRecord
from rollstream.integrations.trainer_session import RolloutSession, open_consumer

EVAL_RESULT = {"custom": {"rewards": [0.25], "truncated": [False], "samples": []}}


def custom_eval(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> dict[str, Any]:
    """A user's eval function (ROLLSTREAM_EVAL_FUNCTION), legacy style: returns bare data."""
    assert evaluation is True
    return EVAL_RESULT


async def _push_weights(http: httpx.AsyncClient, url: str, version: int) -> None:
    response = await http.post(f"{url}/update_weights_from_disk", json={"weight_version": version})
    response.raise_for_status()


async def _pending(redis: Redis, ns: str) -> int:
    return int((await redis.xpending(Keys(ns).groups, TRAINER_GROUP))["pending"])


async def _left_in_streams(redis: Redis, ns: str) -> list[int]:
    keys = Keys(ns)
    groups = [decode_group_entry(f).index for _, f in await redis.xrange(keys.groups)]
    prompts = [
        decode_prompt_entry(f).index for stream in (keys.retry, keys.prompts) for _, f in await redis.xrange(stream)
    ]
    return groups + prompts


def _groups_of(train_data: dict[str, Any]) -> list[int]:
    return sorted(set(train_data["group_indices"]))


async def test_slime_loop_resumes_from_checkpoint_without_doubles_or_losses(
    redis: Redis, redis_url: str, ns: str, sim: Any, procs: ProcessPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """6 rollouts, checkpoint at 3, crash while training 5 (with the next take under way), resume from 3."""
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4, max_backlog=6)
    await add_prompts(redis, ns, 40)
    procs.producer(redis_url, ns, sim.url, concurrency=8)
    set_env(monkeypatch, redis_url, ns, "slime-trainer", ROLLSTREAM_ENGINE_URL=sim.url)
    rollout = importlib.import_module("slime.ray.rollout")
    args = slime_args()
    first_run: dict[int, list[int]] = {}
    async with httpx.AsyncClient() as http:
        manager = await asyncio.to_thread(rollout.RolloutManager, args)
        await asyncio.to_thread(manager.load, -1)  # slime: load(start_rollout_id - 1) on a fresh start
        await _push_weights(http, sim.url, 1)  # slime pushes the weights once before the first rollout
        for rollout_id in range(6):
            data, metrics = await asyncio.wait_for(asyncio.to_thread(manager.generate, rollout_id), 60)
            first_run[rollout_id] = _groups_of(data)
            assert len(first_run[rollout_id]) == 4 and len(data["tokens"]) == 8
            assert metrics["rollout/rollstream/weight_version"] == rollout_id + 1
            assert metrics["rollout/rollstream/weight_version_from_engine"] == 1.0
            assert metrics["rollout/rollstream/replayed"] == 0.0
            assert await _pending(redis, ns) == 0  # committed at once: the backlog cap stays free
            if rollout_id == 5:
                break  # the trainer dies while training rollout 5
            if rollout_id == 3:
                await asyncio.to_thread(manager.save, 3)
            await _push_weights(http, sim.url, rollout_id + 2)
        # The dying process had already started taking rollout 6 (slime's train_async prefetches);
        # one live trainer per consumer name, so its session is closed first.
        await asyncio.to_thread(manager.data_source.close)
        async with AsyncExitStack() as stack:
            consumer = await open_consumer(stack, redis_url, ns, "slime-trainer")
            orphan = sorted(g.index for g in (await asyncio.wait_for(consumer.take(4), 60)).groups)

        resumed = await asyncio.to_thread(rollout.RolloutManager, args)
        await asyncio.to_thread(resumed.load, 3)
        await _push_weights(http, sim.url, 1)  # a new slime process counts its versions from 1 again
        second_run: dict[int, list[int]] = {}
        for rollout_id in range(4, 8):
            data, metrics = await asyncio.wait_for(asyncio.to_thread(resumed.generate, rollout_id), 60)
            second_run[rollout_id] = _groups_of(data)
            assert metrics["rollout/rollstream/replayed"] == (1.0 if rollout_id in (4, 5) else 0.0)
            await _push_weights(http, sim.url, rollout_id - 2)
        await asyncio.to_thread(resumed.data_source.close)

    assert second_run[4] == first_run[4] and second_run[5] == first_run[5]  # the same groups, trained again
    assert second_run[6] == orphan  # taken by the dead process, never trained: delivered first
    lineage = [g for r in range(4) for g in first_run[r]] + [g for r in range(4, 8) for g in second_run[r]]
    assert len(lineage) == len(set(lineage)) == 32  # every group of the resumed lineage trained exactly once
    await procs.astop_all()
    left = await _left_in_streams(redis, ns)
    assert not set(left) & set(lineage)
    assert sorted([*lineage, *left]) == list(range(40))  # none lost


async def test_miles_loop_with_weight_versions_and_max_staleness_1(
    redis: Redis, redis_url: str, ns: str, sim: Any, procs: ProcessPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4, max_staleness=1)
    await add_prompts(redis, ns, 60)
    procs.producer(redis_url, ns, sim.url, concurrency=8)
    set_env(monkeypatch, redis_url, ns, "miles-trainer")
    manager_module = importlib.import_module("miles.ray.rollout.rollout_manager")
    stock_eval = importlib.import_module("miles.rollout.inference_rollout.inference_rollout_common")
    sample_cls = importlib.import_module("miles.utils.types").Sample
    args = miles_args(max_weight_staleness=1)
    manager = await asyncio.to_thread(manager_module.RolloutManager, args)
    await asyncio.to_thread(manager.load, -1)
    async with httpx.AsyncClient() as http:
        for rollout_id in range(6):
            version = rollout_id + 1
            await _push_weights(http, sim.url, version)
            manager.weight_version = version  # what miles' training actor sets after each update
            samples, metrics = await asyncio.wait_for(manager.generate(rollout_id), 60)
            assert len(samples) == 8 and all(isinstance(s, sample_cls) for s in samples)
            by_group: dict[int, list[int]] = {}
            for s in samples:
                assert s.weight_versions and all(isinstance(v, str) for v in s.weight_versions)
                by_group.setdefault(s.group_index, []).extend(int(v) for v in s.weight_versions)
            assert len(by_group) == 4
            assert all(version - min(vs) <= 1 for vs in by_group.values())
            assert metrics["rollout/rollstream/weight_version"] == version
            assert metrics["rollout/rollstream/staleness_max"] <= 1
            assert (await redis.hget(Keys(ns).state, "weight_version")).decode() == str(version)
            if rollout_id == 2:
                manager.save(2)
        result = await manager.eval(6)
    assert stock_eval.EVAL_CALLS[-1] == (6, None)
    assert result.data["standin_eval"]["rewards"] == [0.5] and result.metrics == {"eval/standin": 6.0}
    await asyncio.to_thread(manager.data_source.close)


async def test_slime_eval_is_delegated(redis: Redis, redis_url: str, ns: str, monkeypatch: pytest.MonkeyPatch) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4)
    set_env(monkeypatch, redis_url, ns)
    rollout = importlib.import_module("slime.ray.rollout")
    stock = importlib.import_module("slime.rollout.sglang_rollout")
    manager = await asyncio.to_thread(rollout.RolloutManager, slime_args())
    result = await asyncio.to_thread(manager.eval, 3)  # default: slime's stock generate_rollout
    assert stock.EVAL_CALLS[-1] == (3, True)
    assert result.data["standin_eval"]["truncated"] == [False, True] and result.metrics == {"eval/standin": 3.0}
    manager.data_source.close()

    monkeypatch.setenv("ROLLSTREAM_EVAL_FUNCTION", "test_integrations_loops.custom_eval")
    manager = await asyncio.to_thread(rollout.RolloutManager, slime_args())
    result = await asyncio.to_thread(manager.eval, 4)
    assert result.data is EVAL_RESULT  # passed through (call_rollout_fn wraps the bare dict)
    manager.data_source.close()

    monkeypatch.setenv("ROLLSTREAM_EVAL_FUNCTION", "rollstream.integrations.slime.generate_rollout")
    manager = await asyncio.to_thread(rollout.RolloutManager, slime_args())
    with pytest.raises(ConfigError, match="rollstream's own generate_rollout"):
        await asyncio.to_thread(manager.eval, 5)
    manager.data_source.close()


@pytest.mark.parametrize(
    ("overrides", "text"),
    [
        ({"rollout_batch_size": 3}, "--rollout-batch-size is 3 but namespace .* has batch_size=4"),
        ({"n_samples_per_prompt": 4}, "--n-samples-per-prompt is 4 but namespace .* has n_samples_per_prompt=2"),
    ],
)
async def test_slime_size_mismatch_is_a_clear_error_at_the_first_call(
    redis: Redis, redis_url: str, ns: str, monkeypatch: pytest.MonkeyPatch, overrides: dict[str, int], text: str
) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4)
    set_env(monkeypatch, redis_url, ns)
    rollout = importlib.import_module("slime.ray.rollout")
    manager = await asyncio.to_thread(rollout.RolloutManager, slime_args(**overrides))
    with pytest.raises(ConfigError, match=text):
        await asyncio.wait_for(asyncio.to_thread(manager.generate, 0), 30)
    manager.data_source.close()


async def test_miles_staleness_flag_must_match_the_namespace(
    redis: Redis, redis_url: str, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4, max_staleness=1)
    set_env(monkeypatch, redis_url, ns)
    manager_module = importlib.import_module("miles.ray.rollout.rollout_manager")
    manager = await asyncio.to_thread(manager_module.RolloutManager, miles_args(max_weight_staleness=2))
    with pytest.raises(ConfigError, match=r"--max-weight-staleness is 2 but namespace .* has max_staleness=1"):
        await asyncio.wait_for(manager.generate(0), 30)
    await asyncio.to_thread(manager.data_source.close)


async def test_missing_namespace_config_fails_the_first_call(
    redis_url: str, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_env(monkeypatch, redis_url, ns)
    rollout = importlib.import_module("slime.ray.rollout")
    manager = await asyncio.to_thread(rollout.RolloutManager, slime_args())
    with pytest.raises(ConfigError, match="rollstream init"):
        await asyncio.wait_for(asyncio.to_thread(manager.generate, 0), 30)
    manager.data_source.close()


def _group(index: int) -> Group:
    samples = [
        Sample(index=i, tokens=[1, 2, 10 + i], response="x", response_length=1, reward=1.0, weight_versions=[0])
        for i in range(2)
    ]
    return Group(index=index, prompt=f"p{index}", samples=samples, label="x")


async def test_groups_journaled_but_not_committed_are_not_trained_twice(
    redis: Redis, redis_url: str, ns: str
) -> None:
    """A trainer that died between writing the journal and committing: the journaled groups are
    redelivered to the next take, which skips (and commits) them; the rollout replays them."""
    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4)
    for index in range(8):
        await redis.xadd(keys.groups, group_fields(_group(index)))
    settings = Settings(redis_url=redis_url, namespace=ns, consumer_name="t0")
    async with AsyncExitStack() as stack:
        consumer = await open_consumer(stack, redis_url, ns, "t0")
        batch = await consumer.take(4)
        await Journal(redis, ns, "t0").put(
            JournalRecord(rollout_id=0, groups=batch.groups, entry_ids=batch.entry_ids, metrics={})
        )
    session = RolloutSession(settings, SLIME)
    try:
        replayed = await asyncio.to_thread(session.train_batch, 0, n_samples=2, batch_size=4)
        fresh = await asyncio.to_thread(session.train_batch, 1, n_samples=2, batch_size=4)
    finally:
        await asyncio.to_thread(session.close)
    assert replayed.replayed and [g.index for g in replayed.groups] == [0, 1, 2, 3]
    assert [g.index for g in fresh.groups] == [4, 5, 6, 7]
    assert fresh.metrics["journal_duplicates_skipped"] == 4
    assert await redis.xlen(keys.groups) == 0 and await _pending(redis, ns) == 0


async def test_resume_from_a_checkpoint_the_journal_forgot_is_refused(
    redis: Redis, redis_url: str, ns: str
) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4)
    settings = Settings(redis_url=redis_url, namespace=ns, consumer_name="t0", keep_checkpoints=1)
    session = RolloutSession(settings, SLIME)
    try:
        session.save(3)
        session.save(6)
        with pytest.raises(ConfigError, match="ROLLSTREAM_ALLOW_JOURNAL_GAP=1"):
            session.load(3)
        session.load(6)
    finally:
        session.close()
    lenient = RolloutSession(
        Settings(redis_url=redis_url, namespace=ns, consumer_name="t0", keep_checkpoints=1, allow_journal_gap=True),
        SLIME,
    )
    try:
        lenient.load(3)
        assert lenient.loaded_from == 3
    finally:
        lenient.close()


async def test_producer_scores_with_a_slime_group_reward(
    redis: Redis, redis_url: str, ns: str, sim: Any, procs: ProcessPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4)
    await add_prompts(redis, ns, 4)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(STANDINS), os.environ.get("PYTHONPATH")])))
    procs.producer(redis_url, ns, sim.url, reward="slime-group:user_rm.group_rm")
    set_env(monkeypatch, redis_url, ns)
    rollout = importlib.import_module("slime.ray.rollout")
    manager = await asyncio.to_thread(rollout.RolloutManager, slime_args())
    try:
        data, _ = await asyncio.wait_for(asyncio.to_thread(manager.generate, 0), 60)
    finally:
        await asyncio.to_thread(manager.data_source.close)
    rewards = data["rewards"]
    assert sorted(rewards) == [0.0] * 4 + [1.0] * 4, procs.logs()


async def test_the_integrations_loop_has_a_watchdog(redis: Redis, redis_url: str, ns: str, caplog: Any) -> None:
    """The session's loop (where the trainer's name lease is renewed) is watched: a stall over a
    fifth of that lease is logged with the code that held it, from the session's own thread."""
    import logging
    import time

    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4)
    session = RolloutSession(Settings(redis_url=redis_url, namespace=ns, consumer_name="t0"), SLIME)

    async def convert_slowly() -> None:
        await asyncio.sleep(0.3)
        time.sleep(2.5)  # noqa: ASYNC251 -- a blocking conversion on the session's loop
        await asyncio.sleep(0.3)

    caplog.set_level(logging.WARNING, logger="rollstream.integrations.trainer_session")
    try:
        await asyncio.to_thread(session.run, convert_slowly())
    finally:
        await asyncio.to_thread(session.close)
    stalls = [r.getMessage() for r in caplog.records if "event loop stalled" in r.getMessage()]
    assert len(stalls) == 1, stalls
    assert stalls[0].startswith("rollstream slime integration: event loop stalled") and "convert_slowly" in stalls[0]
