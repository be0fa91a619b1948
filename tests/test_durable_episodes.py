"""Durable episodes: a journal per episode in Redis, replayed by the producer that takes a prompt
over. Real Redis, real ``rollstream produce`` processes killed with SIGKILL or drained with
SIGTERM, the simulator counting every engine call; the JOURNAL_APPEND script and the hand-overs
that delete a journal are checked on Redis directly."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
from pathlib import Path
from typing import Any

import msgpack
import pytest
from conftest import ProcessPool, add_prompts, make_namespace, wait_until
from redis.asyncio import Redis
from rich.console import Console
from rollstream.cli.inspect import render
from rollstream.common.keys import PRODUCERS_GROUP, Keys, StateField
from rollstream.common.models import Status
from rollstream.common.protocol import EpisodeJournals, Heartbeat, Keyspace, PromptQueue
from rollstream.consumer import GroupConsumer
from rollstream.ops.snapshot import snapshot
from rollstream.producer.durable import decode_once, encode_once
from rollstream.testing.sim import SimConfig, SimEngine
from rollstream.testing.sim.simulator import routed_expert
from test_episodes_pipeline import heartbeat
from test_faults import wait_exit

USABLE = (Status.COMPLETED, Status.TRUNCATED)
FNS = Path(__file__).with_name("durable_fns.py")


def fn(name: str) -> str:
    return f"{FNS}:{name}"


async def _state_int(redis: Redis, ns: str, field: str) -> int:
    return int(await redis.hget(Keys(ns).state, field) or 0)  # type: ignore[misc]


async def _journal_keys(redis: Redis, ns: str) -> list[bytes]:
    return [key async for key in redis.scan_iter(match=Keys(ns).episode_pattern)]


async def _assert_no_journal(redis: Redis, ns: str) -> None:
    assert await _journal_keys(redis, ns) == []
    assert await _state_int(redis, ns, StateField.JOURNAL_BYTES) == 0


async def _published_beat(redis: Redis, ns: str, name: str) -> Heartbeat:
    """The producer's heartbeat once it reports its group published (its counters then final)."""

    async def published() -> Heartbeat | None:
        beat = await heartbeat(redis, ns, name)
        return beat if beat.published == 1 and beat.episodes == 0 else None

    return await wait_until(published, message=f"{name}'s heartbeat after the publish")


def _tool_lines(log: Path) -> list[tuple[int, str]]:
    lines = log.read_text().splitlines() if log.exists() else []
    return [(int(pid), rest) for pid, _, rest in (line.partition(" ") for line in lines)]


# -- the script, on Redis directly --------------------------------------------------------------


async def _claimed_prompt(redis: Redis, keys: Keys, consumer: str) -> bytes:
    await redis.xgroup_create(keys.prompts, PRODUCERS_GROUP, id="0", mkstream=True)
    entry_id = await redis.xadd(keys.prompts, {"index": 0})
    await redis.xreadgroup(PRODUCERS_GROUP, consumer, {keys.prompts: ">"}, count=1)
    return entry_id


async def test_append_writes_only_under_the_lease_within_the_budget_and_truncates_on_divergence(
    redis: Redis, ns: str
) -> None:
    keys = Keys(ns)
    entry_id = await _claimed_prompt(redis, keys, "a")
    mine = EpisodeJournals(redis, keys, "a")
    other = EpisodeJournals(redis, keys, "b")

    async def append(who: EpisodeJournals, seq: int, step: bytes, budget: int = 0, member: int = 0) -> str:
        return await who.append(stream=keys.prompts, entry_id=entry_id, index=0, epoch=0, member=member,
                                seq=seq, budget=budget, step=step)

    assert [await append(mine, s, b"x" * 10) for s in range(3)] == ["ok"] * 3
    assert await append(mine, 0, b"y" * 5, member=1) == "ok"
    assert await append(other, 3, b"z") == "lost"  # not its lease: nothing written
    assert await mine.load(0, 0) == {0: [b"x" * 10] * 3, 1: [b"y" * 5]}
    assert await _state_int(redis, ns, StateField.JOURNAL_BYTES) == 35
    # a replay that diverged at step 1: steps 1 and 2 go, the new step 1 replaces them
    assert await append(mine, 1, b"w" * 4) == "ok"
    assert await mine.load(0, 0) == {0: [b"x" * 10, b"w" * 4], 1: [b"y" * 5]}
    assert await _state_int(redis, ns, StateField.JOURNAL_BYTES) == 19
    assert int(await redis.hget(keys.episode(0, 0), "bytes")) == 19  # type: ignore[misc]
    # the byte budget (groups held + journals): a step that would pass it is not written
    await redis.hset(keys.state, StateField.GROUP_BYTES, 100)  # type: ignore[misc]
    assert await append(mine, 2, b"v" * 2, budget=120) == "full"
    assert await append(mine, 2, b"v", budget=120) == "ok"
    assert await _state_int(redis, ns, StateField.JOURNAL_STEPS) == 6


