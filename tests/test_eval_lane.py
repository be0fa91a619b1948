"""The eval lane: ``consumer.evaluate`` returns at once, its prompts are admitted before training
prompts, its groups never reach ``take()``, and ``eval_results`` reports each finished eval with
its metrics, versions and lag in steps (a real producer process and the simulator)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from conftest import ProcessPool, add_prompts, make_namespace
from redis.asyncio import Redis
from rollstream.common.codec import decode_prompt_entry, prompt_fields
from rollstream.common.errors import ConfigError
from rollstream.common.eval_lane import EVAL_KEY, EvalSettings, eval_prompts, eval_settings
from rollstream.common.keys import Keys, StateField
from rollstream.common.models import Prompt
from rollstream.common.namespace import load_config
from rollstream.common.protocol import PromptQueue
from rollstream.consumer import GroupConsumer


async def test_admit_hands_out_eval_prompts_first_and_returns_them_to_their_lane(
    redis: Redis, ns: str, keys: Keys
) -> None:
    config = await make_namespace(redis, ns, max_backlog=1)
    await add_prompts(redis, ns, 3)
    [first] = eval_prompts(EvalSettings("e1", 2, 16), ["What is 1 + 1?"])
    await redis.xadd(keys.eval_prompts, prompt_fields(first))  # type: ignore[arg-type]
    await redis.xadd(keys.groups, {"index": 0, "data": b"x"})  # the backlog is full: training prompts wait
    queue = PromptQueue(redis, keys, "p1")
    reply = await queue.admit(config, count=4)
    assert reply.status == "ok" and [item.stream for item in reply.entries] == [keys.eval_prompts]
    again = await queue.admit(config, count=4)
    assert again.status == "backlog"  # eval admitted in spite of the backlog; training prompts not
    # a draining producer's unfinished eval prompt goes back to the eval lane, not to training's retry
    item = reply.entries[0]
    assert await queue.give_back(keys.eval_prompts, item.entry_id, item.fields)
    assert await redis.xlen(keys.eval_prompts) == 1 and await redis.xlen(keys.retry) == 0


def test_eval_settings_are_checked() -> None:
    for bad in ({"name": ""}, {"name": "a:b"}, {"name": "x", "n_samples": 0}, {"name": "x", "max_new_tokens": 0},
                {"name": "x", "temperature": -0.1}, {"name": "x", "top_p": 0}, {"name": "x", "top_p": 1.5}):
        with pytest.raises(ConfigError):
            EvalSettings(**bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="no prompts"):
        eval_prompts(EvalSettings("x"), [])
    [p] = eval_prompts(EvalSettings("x", 3, 7), [{"prompt": "q", "label": "4"}])
    assert p.label == "4" and p.metadata[EVAL_KEY] == {"name": "x", "n_samples": 3, "max_new_tokens": 7}
    [p] = eval_prompts(EvalSettings("x", 1, None, 0.0, 0.5), ["q"])
    assert eval_settings(p) == EvalSettings("x", 1, None, 0.0, 0.5)  # what the producer reads back


async def test_an_old_namespace_gets_its_eval_lane(redis: Redis, ns: str, keys: Keys) -> None:
    await make_namespace(redis, ns)
    await redis.delete(keys.eval_prompts)  # as a namespace made before the eval lane
    await load_config(redis, keys)  # what every producer and trainer runs at start
    assert [g["name"] for g in await redis.xinfo_groups(keys.eval_prompts)] == [b"producers"]


async def test_eval_beside_training(
    redis: Redis, redis_url: str, ns: str, keys: Keys, sim, procs: ProcessPool, tmp_path: Path
) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4, archive_bytes=100_000_000)
    await add_prompts(redis, ns, 40)
    procs.producer(redis_url, ns, sim.url)
    eval_set = tmp_path / "eval.jsonl"
    eval_set.write_text("".join(json.dumps({"prompt": f"Compute {i} + 2.", "label": str(i + 2)}) + "\n"
                                for i in range(6)))
    taken: list[Prompt | object] = []
    async with await GroupConsumer.connect(redis_url, ns, "trainer-e") as consumer:
        async with asyncio.timeout(120):
            first = await consumer.take(4)
            await consumer.commit(first)
            assert await consumer.evaluate("arith", eval_set, n_samples=3, max_new_tokens=8) == "arith"
            with pytest.raises(ConfigError, match="already submitted"):
                await consumer.evaluate("arith", ["again"])
            results = []
            steps = 1
            while not results:  # training goes on while the eval runs
                batch = await consumer.take(4)
                taken.extend(batch.groups)
                await consumer.commit(batch)
                steps += 1
                await consumer.set_weight_version(steps)
                results = await consumer.eval_results()
    [result] = results
    assert result.name == "arith" and result.prompts == 6 and result.samples == 18
    assert sum(result.versions.values()) == 18 and all(v >= 0 for v in result.versions)
    assert 0 <= result.metrics["reward_mean"] <= 1 and result.metrics["response_length_mean"] <= 8
    assert result.submitted_step == 1 and result.lag_steps == result.finished_step - 1 >= 0
    assert all(EVAL_KEY not in g.metadata for g in taken)  # type: ignore[attr-defined]
    assert all(len(g.samples) == 2 for g in taken)  # type: ignore[attr-defined]
    assert await redis.xlen(keys.eval_groups) == 0  # folded into the result, archived
    archived = [f for _, f in await redis.xrange(keys.archive) if f[b"fate"] == b"evaluated"]
    assert len(archived) == 6 and {f[b"reason"] for f in archived} == {b"arith"}
    async with await GroupConsumer.connect(redis_url, ns, "trainer-e") as again:
        assert [r.name for r in await again.eval_results()] == ["arith"]  # kept in Redis
    assert int(await redis.hget(keys.state, StateField.TRAINED_STEPS) or 0) == steps


HOSTILE_MARK = {"name": "x", "n_samples": 1, "max_new_tokens": 1, "temperature": 50}
"""What a dataset row could carry to steer its own sampling (issue 49 finding 3)."""


async def test_a_training_prompt_carrying_the_eval_mark_is_sampled_as_training_and_stripped(
    redis: Redis, redis_url: str, ns: str, keys: Keys, sim, procs: ProcessPool
) -> None:
    """A training prompt whose metadata carries ``rollstream_eval`` (written by any client, or an
    older feeder) is generated with the namespace's n and the producer's sampling, not the mark's:
    its group has n samples (it was dead-lettered as ``wrong_group_size`` with n_samples 1) and
    reaches the trainer without the key; the producer warns with a count."""
    await make_namespace(redis, ns, n_samples_per_prompt=3, batch_size=2)
    for index in range(2):
        prompt = Prompt(index=index, prompt=f"Compute {index} + 1.", label=str(index + 1),
                        metadata={EVAL_KEY: dict(HOSTILE_MARK), "keep": index})
        await redis.xadd(keys.prompts, prompt_fields(prompt))  # type: ignore[arg-type]
    producer = procs.producer(redis_url, ns, sim.url)
    async with await GroupConsumer.connect(redis_url, ns, "trainer-m") as consumer:
        async with asyncio.timeout(60):
            batch = await consumer.take(2)
        await consumer.commit(batch)
    assert [len(g.samples) for g in batch.groups] == [3, 3]
    assert [g.metadata.get("keep") for g in batch.groups] == [0, 1]
    assert all(EVAL_KEY not in g.metadata for g in batch.groups)
    assert await redis.xlen(keys.dead) == 0
    await procs.astop_all()
    log = procs.log_of(producer)
    assert f"a training prompt carried metadata[{EVAL_KEY!r}]" in log, log


async def test_the_feeder_strips_the_eval_mark_from_dataset_rows_and_says_how_many(
    redis: Redis, redis_url: str, ns: str, keys: Keys, procs: ProcessPool, tmp_path: Path
) -> None:
    await make_namespace(redis, ns)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(
        json.dumps({"prompt": f"q{i}", "label": str(i), **({EVAL_KEY: HOSTILE_MARK} if i % 2 else {"other": i})}) + "\n"
        for i in range(6)
    ))
    feeder = procs.start("feed", "--redis", redis_url, "--ns", ns, str(data), "--epochs", "1", log_name="feed")
    assert await asyncio.to_thread(feeder.wait, 60) == 0, procs.log_of(feeder)
    prompts = [decode_prompt_entry(f) for _, f in await redis.xrange(keys.prompts)]
    assert len(prompts) == 6 and all(EVAL_KEY not in p.metadata for p in prompts)
    assert [p.metadata.get("other") for p in prompts if p.index % 2 == 0] == [0, 2, 4]  # the rest kept
    log = procs.log_of(feeder)
    assert f"3 rows carried metadata[{EVAL_KEY!r}]" in log, log
