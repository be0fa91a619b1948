"""Weight versions: best-effort ``/model_info`` never breaks generation; partial rollout
continues an aborted call inside its episode under the new weights and records both versions."""

from __future__ import annotations

import asyncio
import subprocess
import time
from typing import Any

import httpx
import pytest
from conftest import ProcessPool, add_prompts, make_namespace, take_all, wait_until
from redis.asyncio import Redis
from rollstream.common.errors import EngineReplyInvalid
from rollstream.common.events import recent_events
from rollstream.common.keys import Keys
from rollstream.common.models import Group, Status
from rollstream.common.protocol import Heartbeat
from rollstream.consumer import GroupConsumer
from rollstream.producer.engine import EngineClient, EngineSettings, parse_version
from rollstream.producer.engine.parse import reply_version
from rollstream.testing.sim import SimConfig, SimEngine
from rollstream.testing.sim.simulator import detokenize
from test_staleness import stop_producers


@pytest.mark.parametrize(
    ("value", "expected"),
    [(3, 3), ("4", 4), (" 5 ", 5), ("abc", None), (None, None), (True, None), (2.0, None), ([1], None), ("", None),
     (2**63 - 1, 2**63 - 1), (str(2**63 - 1), 2**63 - 1), (2**63, None), (str(2**64), None), ("9" * 5000, None)],
)
def test_parse_version(value: Any, expected: int | None) -> None:
    assert parse_version(value) == expected


@pytest.mark.parametrize("value", [2**63, str(2**64), "9" * 5000, 10**400])
def test_a_version_out_of_range_in_a_reply_is_the_engines_fault(value: Any) -> None:
    with pytest.raises(EngineReplyInvalid, match=r"not within 0\.\.2") as caught:
        reply_version(value, "http://e/generate")
    assert caught.value.reason == "version" and len(str(caught.value)) < 300


@pytest.mark.parametrize("version", [2**64, int("9" * 30)])
async def test_an_engine_reporting_a_version_out_of_range_is_taken_out_and_nothing_is_lost(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool, version: int
) -> None:
    """One of two engines reports a version above 2^63-1 in every reply: its replies are unusable
    (the engine's fault: it is ejected, the requests go to the other), every prompt is trained
    once and no user code is blamed. Was: samples failed as the generate function's errors and a
    fatal ``GenerateBroken``, or the producer died at publish on a msgpack overflow."""
    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2)
    async with SimEngine(SimConfig(seed=11, mean_tokens=16)) as bad:
        bad.state.set_version(version)
        producer = procs.producer(redis_url, ns, sim.url, "--engine", bad.url, name="huge-version", concurrency=4)
        await add_prompts(redis, ns, 16)
        taken = await take_all(redis_url, ns, 16, 2, timeout=120)
        assert sorted(taken) == list(range(16))
        assert bad.state.requests > 0  # it was asked, and found out

    assert producer.poll() is None, procs.log_of(producer)
    assert not [e for e in await recent_events(redis, keys) if e.kind == "fatal"]
    log = procs.log_of(producer)
    assert f"engine {bad.url}: suspect -> ejected" in log and "is not within 0..2^63-1" in log, log
    assert "GenerateBroken" not in log, log


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


API_FLAGS = {
    "sglang": (),
    "vllm": ("--engine-api", "vllm"),
    # the version is read from the engine (no reply carries it): believed until an abort
    "openai": ("--engine-api", "openai", "--model", "rollstream-sim", "--model-info-ttl", "3600"),
}


async def _weight_update_mid_turn(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool, *, partial: bool,
    api: str = "sglang",
) -> tuple[Group, subprocess.Popen[bytes]]:
    """One prompt of n=2 generating; the trainer pauses, the engines abort both calls, the
    weights go to version 1, the trainer resumes: the group the trainer then takes."""
    await make_namespace(redis, ns, partial_rollout=partial, max_staleness=3)
    await add_prompts(redis, ns, 1)
    # room for the continuation's fresh plan (up to 200 more tokens) after any prefix: no truncation
    producer = procs.producer(redis_url, ns, sim.url, "--max-new-tokens", "1024", *API_FLAGS[api], concurrency=2)
    async with httpx.AsyncClient(base_url=sim.url) as http, await GroupConsumer.connect(
        redis_url, ns, "trainer"
    ) as consumer:
        await wait_until(lambda: sim.state.running == 2, timeout=20, message="both samples generating")
        await asyncio.sleep(0.3)  # some tokens accrue (any number works)
        await consumer.pause()
        await http.post("/pause_generation", json={"mode": "abort"})
        await wait_until(lambda: sim.state.stats()["aborted"] == 2, message="both calls aborted")
        await http.post("/update_weights_from_disk", json={"weight_version": "1"})
        await consumer.resume(1)
        await http.post("/continue_generation", json={})
        async with asyncio.timeout(25):
            batch = await consumer.take(1)
        await consumer.commit(batch)
    assert batch.metrics["staleness_max"] == 0  # judged by the newest token (the default rule)
    assert batch.metrics["token_lag_max"] == (1 if partial else 0)  # the continued prefix lags one version
    (group,) = batch.groups
    return group, producer