@pytest.mark.parametrize("ending", ["publish", "dead_letter", "return"])
async def test_a_journal_goes_with_its_prompts_publish_and_dead_letter_and_stays_when_returned(
    redis: Redis, ns: str, ending: str
) -> None:
    keys = Keys(ns)
    await make_namespace(redis, ns)
    entry_id = await redis.xadd(keys.prompts, {"index": 0})
    await redis.xreadgroup(PRODUCERS_GROUP, "a", {keys.prompts: ">"}, count=1)
    journals = EpisodeJournals(redis, keys, "a")
    assert await journals.append(stream=keys.prompts, entry_id=entry_id, index=0, epoch=0, member=0, seq=0,
                                 budget=0, step=b"s" * 7) == "ok"
    queue = PromptQueue(redis, keys, "a")
    journal = keys.episode(0, 0)
    if ending == "publish":
        assert await queue.publish(keys.prompts, entry_id, {"data": b"g"}, journal) is not None
    elif ending == "dead_letter":
        assert await queue.dead_letter(keys.prompts, entry_id, {"index": 0}, "test", journal)
    else:
        assert await queue.give_back(keys.prompts, entry_id, {"index": 0})
    if ending == "return":  # a drain: the producer that takes the prompt over resumes from it
        assert await journals.load(0, 0) == {0: [b"s" * 7]}
        assert await _state_int(redis, ns, StateField.JOURNAL_BYTES) == 7
    else:
        await _assert_no_journal(redis, ns)


# -- real producers -----------------------------------------------------------------------------


async def _start_blocked(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool, monkeypatch: pytest.MonkeyPatch,
    tool_log: Path, salt: str = "", extra: tuple[str, ...] = (),
) -> tuple[subprocess.Popen[bytes], int]:
    """Producer ``a`` runs one 6-turn episode up to the tool of turn 4, which never returns."""
    await make_namespace(redis, ns, n_samples_per_prompt=1, batch_size=1, lease_seconds=3.0, durable_episodes=True)
    await add_prompts(redis, ns, 1, text="Compute 2 + 2.")
    monkeypatch.setenv("TOOL_LOG", str(tool_log))
    monkeypatch.setenv("BLOCK_AT", "4")
    monkeypatch.setenv("TOOL_SALT", salt)
    first = procs.producer(redis_url, ns, sim.url, "--generate", fn("six_turns"), "--drain-timeout", "20", *extra,
                           name="a")

    async def at_turn_four() -> bool:  # once + (generate, observe) x 3 + generate 4
        return await _state_int(redis, ns, StateField.JOURNAL_STEPS) == 8

    await wait_until(at_turn_four, message="the episode journaled up to turn 4")
    await wait_until(lambda: any(rest.startswith("tool 4") for _, rest in _tool_lines(tool_log)),
                     message="in the tool of turn 4")
    monkeypatch.delenv("BLOCK_AT")
    return first, sim.state.requests


async def _finish_with_b(redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool) -> Status:
    procs.producer(redis_url, ns, sim.url, "--generate", fn("six_turns"), name="b")
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        async with asyncio.timeout(90):
            batch = await consumer.take(1)
        await consumer.commit(batch)
    (group,) = batch.groups
    assert group.producer == "b"
    (sample,) = group.samples
    assert len(sample.weight_versions) == 6  # six engine calls' versions, journaled or live
    return group.status


