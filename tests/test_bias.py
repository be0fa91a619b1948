"""The bias ledger (issue 38 item 4): what the trainer saw against what was fed, by prompt length,
response length and attempts, per epoch; in Batch.metrics, the state hash, inspect (text and
--json), Prometheus, and a WARNING naming the bucket and the cause."""

from __future__ import annotations

import asyncio
import json
import logging
from array import array
from collections import Counter
from typing import Any

import httpx
import pytest
from conftest import ProcessPool, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common import bias
from rollstream.common.codec import prompt_fields
from rollstream.common.keys import Keys
from rollstream.common.models import Group, Prompt, Sample, Status
from rollstream.consumer import GroupConsumer
from rollstream.testing.sim import SimConfig, SimEngine
from test_inspect import run_inspect


def _group(*, response: int, status: Status = Status.COMPLETED, history: list[str] | None = None) -> Group:
    samples = [
        Sample(index=i, tokens=array("i", [1] * (10 + response)), prompt_length=10, response_length=response,
               status=status, loss_mask=array("B", b"\x01" * response))
        for i in range(2)
    ]
    return Group(index=7, prompt="p", samples=samples, epoch=3, history=history or [])


def test_buckets_are_labelled_by_their_edges() -> None:
    edges = (128, 512)
    assert [bias.bucket(v, edges) for v in (0, 127, 128, 511, 512, 10**6)] == [
        "<128", "<128", "128-511", "128-511", ">=512", ">=512"
    ]


def test_a_prompt_is_fed_once_per_dimension_whatever_becomes_of_its_attempts() -> None:
    """Aborted (partial, 40 tokens), then complete but stale (500), then trained (500): fed once
    in each dimension, its response length counted from its first complete group, its attempts
    at its end; each recycle counted."""
    life = [
        (_group(response=40, status=Status.ABORTED), "recycled"),
        (_group(response=500, history=["weight_update: ..."]), "recycled"),
        (_group(response=500, history=["weight_update: ...", "stale: staleness 2 > 1"]), "trained"),
    ]
    total: Counter[str] = Counter()
    for group, fate in life:
        total.update(bias.deltas(group, fate))
    fed = {k: v for k, v in total.items() if k.endswith(":fed")}
    assert fed == {"bias:3:prompt:<64:fed": 1, "bias:3:response:128-511:fed": 1, "bias:3:attempts:2:fed": 1}
    assert total["bias:3:response:<128:recycled"] == 1 and total["bias:3:response:128-511:recycled"] == 1
    assert total["bias:3:response:128-511:trained"] == 1 and total["bias:3:attempts:2:trained"] == 1


def test_a_named_source_is_a_dimension_and_an_unnamed_one_is_not_counted() -> None:
    named = _group(response=40)
    named.source = "math"
    assert bias.deltas(named, "trained")["bias:3:source:math:fed"] == 1
    assert not [k for k in bias.deltas(_group(response=40), "trained") if ":source:" in k]


def test_a_dead_letter_that_never_completed_is_fed_at_its_end() -> None:
    deltas = bias.deltas(_group(response=0, status=Status.FAILED, history=["failed: x"]), "dead")
    assert deltas["bias:3:response:<128:fed"] == 1 and deltas["bias:3:response:<128:dead"] == 1
    assert deltas["bias:3:attempts:1:fed"] == 1 and "bias:3:prompt:<64:fed" not in deltas


def test_an_under_trained_bucket_is_named_with_its_cause() -> None:
    fields = {"bias:0:prompt:<64:fed": 40, "bias:0:prompt:<64:trained": 40,
              "bias:0:prompt:256-1023:fed": 10, "bias:0:prompt:256-1023:trained": 2,
              "bias:0:prompt:256-1023:dead": 8, "bias:0:prompt:256-1023:recycled": 9, "other": 5}
    dimensions = bias.ledger(fields)[0]
    [line] = bias.short_buckets(0, dimensions)
    assert "prompt 256-1023" in line and "cause: dead letters (8 dead-lettered" in line
    metrics = bias.metrics(0, dimensions)
    assert metrics["bias/prompt/256-1023/fed_share"] == 0.2
    assert round(metrics["bias/prompt/256-1023/trained_share"], 3) == round(2 / 42, 3)
    # a fair bucket is not named; nor is anything before enough groups are trained
    fair = {k: v for k, v in fields.items() if "256-1023" not in k}
    assert bias.short_buckets(0, bias.ledger(fair)[0]) == []
    early = {**fields, "bias:0:prompt:<64:trained": 10}
    assert bias.short_buckets(0, bias.ledger(early)[0]) == []


