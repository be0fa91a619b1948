"""No prompt starves unseen (issue 38 item 3): a prompt admitted at step s is trained by
s + (its generation time in steps) + 1, or its lateness is reported with the cause."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from conftest import ProcessPool, make_namespace
from redis.asyncio import Redis
from rollstream import WeightSync
from rollstream.common.codec import prompt_fields
from rollstream.common.keys import Keys
from rollstream.common.models import Group, Prompt
from rollstream.consumer import GroupConsumer, lateness
from rollstream.consumer.lateness import Late, StepClock, cause_of
from rollstream.testing.sim import SimConfig, SimEngine


def _group(index: int, admitted_ms: int, generated_ms: int, history: list[str] | None = None) -> Group:
    return Group(index=index, prompt="p", samples=[], admitted_ms=admitted_ms, generated_ms=generated_ms,
                 history=history or [])


def test_a_group_is_late_only_past_admission_plus_generation_plus_one_step() -> None:
    clock = StepClock("t", "ns", 30.0)
    clock._started_ms = 0  # the consumer started before every admission here
    for k in range(1, 11):  # takes returned at 1000, 2000, ..., 10000 ms: steps of 1 s
        clock.took(k * 1000)
    # now at step 10: admitted in step 2 (2500 ms) with a 7 s generation: deadline 2 + 7 + 1 = 10
    assert clock.late([_group(1, 2500, 7000)]) == []
    # the same prompt admitted a step earlier is one step late, the cause read from its history
    [late] = clock.late([_group(2, 1500, 7000, ["weight_update: a", "weight_update: b", "stale: c"])])
    assert (late.admitted_step, late.generation_steps, late.trained_step, late.steps) == (1, 7, 10, 1)
    assert late.cause == "weight_update" and "2 times" in late.why and "recycled as stale 1" in late.why
    # unknown admission (an older producer) or admitted before this consumer started: not judged
    assert clock.late([_group(3, 0, 7000)]) == []
    clock._started_ms = 5000
    assert clock.late([_group(4, 1500, 0)]) == []


def test_a_prompt_that_never_went_back_is_late_for_queueing() -> None:
    assert cause_of([])[0] == "queued"
    assert cause_of(["failed: x", "aborted", "failed: y"])[0] == "failed"


def test_late_groups_are_one_warning_per_interval_with_counts_and_the_worst_and_each_at_debug(
    caplog: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 49 finding 20: a long tail of groups one step late was a WARNING per group (per cause
    and interval); now one line per interval sums up every late group since the last one (how
    many, by cause, the worst), each group at DEBUG, the batch's metrics as before."""
    now = [1000.0]
    monkeypatch.setattr(lateness.time, "monotonic", lambda: now[0])
    clock = StepClock("t", "ns", 30.0)
    caplog.set_level(logging.DEBUG, logger="rollstream.consumer.group_consumer")
    tail = [Late(i, 0, 0, 0, 2, "queued", "queued: it never went back") for i in range(150)]
    worst = Late(999, 0, 0, 1, 12, "weight_update", "aborted by weight updates (9 times)")
    clock.report(tail[:1])  # the first late group is told at once
    clock.report(tail[1:100])
    now[0] += 10
    metrics, state = clock.report([*tail[100:], worst])
    assert metrics["lateness/groups"] == 51 and metrics["lateness/steps_max"] == 10
    assert metrics["lateness/worst_index"] == 999 and state["late_groups"] == 51
    now[0] += 25  # 35 s after the first line: the next one
    clock.report([])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "1 group trained late (queued 1); the worst: prompt 0 (epoch 0) trained 1 steps late" in warnings[0]
    assert "150 groups trained late in the last 35 s (queued 149, weight_update 1); the worst: prompt 999 " \
        "(epoch 0) trained 10 steps late" in warnings[1]
    assert "cause: aborted by weight updates (9 times)" in warnings[1]
    detail = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and "steps late" in r.getMessage()]
    assert len(detail) == 151


LONG = "What is 2 + 3? [reply=200]"
"""2 s at 10 ms per token: aborted by every weight update of steps much shorter than that."""


async def test_a_long_prompt_aborted_by_every_weight_update_is_reported_late_with_the_cause(
    redis: Redis, redis_url: str, ns: str, procs: ProcessPool, caplog: Any
) -> None:
    """Partial rollout off, a weight update (abort) after every step of short prompts: the long
    prompt is aborted again and again, trained only once the updates stop; its batch says it
    is late and why, take() logs it, the state hash counts it."""
    keys = Keys(ns)
    shorts = 24
    async with SimEngine(SimConfig(seed=1, latency_per_token=0.01, length_sigma=0)) as sim:
        await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=1, partial_rollout=False)
        await redis.xadd(keys.prompts, prompt_fields(Prompt(index=0, prompt=LONG, label="5")))  # type: ignore[arg-type]
        for i in range(1, shorts + 1):
            short = Prompt(index=i, prompt=f"What is {i} + 1? [reply=20]", label=str(i + 1))
            await redis.xadd(keys.prompts, prompt_fields(short))  # type: ignore[arg-type]
        procs.producer(redis_url, ns, sim.url, name="p0", concurrency=4)
        caplog.set_level(logging.WARNING, logger="rollstream.consumer.group_consumer")
        first: dict[str, float] = {}
        long_batch: dict[str, float] = {}
        async with (
            await GroupConsumer.connect(redis_url, ns, "trainer", warn_interval=0.01) as consumer,
            WeightSync([sim.url], kind="sglang") as sync,
        ):
            trained = 0
            async with asyncio.timeout(120):
                while not long_batch:
                    batch = await consumer.take(1)
                    first = first or batch.metrics
                    if batch.groups[0].index == 0:
                        long_batch = batch.metrics
                    assert await consumer.commit(batch) == 1
                    trained += 1
                    if trained < shorts:  # the last short prompts go without an update: the long one finishes
                        await sync.update(consumer, f"/weights/{trained}", trained, mode="abort")
    assert first["lateness/groups"] == 0  # the first short prompt: on time
    assert long_batch["lateness/groups"] == 1 and long_batch["lateness/weight_update"] == 1
    assert long_batch["lateness/steps_max"] >= 5
    lines = [r.getMessage() for r in caplog.records if "prompt 0 (epoch 0) trained" in r.getMessage()]
    assert lines and "cause: aborted by weight updates" in lines[0], lines
    state = await redis.hgetall(keys.state)
    assert int(state[b"late:weight_update"]) >= 1 and int(state[b"late_groups"]) >= 1


def test_the_admission_and_generation_times_travel_on_both_decoding_paths() -> None:
    from array import array

    from rollstream.common.codec import decode_group_entry, decode_prompt, encode_prompt, group_fields
    from rollstream.common.models import Sample, retry_prompt

    sample = Sample(index=0, tokens=array("i", [1, 2]), prompt_length=1, response_length=1,
                    loss_mask=array("B", b"\x01"))
    group = Group(index=3, prompt="p", samples=[sample], admitted_ms=1_700_000_000_123, generated_ms=4567)
    fields = {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in group_fields(group).items()}
    for views in (True, False):
        back = decode_group_entry(fields, views=views)
        assert (back.admitted_ms, back.generated_ms) == (1_700_000_000_123, 4567)
    prompt = retry_prompt(group, "weight_update: x")
    assert decode_prompt(encode_prompt(prompt)).admitted_ms == 1_700_000_000_123