@pytest.mark.parametrize("stop", ["SIGKILL", "SIGTERM"])
async def test_a_six_turn_episode_resumes_at_turn_four_after_its_producer_is_killed_or_drained(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, stop: str,
) -> None:
    keys = Keys(ns)
    tool_log = tmp_path / "tools.log"
    first, calls_before = await _start_blocked(redis, redis_url, ns, sim, procs, monkeypatch, tool_log)
    assert calls_before == 4
    if stop == "SIGKILL":
        first.send_signal(signal.SIGKILL)
        assert await wait_exit(first) == -signal.SIGKILL
    else:
        first.send_signal(signal.SIGTERM)
        assert await wait_exit(first) == 0, procs.log_of(first)
        assert "returned 1 prompts" in procs.log_of(first)
        assert await redis.xlen(keys.retry) == 1  # back at once: the tool was not waited for
        assert int(await redis.hget(keys.episode(0, 0), "n:0")) == 8  # type: ignore[misc]  # the journal stays
        snap = await snapshot(redis, keys)  # counted in inspect
        assert snap["episodes"]["journals"] == 1 and snap["episodes"]["journal_bytes"] > 0
        screen = Console(width=200, record=True)
        screen.print(render(snap, plain=True))
        assert "durable episodes: 1 journals" in screen.export_text()
    assert await _finish_with_b(redis, redis_url, ns, sim, procs) in USABLE
    assert sim.state.requests == 6  # turns 1-4 from a, 5-6 from b: no finished engine call made again
    beat = await _published_beat(redis, ns, "b")
    assert (beat.episodes_resumed, beat.replayed_steps, beat.resume_diverged) == (1, 8, 0)
    lines = _tool_lines(tool_log)
    onces = [pid for pid, rest in lines if rest == "once sandbox"]
    assert onces == [first.pid]  # b got the sandbox from the journal
    b_tools = [rest for pid, rest in lines if pid != first.pid and rest.startswith("tool")]
    # the user's code between steps runs again (it rebuilds the tool's state), with a's sandbox
    assert b_tools == [f"tool {t} sandbox-{first.pid}" for t in range(1, 6)]
    await _assert_no_journal(redis, ns)