def test_a_shortfall_within_chance_for_its_counts_is_not_reported_and_one_beyond_it_says_how_many() -> None:
    """Issue 49 finding 20: 3 of 5 prompts of a bucket trained among 36 of 40 is a trained share
    of 0.08 against a fed share of 0.12, below 0.8x, and a fair trainer falls that short one time in
    15: noise, not reported. The same shares over ten times the prompts are not chance."""

    def fields(scale: int) -> dict[str, int]:
        return {"bias:0:prompt:<64:fed": 35 * scale, "bias:0:prompt:<64:trained": 33 * scale,
                "bias:0:prompt:64-255:fed": 5 * scale, "bias:0:prompt:64-255:trained": 3 * scale}

    small = bias.ledger(fields(1))[0]
    bucket = small["prompt"]["64-255"]
    assert bucket.trained_share < bias.WARN_RATIO * bucket.fed_share  # the old rule's warning
    assert 0.01 < bucket.p_value() < 0.1
    assert bias.short_buckets(0, small) == []
    [line] = bias.short_buckets(0, bias.ledger(fields(10))[0])
    assert "prompt 64-255" in line and "(30 of 50 trained, 45.0 expected from the 360 groups trained of 400 " in line
    assert "p = " in line


def test_the_hypergeometric_tail_is_exact_on_small_counts_and_cheap_on_large_ones() -> None:
    assert bias.lower_tail(36, 5, 35, 4) == pytest.approx(5 / 36)  # one of 36 untrained: in the bucket 5 / 36
    assert bias.lower_tail(10, 3, 4, 0) == pytest.approx(35 / 210)  # C(7,4) / C(10,4)
    assert bias.lower_tail(10, 3, 4, -1) == 0.0 and bias.lower_tail(10, 3, 4, 3) == 1.0
    # 100,000 fed, 20% in the bucket, 50,000 trained: 3.2 standard deviations short
    assert 0.0005 < bias.lower_tail(100_000, 20_000, 50_000, 9_800) < 0.0012


LONG_POISON = "POISON " + "x" * 1100
"""A prompt the engine refuses, 1107 bytes (tokens when the producer tokenizes it, else 276): its
bucket is never trained."""


