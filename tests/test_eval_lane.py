"""The eval lane: ``consumer.evaluate`` returns at once, its prompts are admitted before training
prompts, its groups never reach ``take()``, and ``eval_results`` reports each finished eval with
its metrics, versions and lag in steps (a real producer process and the simulator)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ProcessPool, add_prompts, make_namespace, wait_until
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


SUBMITTER = textwrap.dedent(
    """
    import asyncio, os, sys, time
    from rollstream.consumer import GroupConsumer

    def items(count, block_at, release):
        for i in range(count):
            if i == block_at:  # the trainer is killed here, its submission cut short
                while not os.path.exists(release):
                    time.sleep(0.05)
            yield {"prompt": f"Compute {i} + 2.", "label": str(i + 2)}

    async def main():
        url, ns, name, count, block_at, release = sys.argv[1:7]
        async with await GroupConsumer.connect(url, ns, "trainer-s") as consumer:
            await consumer.evaluate(name, items(int(count), int(block_at), release), n_samples=1, max_new_tokens=4)

    asyncio.run(main())
    """
)


def _items(count: int) -> list[dict[str, str]]:
    return [{"prompt": f"Compute {i} + 2.", "label": str(i + 2)} for i in range(count)]


async def _lane_indexes(redis: Redis, keys: Keys) -> list[int]:
    return sorted(int(f[b"index"]) for _, f in await redis.xrange(keys.eval_prompts))


async def _progress_at(redis: Redis, keys: Keys, name: str, written: int) -> bool:
    progress = await redis.hget(keys.eval_submitting, name)  # type: ignore[misc]
    return progress is not None and progress.split(b":")[0] == str(written).encode()


async def test_an_eval_whose_trainer_was_killed_right_after_its_name_was_recorded_is_resumed_and_finishes(
    redis: Redis, redis_url: str, ns: str, keys: Keys, sim, procs: ProcessPool, tmp_path: Path
) -> None:
    """Issue 49 finding 5: the name was recorded before (and apart from) the prompts, so a trainer
    SIGKILLed in between left an eval that could never finish, and a resubmit was refused as
    "already submitted". Now the same name and set resume it, and it finishes."""
    await make_namespace(redis, ns, n_samples_per_prompt=1, batch_size=1)
    script = tmp_path / "submitter.py"
    script.write_text(SUBMITTER)
    log = tmp_path / "submitter.log"
    with log.open("wb") as out:
        child = await asyncio.to_thread(
            subprocess.Popen, [sys.executable, str(script), redis_url, ns, "big", "300", "1", str(tmp_path / "never")],
            stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        try:
            await wait_until(lambda: redis.hexists(keys.evals, "big"), timeout=120, interval=0.005,
                             message="the name recorded")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the submitter's log: {log.read_text(errors='replace')[-2000:]}") from None
        child.send_signal(signal.SIGKILL)
        assert await asyncio.to_thread(child.wait, 20) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
    meta = json.loads(await redis.hget(keys.evals, "big"))  # type: ignore[misc,arg-type]
    assert meta.get("submitting") and "prompts" not in meta
    assert await _lane_indexes(redis, keys) in ([], [0])  # at most the first prompt (the set blocks at its second)
    async with await GroupConsumer.connect(redis_url, ns, "trainer-r") as consumer:
        assert await consumer.evaluate("big", _items(300), n_samples=1, max_new_tokens=4) == "big"
        assert await _lane_indexes(redis, keys) == list(range(300))  # each prompt once
        with pytest.raises(ConfigError, match="already submitted"):
            await consumer.evaluate("big", _items(300), n_samples=1, max_new_tokens=4)
        procs.producer(redis_url, ns, sim.url, concurrency=32)
        (result,) = await wait_until(consumer.eval_results, timeout=120, message="the resumed eval finished")
    assert (result.name, result.prompts, result.samples) == ("big", 300, 300)
    assert await redis.hlen(keys.eval_submitting) == 0


async def test_a_cancelled_or_failed_eval_submission_resumes_from_where_it_stopped_and_checks_the_set(
    redis: Redis, redis_url: str, ns: str, keys: Keys
) -> None:
    await make_namespace(redis, ns)
    release = threading.Event()

    def blocking(count: int, block_at: int) -> Iterator[dict[str, str]]:
        for i, item in enumerate(_items(count)):
            if i == block_at:
                release.wait(60)
            yield item

    def failing(count: int, fail_at: int) -> Iterator[dict[str, str]]:
        for i, item in enumerate(_items(count)):
            if i == fail_at:
                raise ConfigError("the eval set's reader failed")
            yield item

    async with await GroupConsumer.connect(redis_url, ns, "trainer-c") as consumer:
        submit = asyncio.create_task(consumer.evaluate("c", blocking(2500, 1200), n_samples=2))
        await wait_until(lambda: _progress_at(redis, keys, "c", 1001), message="1001 prompts written")
        submit.cancel()
        with pytest.raises(asyncio.CancelledError):
            await submit
        release.set()
        with pytest.raises(ConfigError, match="other settings"):  # a resume asks for what the first did
            await consumer.evaluate("c", _items(2500), n_samples=3)
        assert await consumer.evaluate("c", _items(2500), n_samples=2) == "c"
        assert await _lane_indexes(redis, keys) == list(range(2500))
        meta = json.loads(await redis.hget(keys.evals, "c"))  # type: ignore[misc,arg-type]
        assert meta["prompts"] == 2500 and "submitting" not in meta
        with pytest.raises(ConfigError, match="the eval set's reader failed"):
            await consumer.evaluate("d", failing(1500, 1100), n_samples=2)
        assert await _progress_at(redis, keys, "d", 1001)
        other = [{"prompt": f"Other {i}."} for i in range(1500)]
        with pytest.raises(ConfigError, match="from another set"):
            await consumer.evaluate("d", other, n_samples=2)
        assert await consumer.evaluate("d", _items(1500), n_samples=2) == "d"
    assert len(await _lane_indexes(redis, keys)) == 4000
    assert await redis.hlen(keys.eval_submitting) == 0


async def _eval_held(redis: Redis, keys: Keys) -> tuple[int, int, int]:
    """(groups in eval_groups, their data bytes, eval prompts in flight)."""
    rows = await redis.xrange(keys.eval_groups)
    pending = await redis.xpending(keys.eval_prompts, "producers")
    return len(rows), sum(len(f[b"data"]) for _, f in rows), int(pending["pending"])


@pytest.mark.parametrize("bound", ["max_backlog", "max_backlog_bytes"])
async def test_the_eval_lane_is_bounded_like_the_training_path_and_an_eval_larger_than_the_bound_finishes(
    redis: Redis, redis_url: str, ns: str, keys: Keys, sim, procs: ProcessPool, bound: str
) -> None:
    """Issue 49 finding 9: eval groups piled up in ``eval_groups`` without bound (401 KiB under a
    64 KiB budget) while nobody collected them. Now ADMIT holds the eval lane to the namespace's
    ``max_backlog`` (groups held plus prompts in flight) or byte budget, training goes on beside
    it, and ``eval_results`` collects as groups come, so an eval 8x the bound finishes."""
    budget = 4096  # a few eval groups of 2 short samples (about 600 bytes each)
    config = {"max_backlog": 4} if bound == "max_backlog" else {"max_backlog": 1000, "max_backlog_bytes": budget}
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2, **config)
    await add_prompts(redis, ns, 40)
    async with await GroupConsumer.connect(redis_url, ns, "trainer-b") as consumer:
        await consumer.evaluate("big", _items(32), n_samples=2, max_new_tokens=16)
        procs.producer(redis_url, ns, sim.url)
        largest = 0
        async with asyncio.timeout(120):
            for _ in range(6):  # training goes on (the eval lane at its bound lets training prompts in)
                batch = await consumer.take(2)
                await consumer.commit(batch)
                held, held_bytes, flight = await _eval_held(redis, keys)
                largest = max(largest, max((len(f[b"data"]) for _, f in await redis.xrange(keys.eval_groups)),
                                           default=0))
                if bound == "max_backlog":
                    assert held + flight <= 4, (held, flight)
                else:
                    assert held_bytes <= budget + largest, (held_bytes, budget)
        assert (await _eval_held(redis, keys))[0] < 32  # nobody collected yet: the lane stopped short
        results: list = []
        async with asyncio.timeout(120):
            while not results:
                results = await consumer.eval_results()
                await asyncio.sleep(0.05)
    [result] = results
    assert (result.name, result.prompts, result.samples) == ("big", 32, 64)
    assert sorted(g.index for g in result.groups) == list(range(32))  # every group, collected as it came
    assert len(result.rewards) == 64
    assert await redis.xlen(keys.eval_groups) == 0 and not await redis.exists(keys.eval_rows("big"))
    assert int(await redis.hget(keys.state, StateField.EVAL_BYTES) or 0) == 0  # type: ignore[misc]
    archived = [f for _, f in await redis.xrange(keys.archive) if f[b"fate"] == b"evaluated"]
    assert len(archived) in (0, 32)  # archived once each when the archive is on


def test_an_eval_set_on_disk_is_read_as_the_feeder_reads_a_dataset(tmp_path: Path) -> None:
    """Issue 50: evaluate(path) reads through open_dataset, so an eval set may be Parquet, a glob of
    shards or a row slice, with its own keys; a bad row is a ConfigError naming file and line."""
    from rollstream.common.datasets import RowFormat
    from rollstream.consumer.evaluation import read_eval_source

    rows = [{"prompt": f"q{i}", "label": str(i), "metadata": {"k": i}} for i in range(6)]
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    assert read_eval_source(plain) == rows
    assert read_eval_source(f"{plain}@[2:4]") == rows[2:4]

    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    shards = tmp_path / "shards"
    shards.mkdir()
    for part in range(2):
        table = pa.table({"question": [f"p{part}{i}" for i in range(3)], "answer": [str(i) for i in range(3)]})
        pq.write_table(table, shards / f"part-{part}.parquet")
    items = read_eval_source(shards, RowFormat(prompt_key="question", label_key="answer", metadata_key="meta"))
    assert [(i["prompt"], i["label"]) for i in items] == [(f"p{p}{i}", str(i)) for p in range(2) for i in range(3)]

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n{not json\n")
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2"):
        read_eval_source(bad)