async def test_a_once_value_with_int_keys_is_read_back_after_its_producer_is_killed(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 49 finding 4: ``once()`` returning ``{1: ..., 2: ...}`` was journaled but could not be
    decoded on resume (int map keys), so the sandbox was made twice for one episode."""
    tool_log = tmp_path / "tools.log"
    monkeypatch.setenv("ONCE_SHAPE", "int_keys")
    first, _ = await _start_blocked(redis, redis_url, ns, sim, procs, monkeypatch, tool_log)
    first.send_signal(signal.SIGKILL)
    assert await wait_exit(first) == -signal.SIGKILL
    assert await _finish_with_b(redis, redis_url, ns, sim, procs) in USABLE
    lines = _tool_lines(tool_log)
    assert [pid for pid, rest in lines if rest == "once sandbox"] == [first.pid]  # made once per episode
    assert [rest for pid, rest in lines if pid != first.pid and rest.startswith("tool")] == [
        f"tool {t} sandbox-{first.pid}" for t in range(1, 6)
    ]
    beat = await _published_beat(redis, ns, "b")
    assert (beat.episodes_resumed, beat.replayed_steps, beat.resume_diverged) == (1, 8, 0)
    await _assert_no_journal(redis, ns)


def test_a_once_value_that_would_not_read_back_is_refused_when_recorded() -> None:
    assert decode_once(encode_once({1: "a", 2.5: None, "k": (1, 2)})) == {1: "a", 2.5: None, "k": [1, 2]}
    with pytest.raises(TypeError, match="would not read back"):
        encode_once({(1, 2): "sandbox"})  # a tuple key comes back as a list: unhashable
    with pytest.raises(TypeError, match="msgpack-encodable"):
        encode_once({"when": object()})


async def test_a_divergent_tool_drops_the_rest_of_the_journal_and_goes_on_live(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tool_log = tmp_path / "tools.log"
    first, _ = await _start_blocked(redis, redis_url, ns, sim, procs, monkeypatch, tool_log, salt="x")
    first.send_signal(signal.SIGKILL)
    await wait_exit(first)
    monkeypatch.setenv("TOOL_SALT", "y")  # the tool answers differently now
    assert await _finish_with_b(redis, redis_url, ns, sim, procs) in USABLE
    # once and generate 1 replayed; the first observe differs: generates 2-6 live
    assert sim.state.requests == 4 + 5
    beat = await _published_beat(redis, ns, "b")
    assert (beat.episodes_resumed, beat.replayed_steps, beat.resume_diverged) == (1, 2, 1)
    assert await _state_int(redis, ns, StateField.RESUME_DIVERGED) == 1
    log = procs.logs()
    assert log.count("diverged from its journal at step 2 of 8") == 1
    await _assert_no_journal(redis, ns)


async def test_an_eval_prompt_and_a_training_prompt_of_one_index_keep_their_journals_apart(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eval prompts are numbered from 0 (epoch 0) like a fed dataset: eval prompt 0 runs while
    training prompt 0 sits journaled at turn 4. The eval episode must neither replay the training
    journal nor delete it with its publish; the training episode then resumes at turn 4."""
    keys = Keys(ns)
    tool_log = tmp_path / "tools.log"
    # a runs one episode at a time: the eval prompt goes to e
    first, _ = await _start_blocked(redis, redis_url, ns, sim, procs, monkeypatch, tool_log,
                                    extra=("--concurrency", "1"))
    training_journal = await redis.hgetall(keys.episode(0, 0))
    assert int(training_journal[b"n:0"]) == 8
    evaluator = procs.producer(redis_url, ns, sim.url, "--generate", fn("six_turns"), name="e")
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        await consumer.evaluate("ev", ["Compute 2 + 2."], n_samples=1)  # the training prompt's text
        (result,) = await wait_until(consumer.eval_results, timeout=90, message="the eval finished")
    assert result.name == "ev" and result.samples == 1
    beat = await _published_beat(redis, ns, "e")
    assert (beat.episodes_resumed, beat.replayed_steps) == (0, 0), "the eval replayed the training journal"
    assert next(rest for pid, rest in _tool_lines(tool_log) if pid != first.pid) == "once sandbox"  # its own
    # the eval's publish left the training prompt's journal as it was
    assert await redis.hgetall(keys.episode(0, 0)) == training_journal
    evaluator.send_signal(signal.SIGTERM)  # b, not e, takes the training prompt over
    assert await wait_exit(evaluator) == 0, procs.log_of(evaluator)
    calls = sim.state.requests
    first.send_signal(signal.SIGKILL)
    assert await wait_exit(first) == -signal.SIGKILL
    assert await _finish_with_b(redis, redis_url, ns, sim, procs) in USABLE
    assert sim.state.requests == calls + 2  # the training episode resumed at turn 4 (turns 5-6 live)
    beat = await _published_beat(redis, ns, "b")
    assert (beat.episodes_resumed, beat.replayed_steps, beat.resume_diverged) == (1, 8, 0)
    await _assert_no_journal(redis, ns)


async def test_the_journal_is_removed_when_the_group_is_published_failed_and_then_dead_lettered(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=1, max_attempts=1, durable_episodes=True)
    await add_prompts(redis, ns, 1, text="Compute 1 + 1.")
    procs.producer(redis_url, ns, sim.url, "--generate", fn("fails_after_steps"), name="p")
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        taking = asyncio.create_task(consumer.take(1))  # recycles the failed group once
        try:
            await wait_until(lambda: redis.xlen(keys.dead), message="the prompt dead-lettered")
        finally:
            taking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await taking
    assert await _state_int(redis, ns, StateField.JOURNAL_STEPS) == 2 * 2 * 2  # 2 attempts x 2 members x 2 steps
    await _assert_no_journal(redis, ns)


async def test_a_resumed_episode_answered_from_its_journal_carries_its_routing_replay(
    redis: Redis, redis_url: str, ns: str, procs: ProcessPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    layers, topk, experts = moe = (4, 2, 16)
    tool_log = tmp_path / "tools.log"
    await make_namespace(redis, ns, n_samples_per_prompt=1, batch_size=1, lease_seconds=3.0, durable_episodes=True)
    await add_prompts(redis, ns, 1, text="Compute 2 + 2.")
    monkeypatch.setenv("TOOL_LOG", str(tool_log))
    monkeypatch.setenv("BLOCK_AT", "end")
    r3 = ("--generate", fn("turns_then_tool"), "--routed-experts", "x".join(map(str, moe)))
    async with SimEngine(SimConfig(seed=1, mean_tokens=16, latency_per_token=0.001, accuracy=0.5, moe=moe)) as moe_sim:
        first = procs.producer(redis_url, ns, moe_sim.url, *r3, name="a")
        await wait_until(lambda: any(rest == "final tool" for _, rest in _tool_lines(tool_log)),
                         message="every engine call journaled, in the last tool")
        assert await _state_int(redis, ns, StateField.JOURNAL_STEPS) == 5  # 3 generates, 2 observes
        steps = [msgpack.unpackb(v) for k, v in (await redis.hgetall(Keys(ns).episode(0, 0))).items()
                 if k.startswith(b"0:")]
        journaled_rows = [g[0][1][0] for step in steps for g in step.get("e") or () if g[0] is not None]
        assert len(journaled_rows) == 3  # one per engine call, each from the first row it adds
        first.send_signal(signal.SIGTERM)
        assert await wait_exit(first) == 0, procs.log_of(first)
        monkeypatch.delenv("BLOCK_AT")
        calls = moe_sim.state.requests
        procs.producer(redis_url, ns, moe_sim.url, *r3, name="b")
        async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
            async with asyncio.timeout(90):
                batch = await consumer.take(1)
            await consumer.commit(batch)
        assert moe_sim.state.requests == calls == 3  # b asked the engine nothing
    (group,) = batch.groups
    assert group.producer == "b" and group.status in USABLE
    (sample,) = group.samples
    assert sample.routed_experts is not None, "the journaled rows reach the resumed sample"
    want = [[[routed_expert(int(t), layer, k, experts) for k in range(topk)] for layer in range(layers)]
            for t in sample.tokens[:-1]]
    assert sample.routed_experts.shape == (len(sample.tokens) - 1, layers, topk)
    assert sample.routed_experts.tolist() == want  # the rows an uninterrupted run would carry
    assert sum(journaled_rows) == len(sample.tokens) - 1  # compact: no row journaled twice
    beat = await _published_beat(redis, ns, "b")
    assert (beat.episodes_resumed, beat.replayed_steps, beat.resume_diverged) == (1, 5, 0)


async def test_orphan_journals_are_swept_and_journals_of_waiting_or_running_prompts_kept(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool,
) -> None:
    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=1, batch_size=1, durable_episodes=True)
    running = await redis.xadd(keys.prompts, {"index": 0, "epoch": 0})
    deleted = await redis.xadd(keys.prompts, {"index": 1, "epoch": 0})
    await redis.xreadgroup(PRODUCERS_GROUP, "a", {keys.prompts: ">"}, count=2)  # both pending under a
    await redis.xadd(keys.retry, {"index": 2, "epoch": 0})  # returned with its journal: waiting
    journals = EpisodeJournals(redis, keys, "a")
    for index in (0, 1):
        entry = running if index == 0 else deleted
        assert await journals.append(stream=keys.prompts, entry_id=entry, index=index, epoch=0, member=0,
                                     seq=0, budget=0, step=b"s" * 10) == "ok"
    for index, epoch in ((2, 0), (0, 1), (9, 0)):  # waiting; another epoch's; a prompt long gone
        await redis.hset(keys.episode(index, epoch), mapping={"0:0": b"s" * 10, "n:0": 1, "bytes": 10})
        await redis.hincrby(keys.state, StateField.JOURNAL_BYTES, 10)
    await redis.xdel(keys.prompts, deleted)  # an operator's XDEL: pending, with no entry left
    # a bounded SCAN step at a time, from the cursor kept in the state hash, round to its start
    swept = await journals.sweep(2)
    while int(await redis.hget(keys.state, StateField.JOURNAL_SWEEP_CURSOR) or 0):  # type: ignore[misc]
        swept += await journals.sweep(2)
    assert swept == 3
    assert sorted(await _journal_keys(redis, ns)) == sorted(k.encode() for k in (keys.episode(0, 0), keys.episode(2, 0)))
    assert await _state_int(redis, ns, StateField.JOURNAL_BYTES) == 20
    assert await _state_int(redis, ns, StateField.JOURNALS_SWEPT) == 3
    assert await journals.sweep(1000) == 0  # nothing left to sweep
    snap = await snapshot(redis, keys)
    assert snap["episodes"]["journals_swept"] == 3 and snap["episodes"]["journals"] == 2
    screen = Console(width=200, record=True)
    screen.print(render(snap, plain=True))
    assert "orphan journals swept 3" in screen.export_text()

    # a producer's reclaim turn sweeps: the running prompt ends without PUBLISH (a dead-letter by hand)
    await redis.xack(keys.prompts, PRODUCERS_GROUP, running)
    await redis.xdel(keys.prompts, running)
    await redis.hset(keys.state, StateField.PAUSED, 1)  # type: ignore[misc]  # the waiting prompt stays waiting
    procs.producer(redis_url, ns, sim.url, "--reclaim-interval", "0.2", name="b")

    async def swept_by_the_producer() -> bool:
        return await _state_int(redis, ns, StateField.JOURNALS_SWEPT) == 4

    await wait_until(swept_by_the_producer, message="the producer's reclaim turn swept the orphan")
    assert await _journal_keys(redis, ns) == [keys.episode(2, 0).encode()]  # the waiting one stays


# -- the sweep checks the entry a journal names ------------------------------------------------


async def _journaled(redis: Redis, keys: Keys, stream: str, index: int, consumer: str,
                     eval_name: str | None = None, **fields: Any) -> bytes:
    """Prompt ``index`` added to ``stream`` (an eval's, with ``eval_name``), admitted by
    ``consumer`` and one step journaled."""
    entry_id = await redis.xadd(stream, {"index": index, "epoch": 0, **fields,
                                         **({} if eval_name is None else {"eval": eval_name})})
    await redis.xreadgroup(PRODUCERS_GROUP, consumer, {stream: ">"}, count=1)
    assert await EpisodeJournals(redis, keys, consumer).append(
        stream=stream, entry_id=entry_id, index=index, epoch=0, member=0, seq=0, budget=0, step=b"s" * 10,
        eval_name=eval_name) == "ok"
    return entry_id


async def _pointer(redis: Redis, keys: Keys, index: int, eval_name: str | None = None) -> tuple[str, bytes]:
    stream, entry_id = await redis.hmget(keys.episode(index, 0, eval_name), ["stream", "entry_id"])  # type: ignore[misc]
    return stream.decode(), entry_id


async def _sweep_round(journals: EpisodeJournals) -> int:
    """One full round of the sweep's SCAN (COUNT 2 a step, from the cursor to its start)."""
    keys = journals.keys
    swept = await journals.sweep(2)
    while int(await journals.redis.hget(keys.state, StateField.JOURNAL_SWEEP_CURSOR) or 0):  # type: ignore[misc]
        swept += await journals.sweep(2)
    return swept


async def test_a_journal_names_its_prompts_entry_and_follows_it_when_returned_so_the_sweep_keeps_it(
    redis: Redis, ns: str
) -> None:
    keys = Keys(ns)
    await make_namespace(redis, ns, durable_episodes=True)
    first = await _journaled(redis, keys, keys.prompts, 0, "a")
    assert await _pointer(redis, keys, 0) == (keys.prompts, first)
    # a drain returns it (prompts -> retry); b admits it and returns it again (retry -> retry)
    assert await PromptQueue(redis, keys, "a").give_back(keys.prompts, first, {"index": b"0", "epoch": b"0"})
    ((_, [(second, _)]),) = await redis.xreadgroup(PRODUCERS_GROUP, "b", {keys.retry: ">"}, count=1)
    assert await _pointer(redis, keys, 0) == (keys.retry, second)
    assert await PromptQueue(redis, keys, "b").give_back(keys.retry, second, {"index": 0, "epoch": 0})
    ((_, [(third, _)]),) = await redis.xreadgroup(PRODUCERS_GROUP, "c", {keys.retry: ">"}, count=1)
    assert await _pointer(redis, keys, 0) == (keys.retry, third)
    # d takes it over past the lease: the same entry, and d's appends name it
    await redis.xautoclaim(keys.retry, PRODUCERS_GROUP, "d", 0, start_id="0-0")
    assert await EpisodeJournals(redis, keys, "d").append(
        stream=keys.retry, entry_id=third, index=0, epoch=0, member=0, seq=1, budget=0, step=b"t") == "ok"
    assert await _pointer(redis, keys, 0) == (keys.retry, third)
    # an eval prompt's journal follows it back into the eval lane
    lane = await _journaled(redis, keys, keys.eval_prompts, 1, "a", eval_name="ev")
    assert await PromptQueue(redis, keys, "a").give_back(keys.eval_prompts, lane,
                                                          {"index": 1, "epoch": 0, "eval": "ev"})
    stream, back = await _pointer(redis, keys, 1, "ev")
    assert stream == keys.eval_prompts and back != lane and await redis.xrange(keys.eval_prompts, back, back)
    journals = EpisodeJournals(redis, keys, "d")
    assert await _sweep_round(journals) == 0
    assert len(await _journal_keys(redis, ns)) == 2
    assert await _state_int(redis, ns, StateField.JOURNAL_BYTES) == 21
    # an operator's XDEL of the entry it names: swept at the next round, the other one stays
    await redis.xdel(keys.retry, third)
    assert await _sweep_round(journals) == 1
    assert await _journal_keys(redis, ns) == [keys.episode(1, 0, "ev").encode()]
    assert await _state_int(redis, ns, StateField.JOURNAL_BYTES) == 10


async def test_the_sweep_trusts_a_pointer_and_reads_the_streams_only_for_a_journal_without_one(
    redis: Redis, ns: str
) -> None:
    keys = Keys(ns)
    await make_namespace(redis, ns, durable_episodes=True)
    deleted, older, published = [await _journaled(redis, keys, keys.prompts, i, "a") for i in (0, 1, 5)]
    # prompt 0's entry XDELed while it ran, the prompt re-added to `prompts` by hand (a new
    # attempt): the journal names the deleted entry and goes (the fed backlog is not read for it)
    await redis.xack(keys.prompts, PRODUCERS_GROUP, deleted)
    await redis.xdel(keys.prompts, deleted)
    await redis.xadd(keys.prompts, {"index": 0, "epoch": 0})
    # prompt 1 returned by an older producer (its MOVE leaves the pointer behind): kept while an
    # entry of its index waits in retry
    await redis.xack(keys.prompts, PRODUCERS_GROUP, older)
    await redis.xdel(keys.prompts, older)
    await redis.xadd(keys.retry, {"index": 1, "epoch": 0})
    # prompt 5 published by a producer without durable episodes (its journal left behind), its
    # group recycled into retry: kept, as before the pointer (the next durable publish drops it)
    assert await PromptQueue(redis, keys, "a").publish(keys.prompts, published, {"data": b"g"}) is not None
    await redis.xadd(keys.retry, {"index": 5, "epoch": 0})
    # journals written by an older version (no pointer): kept while a prompt of their index waits
    for index in (2, 9):
        await redis.hset(keys.episode(index, 0), mapping={"0:0": b"s" * 10, "n:0": 1, "bytes": 10})
        await redis.hincrby(keys.state, StateField.JOURNAL_BYTES, 10)
    await redis.xadd(keys.prompts, {"index": 2, "epoch": 0})
    # a pointer naming a stream that holds no prompts, or another prompt's entry: read whole too
    other = await redis.xadd(keys.prompts, {"index": 7, "epoch": 0})
    for index, stream, entry_id in ((3, keys.groups, b"1-1"), (4, keys.prompts, other)):
        await redis.xadd(keys.prompts, {"index": index, "epoch": 0})
        await redis.hset(keys.episode(index, 0), mapping={"0:0": b"s", "n:0": 1, "bytes": 1, "stream": stream,
                                                          "entry_id": entry_id})
        await redis.hincrby(keys.state, StateField.JOURNAL_BYTES, 1)
    assert await _sweep_round(EpisodeJournals(redis, keys, "a")) == 2
    assert sorted(await _journal_keys(redis, ns)) == sorted(keys.episode(i, 0).encode() for i in (1, 2, 3, 4, 5))
    assert await _state_int(redis, ns, StateField.JOURNAL_BYTES) == 32


async def test_the_sweep_keeps_an_eval_prompts_journal_only_while_its_own_eval_entry_is_there(
    redis: Redis, ns: str
) -> None:
    """Eval sets are numbered from 0 like the dataset: a journal is matched against the entries of
    its own lane (and eval), never against a training prompt or another eval of the same index."""
    keys = Keys(ns)
    await make_namespace(redis, ns, durable_episodes=True)
    training = await _journaled(redis, keys, keys.prompts, 0, "a")
    ev = await _journaled(redis, keys, keys.eval_prompts, 0, "a", eval_name="ev")
    gone = await _journaled(redis, keys, keys.eval_prompts, 0, "a", eval_name="gone")
    assert len({*await _journal_keys(redis, ns)}) == 3  # one prompt index, three journals
    assert (await _pointer(redis, keys, 0), await _pointer(redis, keys, 0, "ev")) == (
        (keys.prompts, training), (keys.eval_prompts, ev))
    # eval "gone" ends by hand (no PUBLISH): its journal goes, though training prompt 0 and eval
    # "ev"'s prompt 0 are both running
    await redis.xack(keys.eval_prompts, PRODUCERS_GROUP, gone)
    await redis.xdel(keys.eval_prompts, gone)
    # journals without a pointer (read against the streams whole): each kept by its own lane alone
    for index, eval_name in ((3, None), (4, "ev"), (5, "ev"), (6, "")):
        await redis.hset(keys.episode(index, 0, eval_name), mapping={"0:0": b"s", "n:0": 1, "bytes": 1})
        await redis.hincrby(keys.state, StateField.JOURNAL_BYTES, 1)
    await redis.xadd(keys.eval_prompts, {"index": 3, "epoch": 0, "eval": "ev"})  # not training prompt 3
    await redis.xadd(keys.retry, {"index": 4, "epoch": 0})  # not eval prompt 4
    await redis.xadd(keys.eval_prompts, {"index": 5, "epoch": 0, "eval": "ev"})  # eval ev's prompt 5
    await redis.xadd(keys.eval_prompts, {"index": 6, "epoch": 0})  # an older consumer's: no name
    journals = EpisodeJournals(redis, keys, "a")
    assert await _sweep_round(journals) == 3
    kept = [keys.episode(0, 0), keys.episode(0, 0, "ev"), keys.episode(5, 0, "ev"), keys.episode(6, 0, "")]
    assert sorted(await _journal_keys(redis, ns)) == sorted(k.encode() for k in kept)
    assert await _state_int(redis, ns, StateField.JOURNAL_BYTES) == 22
    # a drain gives eval ev's prompt 0 back: its journal follows it, the training one stays put
    assert await PromptQueue(redis, keys, "a").give_back(keys.eval_prompts, ev, {"index": 0, "epoch": 0, "eval": "ev"})
    assert await _pointer(redis, keys, 0) == (keys.prompts, training)
    stream, back = await _pointer(redis, keys, 0, "ev")
    assert stream == keys.eval_prompts and back != ev
    assert await _sweep_round(journals) == 0
    # the eval lane's journals are namespace keys like the others (`rollstream ns delete`)
    assert {k.encode() for k in kept} <= {k.encode() for k in await Keyspace(redis, keys).existing()}


async def test_a_journaled_prompt_among_prompts_admit_parks_keeps_its_journal(redis: Redis, ns: str) -> None:
    """ADMIT parks only entries never delivered (no journal names them); a journaled prompt of the
    capped source, admitted before and returned behind the parked ones, keeps its journal."""
    keys = Keys(ns)
    config = await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2, mix="a=1,b=1", max_backlog=4,
                                  durable_episodes=True)
    held = await _journaled(redis, keys, keys.prompts, 5, "p0", source="a")
    for index, source in ((0, "a"), (1, "a"), (2, "b")):
        await redis.xadd(keys.prompts, {"index": index, "epoch": 0, "source": source})
    await redis.hset(keys.sources, mapping={"a:backlog": 2, "a:fed": 4, "b:fed": 1})
    queue = PromptQueue(redis, keys, "p1")
    assert [e.fields[b"index"] for e in (await queue.admit(config)).entries] == [b"2"]
    assert await redis.hget(keys.state, StateField.PARKED) == b"2"  # type: ignore[misc]
    journals = EpisodeJournals(redis, keys, "p1")
    assert await _sweep_round(journals) == 0
    assert await PromptQueue(redis, keys, "p0").give_back(keys.prompts, held, {"index": 5, "epoch": 0})
    stream, entry_id = await _pointer(redis, keys, 5)
    assert stream == keys.retry and [e for e, _ in await redis.xrange(keys.retry)][-1] == entry_id
    assert await _sweep_round(journals) == 0
    assert await _journal_keys(redis, ns) == [keys.episode(5, 0).encode()]


