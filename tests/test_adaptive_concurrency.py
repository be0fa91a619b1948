"""Adaptive concurrency (producer/engine/load.py): each engine's in-flight limit from its own load."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import httpx
import pytest
from conftest import ProcessPool, add_prompts, make_namespace, take_all, wait_until
from redis.asyncio import Redis
from rollstream.common.keys import Keys
from rollstream.common.models import Prompt
from rollstream.producer.engine import EngineClient, EngineSettings
from rollstream.producer.engine.dialects import DIALECTS
from rollstream.producer.engine.load import DECREASE, AdaptiveLimit, EngineLoad, parse_metrics
from rollstream.producer.rewards import PythonReward
from rollstream.producer.rollout import Rollout
from rollstream.testing.sim import SimConfig, SimEngine

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 12.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-0.6B"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-0.6B"} 5.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.97
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.2
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 7.0
vllm:num_preemptions_total{engine="1",model_name="Qwen/Qwen3-0.6B"} 1.0
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="Qwen/Qwen3-0.6B"} 2.0
vllm:num_requests_running_but_not_this{engine="0"} 99.0
"""


def test_vllm_metrics_sum_over_engine_cores_and_take_the_fullest_cache() -> None:
    assert parse_metrics(VLLM_METRICS) == EngineLoad(running=15, waiting=5, kv_usage=0.97, preemptions=8.0)


def sglang_load(path: str, raw: bytes) -> EngineLoad | None:
    """The load in a reply of ``path`` as the SGLang dialect declares it read."""
    (endpoint,) = [e for e in DIALECTS["sglang"].loads if e.path == path]
    return endpoint.parse(raw)


def test_sglang_load_endpoints_in_both_forms_and_metrics() -> None:
    assert [e.path for e in DIALECTS["sglang"].loads] == ["/v1/loads", "/get_load", "/metrics"]
    loads = {"timestamp": 1.0, "dp_rank_count": 2, "loads": [
        {"dp_rank": 0, "num_running_reqs": 4, "num_waiting_reqs": 1, "token_usage": 0.5},
        {"dp_rank": 1, "num_running_reqs": 6, "num_waiting_reqs": 0, "token_usage": 0.7},
    ]}
    assert sglang_load("/v1/loads", json.dumps(loads).encode()) == EngineLoad(10, 1, 0.7, None)
    old = [{"dp_rank": 0, "num_reqs": 9, "num_waiting_reqs": 2, "num_tokens": 300}]
    assert sglang_load("/get_load", json.dumps(old).encode()) == EngineLoad(7, 2, None, None)
    text = "sglang:num_running_reqs{name=\"m\"} 3\nsglang:num_queue_reqs{name=\"m\"} 4\nsglang:token_usage{name=\"m\"} 0.5\n"
    assert sglang_load("/metrics", text.encode()) == EngineLoad(3, 4, 0.5, None)


@pytest.mark.parametrize("raw", [b"<html>", b"{}", b"[]", b'[{"dp_rank": 0}]', b'{"loads": [{"num_running_reqs": -1}]}',
                                 b"[1, 2]", b'[{"num_reqs": true, "num_waiting_reqs": 0}]'])
def test_unusable_load_replies_are_none(raw: bytes) -> None:
    assert sglang_load("/v1/loads", raw) is None


def test_metrics_without_load_gauges_or_with_garbage_values_are_none() -> None:
    assert parse_metrics("# nothing\nprocess_cpu_seconds_total 3.0\n") is None
    assert parse_metrics("vllm:num_requests_running{a=\"b\"} nan\nvllm:kv_cache_usage_perc -1\n") is None


def test_the_limit_starts_at_the_floor_doubles_then_is_cut_below_what_the_engine_runs() -> None:
    limit = AdaptiveLimit(4)
    assert limit.limit == 4
    assert limit.update(EngineLoad(4, 0, 0.05, 0.0), in_flight=4, held=True, now=0.0, round_trip=None)
    assert limit.limit == 8  # slow start: the cache is far from full
    assert not limit.update(EngineLoad(8, 0, 0.05, 0.0), in_flight=3, held=False, now=0.1, round_trip=None)
    assert limit.limit == 8  # nothing was held back: no reason to raise
    limit.update(EngineLoad(8, 0, 0.1, 0.0), in_flight=8, held=True, now=0.2, round_trip=None)
    assert limit.limit == 16
    assert not limit.update(EngineLoad(12, 4, 1.0, 3.0), in_flight=16, held=True, now=0.3, round_trip=None)
    assert limit.limit == int(12 * DECREASE)  # preempted: cut below what the engine runs
    cut = limit.limit
    limit.update(EngineLoad(10, 0, 0.99, 5.0), in_flight=cut, held=True, now=0.4, round_trip=10.0)
    assert limit.limit == cut  # a second cut waits a round trip (the first one shows only as requests end)
    limit.update(EngineLoad(10, 0, 0.6, 5.0), in_flight=cut, held=True, now=0.5, round_trip=10.0)
    assert limit.limit == cut  # and so does a raise
    assert limit.update(EngineLoad(10, 0, 0.6, 5.0), in_flight=cut, held=True, now=11.0, round_trip=10.0)
    assert cut < limit.limit <= cut * 1.25


