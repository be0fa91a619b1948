"""Weight versions: best-effort ``/model_info`` never breaks generation; partial rollout
continues an aborted sample under the new weights and records both versions."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from conftest import ProcessPool, add_prompts, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common.codec import decode_group_entry
from rollstream.common.keys import Keys
from rollstream.common.models import Status
from rollstream.consumer import GroupConsumer
from rollstream.producer.engine import EngineClient, EngineSettings, parse_version
from rollstream.testing.sim import SimConfig, SimEngine
from test_staleness import stop_producers


@pytest.mark.parametrize(
    ("value", "expected"),
    [(3, 3), ("4", 4), (" 5 ", 5), ("abc", None), (None, None), (True, None), (2.0, None), ([1], None), ("", None)],
)
def test_parse_version(value: Any, expected: int | None) -> None:
    assert parse_version(value) == expected


@pytest.mark.parametrize("mode", ["garbage", "error", "missing", "non_integer", "hang"])
async def test_model_info_faults_keep_the_cached_version(sim: SimEngine, mode: str) -> None:
    settings = EngineSettings(urls=(sim.url,), model_info_ttl=0.0, max_new_tokens=8, max_retries=0)
    async with httpx.AsyncClient(base_url=sim.url) as http, EngineClient(settings) as engine:
        await http.post("/sim/faults", json={"report_weight_version": False})
        await http.post("/update_weights_from_disk", json={"weight_version": "3"})
        assert await engine.weight_version() == 3
        await http.post("/sim/faults", json={"model_info": mode})
        await http.post("/update_weights_from_disk", json={"weight_version": "4"})
        started = time.monotonic()
        assert await engine.weight_version() == 3  # never raises, keeps the last good value
        assert time.monotonic() - started < 10  # the 2 s timeout bounds an engine hanging for 30 s
        # Generation goes on and is labelled with the cached version.
        generation = await engine.generate(text="Compute 1 + 2.")
        assert generation.weight_version == 3
        assert generation.output_ids
        # Once /model_info recovers, the new version is picked up.
        await http.post("/sim/faults", json={"model_info": "ok"})
        assert await engine.weight_version() == 4


async def test_model_info_unknown_before_any_good_answer(sim: SimEngine) -> None:
    settings = EngineSettings(urls=(sim.url,), model_info_ttl=0.0, max_new_tokens=8)
    async with httpx.AsyncClient(base_url=sim.url) as http, EngineClient(settings) as engine:
        await http.post("/sim/faults", json={"model_info": "garbage", "report_weight_version": False})
        assert await engine.weight_version() is None
        generation = await engine.generate(text="Compute 1 + 2.")
        assert generation.weight_version is None  # the producer falls back to the trainer's version


async def test_reply_version_wins_and_updates_the_cache(sim: SimEngine) -> None:
    settings = EngineSettings(urls=(sim.url,), model_info_ttl=3600.0, max_new_tokens=8)
    async with httpx.AsyncClient(base_url=sim.url) as http, EngineClient(settings) as engine:
        await http.post("/update_weights_from_disk", json={"weight_version": "6"})
        assert (await engine.generate(text="Compute 1 + 2.")).weight_version == 6
        await http.post("/sim/faults", json={"model_info": "error", "report_weight_version": False})
        assert await engine.weight_version() == 6


@pytest.fixture
async def slow_sim() -> Any:
    """Fixed-length, slow generations (200 tokens at 20 ms: four seconds) to abort mid-way, with
    time to spare on a loaded machine."""
    config = SimConfig(seed=2, mean_tokens=200, length_sigma=0.0, latency_per_token=0.02, accuracy=0.5)
    async with SimEngine(config) as engine:
        yield engine


async def test_partial_rollout_continues_aborted_samples_across_versions(
    redis: Redis, redis_url: str, ns: str, slow_sim: SimEngine, procs: ProcessPool
) -> None:
    await make_namespace(redis, ns, partial_rollout=True, max_staleness=3)
    keys = Keys(ns)
    await add_prompts(redis, ns, 1)
    procs.producer(redis_url, ns, slow_sim.url, concurrency=2)
    async with httpx.AsyncClient(base_url=slow_sim.url) as http:
        # Both samples generating; let some tokens accrue, then abort everything (version 0).
        await wait_until(lambda: slow_sim.state.running == 2, timeout=20, message="both samples generating")
        await asyncio.sleep(0.3)
        await http.post("/abort_request", json={"abort_all": True})
        await wait_until(lambda: redis.xlen(keys.groups), timeout=20, message="the aborted group")
        ((_, fields),) = await redis.xrange(keys.groups)
        aborted = decode_group_entry(fields)
        assert aborted.status == Status.ABORTED
        assert all(s.weight_versions == [0] and s.response_length > 0 for s in aborted.samples)
        # The weight update: the engine's version goes to 1, so does the trainer's.
        await http.post("/update_weights_from_disk", json={"model_path": "step-0"})
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        await consumer.set_weight_version(1)
        async with asyncio.timeout(25):
            batch = await consumer.take(1)
        await consumer.commit(batch)
    (group,) = batch.groups
    assert (group.index, group.attempt) == (0, 1)
    assert group.status in (Status.COMPLETED, Status.TRUNCATED)
    assert batch.metrics["staleness_max"] == 1
    for partial, sample in zip(aborted.samples, group.samples, strict=True):
        assert sample.tokens[: len(partial.tokens)] == partial.tokens  # continued, not regenerated
        assert sample.response_length > partial.response_length
        assert sample.response.startswith(partial.response)
        assert sample.weight_versions == [0, 1]
        assert sample.metadata["continued_from"] == partial.response_length
        assert sample.rollout_log_probs is not None and len(sample.rollout_log_probs) == sample.response_length
    state = await redis.hgetall(keys.state)
    assert state[b"recycled_aborted"] == b"1"
    await stop_producers(procs)