async def test_parallel_calls_that_finish_in_another_order_on_resume_are_replayed_not_diverged(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tool_log = tmp_path / "tools.log"
    await make_namespace(redis, ns, n_samples_per_prompt=1, batch_size=1, lease_seconds=3.0, durable_episodes=True)
    await add_prompts(redis, ns, 1, text="Compute 2 + 2.")
    monkeypatch.setenv("TOOL_LOG", str(tool_log))
    monkeypatch.setenv("BLOCK_AT", "tool")
    monkeypatch.setenv("ORDER", "ba")  # journaled b first, then a
    first = procs.producer(redis_url, ns, sim.url, "--generate", fn("parallel_calls"), name="a")
    await wait_until(lambda: any(rest == "tool" for _, rest in _tool_lines(tool_log)), message="in the tool")
    assert await _state_int(redis, ns, StateField.JOURNAL_STEPS) == 4  # two calls, two observes
    first.send_signal(signal.SIGKILL)
    await wait_exit(first)
    monkeypatch.delenv("BLOCK_AT")
    monkeypatch.setenv("ORDER", "ab")  # on resume a asks first: not the next journaled step
    assert sim.state.requests == 2
    procs.producer(redis_url, ns, sim.url, "--generate", fn("parallel_calls"), name="b")
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        async with asyncio.timeout(90):
            batch = await consumer.take(1)
        await consumer.commit(batch)
    assert batch.groups[0].producer == "b" and batch.groups[0].status in USABLE
    assert sim.state.requests == 3  # only the last call is live
    beat = await _published_beat(redis, ns, "b")
    assert (beat.episodes_resumed, beat.replayed_steps, beat.resume_diverged) == (1, 4, 0)
    await _assert_no_journal(redis, ns)