def test_an_engine_without_kv_usage_is_not_limited() -> None:
    limit = AdaptiveLimit(4)
    assert limit.update(EngineLoad(7, 2, None, None), in_flight=4, held=True, now=0.0, round_trip=None)
    assert limit.limit is None


def _kv_sim() -> SimConfig:
    """About 12 requests' tokens fit (64-token prompts + ~96 output tokens in 2,048)."""
    return SimConfig(seed=5, mean_tokens=96, length_sigma=0.3, latency_per_token=0.002, max_running=256,
                     kv_capacity_tokens=2048, prefill_per_token=0.0001)


async def _roll(client: EngineClient, groups: int, in_flight: int) -> list[str]:
    rollout = Rollout(client, PythonReward(lambda s, p, lab: 1.0, name="one"), 4)
    gate = asyncio.Semaphore(in_flight // 4)

    async def one(i: int) -> str:
        async with gate:
            group = await rollout.run(Prompt(index=i, prompt=f"{i:04d} " + "x" * 58 + " 1+1?"), admitted_version=0)
            return ",".join(s.status.value for s in group.samples)

    return await asyncio.gather(*(one(i) for i in range(groups)))


async def test_an_engine_that_preempts_gets_fewer_requests_than_the_producer_could_send() -> None:
    """The producer could send 64 samples; the engine holds about 12 in its KV cache. With the
    option its limit comes down to what the engine runs, the engine stops queueing most of them,
    and every sample still completes; without it the engine holds all 64 (the routing before)."""
    peaks = {}
    for adaptive in (False, True):
        async with SimEngine(_kv_sim()) as sim, httpx.AsyncClient() as http:
            settings = EngineSettings(urls=(sim.url,), max_new_tokens=512, adaptive_concurrency=adaptive,
                                      load_interval=0.05)
            async with EngineClient(settings) as client:
                roll = asyncio.ensure_future(_roll(client, 48, 64))
                peak = 0
                while not roll.done():
                    stats = (await http.get(f"{sim.url}/sim/stats")).json()
                    if client.fleet_status()[0].get("limit", 0) < 64:  # once it has settled
                        peak = max(peak, stats["running"] + stats["waiting"])
                    await asyncio.sleep(0.02)
                statuses = await roll
                status = client.fleet_status()[0]
        assert all(s == "completed,completed,completed,completed" for s in statuses)
        peaks[adaptive] = peak
        if adaptive:
            assert status["limit"] < 64 and 0 <= status["kv_usage"] <= 1, status
        else:
            assert "limit" not in status
    assert peaks[True] < peaks[False] / 2, peaks


async def test_an_engine_without_load_endpoints_is_driven_as_without_the_option() -> None:
    async with SimEngine(_kv_sim()) as sim, httpx.AsyncClient() as http:
        await http.post(f"{sim.url}/sim/faults", json={"load_endpoints": False})
        settings = EngineSettings(urls=(sim.url,), max_new_tokens=512, load_interval=0.05)
        async with EngineClient(settings) as client:
            await _roll(client, 16, 64)
            assert "limit" not in client.fleet_status()[0]
            assert client.fleet.engines[sim.url].load_path == ""
        assert (await http.get(f"{sim.url}/sim/stats")).json()["max_running_seen"] > 12


async def test_a_producer_reports_each_engines_limit_and_kv_usage(
    redis: Redis, redis_url: str, ns: str, procs: ProcessPool
) -> None:
    """A real producer process on a KV-limited engine: every prompt trained once, and its heartbeat
    (what inspect and the metrics show) carries the engine's adaptive limit and KV usage."""
    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=4, batch_size=4)
    await add_prompts(redis, ns, 24)
    async with SimEngine(_kv_sim()) as sim:
        procs.producer(redis_url, ns, sim.url, "--health-interval", "0.2", name="adaptive", concurrency=64)

        async def limited() -> dict[str, object] | None:
            beat = json.loads((await redis.hget(keys.producers, "adaptive")) or "{}")
            fleet = beat.get("engine_fleet") or [{}]
            return fleet[0] if "limit" in fleet[0] and "kv_usage" in fleet[0] else None

        engine = await wait_until(limited, timeout=60)
        taken = await take_all(redis_url, ns, 24, 4, timeout=180)
    assert Counter(taken) == Counter(range(24))
    assert 4 <= int(engine["limit"]) <= 64  # type: ignore[call-overload]


async def test_an_engine_whose_load_gives_no_answer_is_not_held_at_the_floor() -> None:
    """A first load reading that times out (an engine that accepts and never answers it) leaves
    the engine unlimited rather than at the floor: its health is the monitor's other business."""
    writers: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)  # accepts, never answers

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        settings = EngineSettings(urls=(url,), health_timeout=0.3)
        async with EngineClient(settings) as client:
            engine = client.fleet.engines[url]
            assert engine.limit == settings.concurrency_floor
            await client.monitor.read_load(engine)
            assert engine.limit is None and engine.load_path == ""
    finally:
        for writer in writers:
            writer.close()
        server.close()