@pytest.mark.parametrize("api", ["sglang", "vllm", "openai"])
async def test_partial_rollout_continues_an_aborted_call_inside_the_episode(
    redis: Redis, redis_url: str, ns: str, slow_sim: SimEngine, procs: ProcessPool, api: str
) -> None:
    """With partial rollout on each aborted call waits for the resume and continues from its
    tokens as token input, on every API that takes it (SGLang ``input_ids``, vLLM's
    ``token_ids``, OpenAI ``prompt`` ids echoed by the engine): one group, attempt 0, nothing
    recycled, the first tokens kept as the engine sent them before the abort, both versions
    recorded per call and as per-token spans, no token lost or repeated."""
    group, producer = await _weight_update_mid_turn(redis, redis_url, ns, slow_sim, procs, partial=True, api=api)
    assert (group.index, group.attempt) == (0, 0) and group.status == Status.COMPLETED
    first_outputs = slow_sim.state.aborted_outputs
    assert len(first_outputs) == 2 and all(first_outputs), "both calls were aborted with tokens"
    for sample in group.samples:
        assert sample.weight_versions == [0, 1]
        spans = sample.weight_version_spans
        assert spans is not None and [v for _, _, v in spans] == [0, 1]
        assert spans[0][0] == 0 and spans[0][1] == spans[1][0] > 0 and spans[1][1] == sample.response_length
        kept = sample.response_tokens.tolist()[: spans[0][1]]
        assert kept in first_outputs, "the continued sample starts with the aborted call's own tokens"
        assert detokenize(sample.response_tokens.tolist()) == sample.response
        assert sample.response.count("The answer is") == 1  # continued, not restarted
        assert sample.rollout_log_probs is not None and len(sample.rollout_log_probs) == sample.response_length
    keys = Keys(ns)
    assert b"recycled_aborted" not in await redis.hgetall(keys.state)
    beat = Heartbeat.parse((await redis.hgetall(keys.producers))[next(iter(await redis.hkeys(keys.producers)))])
    assert beat.aborts_continued == 2, procs.log_of(producer)
    await stop_producers(procs)


async def test_without_partial_rollout_an_aborted_episode_is_recycled_whole(
    redis: Redis, redis_url: str, ns: str, slow_sim: SimEngine, procs: ProcessPool
) -> None:
    group, _ = await _weight_update_mid_turn(redis, redis_url, ns, slow_sim, procs, partial=False)
    # recycled whole, regenerated from scratch; a weight update's abort keeps the attempt (issue 38)
    assert (group.index, group.attempt) == (0, 0)
    assert all(s.weight_versions == [1] and "continued_from" not in s.metadata for s in group.samples)
    state = await redis.hgetall(Keys(ns).state)
    assert state[b"recycled_weight_update"] == b"1" and b"recycled_aborted" not in state
    await stop_producers(procs)


async def test_a_native_engine_with_no_version_anywhere_is_named_once(sim: SimEngine, caplog: Any) -> None:
    """SGLang replies without meta_info.weight_version and no /model_info: the client says so
    once for that engine (which API would give versions), however many replies follow."""
    import logging

    settings = EngineSettings(urls=(sim.url,), max_new_tokens=8)
    caplog.set_level(logging.WARNING, logger="rollstream.producer.engine.weights")
    async with httpx.AsyncClient(base_url=sim.url) as http, EngineClient(settings) as engine:
        await http.post("/sim/faults", json={"model_info": "absent", "report_weight_version": False})
        await engine.check_versions()  # the native API: nothing asked at start
        assert not caplog.records
        for _ in range(3):
            assert (await engine.generate(text="Compute 1 + 1")).weight_version is None
        assert engine.versions_from == "trainer at admission"
    (warning,) = [r.getMessage() for r in caplog.records]
    assert sim.url in warning and "--engine-api sglang" in warning and "nor in their replies" in warning
    assert "meta_info.weight_version" in warning