async def test_the_trainer_is_told_which_bucket_it_does_not_see_and_why(
    redis: Redis, redis_url: str, ns: str, procs: ProcessPool, caplog: Any
) -> None:
    """36 short prompts train, 8 long ones are refused by the engine and dead-lettered: the
    long bucket's trained share (0) is below 0.8x its fed share (8/44); take() warns naming the
    bucket and the dead letters, Batch.metrics, the state hash, inspect (text, --json) and the
    producer's Prometheus metrics carry the same ledger."""
    keys = Keys(ns)
    async with SimEngine(SimConfig(seed=1, mean_tokens=16, length_sigma=0, latency_per_token=0.001)) as sim:
        await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4, max_attempts=1)
        for i in range(44):
            text = LONG_POISON if i < 8 else f"Compute {i} + 1 and box it."  # first: judged by the first takes
            await redis.xadd(keys.prompts, prompt_fields(Prompt(index=i, prompt=text, label=str(i + 1))))  # type: ignore[arg-type]
        port = _free_port()
        # 8 refused prompts in a row are what they are here, not a broken engine
        procs.producer(redis_url, ns, sim.url, "--metrics-port", str(port), "--engine-failure-limit", "100", name="p0")
        caplog.set_level(logging.WARNING, logger="rollstream.consumer.group_consumer")
        metrics: dict[str, float] = {}
        async with await GroupConsumer.connect(redis_url, ns, "trainer", warn_interval=0.01) as consumer:
            trained = 0
            async with asyncio.timeout(90):
                while trained < 36:
                    batch = await consumer.take(min(4, 36 - trained))
                    trained += len(batch)
                    metrics = batch.metrics
                    assert await consumer.commit(batch) == len(batch)
            await wait_until(lambda: _dead(redis, keys, 8), message="8 long prompts dead-lettered")
        state = {k.decode(): v.decode() for k, v in (await redis.hgetall(keys.state)).items()}
        [long] = {k.split(":")[3] for k in state if k.startswith("bias:0:prompt:") and ":<64:" not in k}
        assert long in ("256-1023", "1024-4095")
        assert state[f"bias:0:prompt:{long}:fed"] == "8"
        assert state[f"bias:0:prompt:{long}:dead"] == "8"
        assert state["bias:0:prompt:<64:trained"] == "36"
        assert f"bias:0:prompt:{long}:trained" not in state
        assert metrics["bias/prompt/<64/trained_share"] == 1.0
        assert 0 < metrics[f"bias/prompt/{long}/fed_share"] <= 8 / 44
        warnings = [r.getMessage() for r in caplog.records if "does not see the dataset" in r.getMessage()]
        assert any(f"prompt {long}" in w and "cause: " in w for w in warnings), warnings
        _, out = await run_inspect(redis_url, ns, "--json")
        snap = json.loads(out)
        bucket = snap["bias"]["epochs"]["0"]["prompt"][long]
        assert bucket["fed"] == 8 and bucket["dead"] == 8 and bucket["trained"] == 0 and bucket["short"]
        assert any(f"prompt {long}" in line and "dead letters" in line for line in snap["bias"]["short"])
        assert any("does not see the dataset" in w for w in snap["health"]["warnings"])
        _, text = await run_inspect(redis_url, ns)
        assert "trained vs fed (epoch 0" in text and long in text

        async def scraped() -> str:
            async with httpx.AsyncClient() as http:
                body = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
            return body if 'dimension="prompt"' in body and 'kind="dead"' in body else ""

        body = await wait_until(scraped, message="the bias ledger in Prometheus")
        assert _gauge(body, "rollstream_bias_prompts", f'bucket="{long}"', 'kind="dead"', 'dimension="prompt"') == 8.0
        assert _gauge(body, "rollstream_bias_share", 'bucket="<64"', 'side="trained"', 'dimension="prompt"') == 1.0


async def _dead(redis: Redis, keys: Keys, count: int) -> bool:
    return await redis.xlen(keys.dead) >= count


def _gauge(body: str, name: str, *labels: str) -> float:
    for line in body.splitlines():
        if line.startswith(name + "{") and all(label in line for label in labels):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in the metrics")


def _free_port() -> int:
    from rollstream.runtime.redis_server import free_port

    return free_port()


async def test_a_cancelled_takes_hand_backs_reach_the_ledger_with_the_next_take(
    redis: Redis, redis_url: str, ns: str
) -> None:
    """A take cancelled after it recycled a failed group (asyncio.timeout around take()) loses
    no ledger count: the next take's round trip adds it."""
    from rollstream.common.codec import group_fields

    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=1)
    failed = _group(response=0, status=Status.FAILED)
    failed.epoch = 0
    await redis.xadd(keys.groups, group_fields(failed))  # type: ignore[arg-type]
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        take = asyncio.create_task(consumer.take(1))
        await wait_until(lambda: redis.xlen(keys.retry), message="the failed group recycled")
        take.cancel()
        await asyncio.gather(take, return_exceptions=True)
        assert await redis.hget(keys.state, "bias:0:prompt:<64:recycled") is None  # not added yet
        good = _group(response=40)
        good.epoch, good.index = 0, 8
        await redis.xadd(keys.groups, group_fields(good))  # type: ignore[arg-type]
        async with asyncio.timeout(30):
            batch = await consumer.take(1)
        await consumer.commit(batch)
    state = {k.decode(): v.decode() for k, v in (await redis.hgetall(keys.state)).items()}
    assert state["bias:0:prompt:<64:recycled"] == "1"
    assert state["bias:0:prompt:<64:fed"] == "2" and state["bias:0:prompt:<64:trained"] == "1"
