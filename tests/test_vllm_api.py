"""vLLM's own API (``--engine-api vllm``: /inference/v1/generate with weight version spans) and the
trainer's weight sync (``rollstream.weight_sync``), on the simulator over real HTTP and real Redis.
The same paths against a real vLLM are in tests/test_vllm.py (slow)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from array import array
from typing import Any

import httpx
import pytest
from conftest import add_prompts, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common.errors import ConfigError
from rollstream.common.keys import Keys
from rollstream.common.models import Prompt, Status
from rollstream.consumer import GroupConsumer
from rollstream.producer.engine import EngineClient, EngineSettings
from rollstream.producer.rewards import PythonReward
from rollstream.producer.rollout import Rollout
from rollstream.producer.settings import ProducerSettings
from rollstream.producer.tokenizer import PromptTokenizer
from rollstream.producer.worker import Producer
from rollstream.runtime.redis_server import free_port
from rollstream.testing.sim import SimConfig, SimEngine
from rollstream.testing.sim.simulator import detokenize, tokenize
from rollstream.weight_sync import WeightSync, WeightSyncError

SLOW = SimConfig(seed=4, mean_tokens=60, length_sigma=0, latency_per_token=0.02)  # ~1.2 s per sample


def _client(url: str, **settings: Any) -> EngineClient:
    return EngineClient(EngineSettings(urls=(url,), api="vllm", max_new_tokens=256, **settings))


def _reward() -> PythonReward:
    return PythonReward(lambda sample, prompt, label: 1.0, name="one")


async def test_generate_reads_ids_logprobs_and_the_version_from_the_reply(sim: SimEngine) -> None:
    async with WeightSync([sim.url]) as sync:
        await sync.set_version(5)
    async with _client(sim.url) as client:
        generations = await client.generate_n(4, text="Compute 2 + 3.")
    assert sim.state.requests == 1, "one request for the group's n samples"
    for g in generations:
        assert len(g.output_ids) > 0 and g.log_probs is not None and len(g.log_probs) == len(g.output_ids)
        assert g.text == detokenize(g.output_ids)
        assert g.weight_version == 5
        assert g.weight_version_spans == [(5, 0, len(g.output_ids))]


async def test_a_sample_generated_across_an_update_records_both_versions_and_where(
    redis_url: str, redis: Redis, ns: str
) -> None:
    async with SimEngine(SLOW) as sim, _client(sim.url) as client:
        rollout = Rollout(client, _reward(), 2)
        run = asyncio.create_task(rollout.run(Prompt(index=0, prompt="Compute 1 + 1.", label="2"), 0))
        await wait_until(lambda: sim.state.running == 2, timeout=10, message="both samples generating")
        await asyncio.sleep(0.3)  # some tokens on version 0 (the split point is measured, not assumed)
        async with WeightSync([sim.url]) as sync:
            await sync.update(None, "/weights/step-1", 1, mode="keep")
        group = await asyncio.wait_for(run, 20)
    assert sim.state.reloads == ["/weights/step-1"]
    for sample in group.samples:
        assert sample.status == Status.COMPLETED
        assert sample.weight_versions == [0, 1], "the sample spans two versions and says so"
        spans = sample.metadata["weight_version_spans"]
        assert [v for v, _, _ in spans] == [0, 1]
        assert spans[0][1] == 0 and spans[0][2] == spans[1][1] and spans[1][2] == sample.response_length
        assert 0 < spans[0][2] < sample.response_length
        assert sample.metadata["weight_version_source"] == "engine_spans"
    assert group.min_version == 0, "staleness counts from the oldest token"


async def test_an_abort_keeps_the_partial_tokens_of_an_aborted_sample() -> None:
    """Partial rollout off: the aborted samples keep their tokens (the group is recycled)."""
    async with SimEngine(SLOW) as sim, _client(sim.url) as client:
        rollout = Rollout(client, _reward(), 2)
        run = asyncio.create_task(rollout.run(Prompt(index=0, prompt="Compute 1 + 1.", label="2"), 0))
        await wait_until(lambda: sim.state.running == 2, timeout=10, message="both samples generating")
        await asyncio.sleep(0.2)
        await client.abort_all()
        group = await asyncio.wait_for(run, 20)
    for sample in group.samples:
        assert sample.status == Status.ABORTED and sample.finish_reason == "abort"
        assert 0 < sample.response_length < 60
        assert sample.rollout_log_probs is not None and len(sample.rollout_log_probs) == sample.response_length
        assert list(sample.tokens[: sample.prompt_length]) == tokenize("Compute 1 + 1.")


def test_a_per_request_seed_is_refused_on_the_vllm_api() -> None:
    with pytest.raises(ConfigError, match="seed"):
        EngineSettings(urls=("http://x",), api="vllm", sampling_params={"seed": 1})
    assert EngineSettings(urls=("http://x",), api="vllm").request_seed is False


async def test_seed_is_sent_only_when_asked_for() -> None:
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        choice = {"index": 0, "finish_reason": "stop", "token_ids": [5], "text": "x",
                  "logprobs": {"content": [{"token": "x", "logprob": -0.1}]},
                  "weight_versions": [{"version": "2", "start": 0, "end": 1}]}
        return httpx.Response(200, json={"choices": [choice]})

    for seeded in (False, True):
        settings = EngineSettings(urls=("http://e",), api="vllm", request_seed=seeded)
        async with EngineClient(settings, transport=httpx.MockTransport(handler)) as client:
            (g,) = await client.generate_n(1, input_ids=[1, 2])
        assert g.weight_version == 2
    assert "seed" not in bodies[0]["sampling_params"] and isinstance(bodies[1]["sampling_params"]["seed"], int)


async def test_bad_spans_fail_the_sample_with_a_reason() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        choice = {"index": 0, "finish_reason": "stop", "token_ids": [5, 6], "text": "xy",
                  "logprobs": {"content": [{"logprob": -0.1}, {"logprob": -0.2}]},
                  "weight_versions": [{"version": "2", "start": 0, "end": 1}]}  # covers 1 of 2 tokens
        return httpx.Response(200, json={"choices": [choice]})

    settings = EngineSettings(urls=("http://e",), api="vllm")
    async with EngineClient(settings, transport=httpx.MockTransport(handler)) as client:
        rollout = Rollout(client, _reward(), 1)
        group = await rollout.run(Prompt(index=0, prompt="q", label="a", input_ids=array("i", [1])), 0)
    assert group.samples[0].status == Status.FAILED
    assert "spans" in (group.samples[0].error or "")


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
async def test_weight_sync_moves_engines_and_rollstream_to_the_new_version(
    kind: str, mode: str, redis_url: str, redis: Redis, ns: str
) -> None:
    await make_namespace(redis, ns)
    async with (
        SimEngine(SimConfig(seed=1)) as a,
        SimEngine(SimConfig(seed=2)) as b,
        WeightSync([a.url, b.url], kind=kind) as sync,  # type: ignore[arg-type]
        GroupConsumer.connect(redis_url, ns, "trainer") as consumer,
    ):
        report = await sync.update(consumer, "/ckpt/step-3", 3, mode=mode)  # type: ignore[arg-type]
        assert await sync.versions() == {a.url: 3, b.url: 3}
        assert await consumer.weight_version() == 3
        assert await consumer.control.weights() == ("/ckpt/step-3", 3)  # for --catch-up-engines
        assert not await consumer.control.paused()
        for sim in (a, b):
            assert not sim.state.paused
            assert sim.state.weight_version == 3
        if kind == "vllm":
            assert a.state.reloads == b.state.reloads == ["/ckpt/step-3"]
            # the KV of frozen (keep) requests is recomputed with the new weights: vLLM's default, said
            assert a.state.pauses == b.state.pauses == [(mode, "true")]
        assert report.version == 3 and "reload" in report.seconds


@pytest.mark.parametrize("partial", [False, True])
async def test_weight_sync_aborts_in_flight_work_which_is_recycled_or_continued(
    redis_url: str, redis: Redis, ns: str, partial: bool
) -> None:
    """mode=abort on the vLLM API: a group in flight comes back ABORTED and is recycled (partial
    rollout off) or continued from its tokens under the new weights (on, the default); every
    prompt is trained exactly once, the later ones on the new version."""
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2, partial_rollout=partial)
    await add_prompts(redis, ns, 4)
    async with SimEngine(SLOW) as sim, _client(sim.url) as client:
        settings = ProducerSettings(namespace=ns, concurrency=2, name="p", heartbeat_interval=0.5)
        producer = await Producer.connect(redis_url, settings, client, _reward())
        run = asyncio.create_task(producer.run())
        try:
            async with WeightSync([sim.url]) as sync, GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
                await wait_until(lambda: sim.state.running == 2, timeout=15, message="a group generating")
                await sync.update(consumer, "/ckpt/1", 1, mode="abort")
                seen: list[int] = []
                while len(seen) < 4:
                    batch = await asyncio.wait_for(consumer.take(2), 60)
                    seen += [g.index for g in batch.groups]
                    assert all(s.status == Status.COMPLETED for g in batch.groups for s in g.samples)
                    await consumer.commit(batch)
        finally:
            producer.stop()
            await asyncio.wait_for(run, 30)
            await producer.aclose()
    assert sorted(seen) == [0, 1, 2, 3]
    assert sim.state.aborted >= 2
    state = await redis.hgetall(Keys(ns).state)
    assert int(state.get(b"recycled_aborted") or 0) == 0
    if partial:  # continued inside the episode: nothing recycled, the samples span both versions
        assert int(state.get(b"recycled_weight_update") or 0) == 0
        assert producer.rollout.runtime.aborts_continued >= 2
    else:  # the pipeline's cadence (issue 38): counted apart, the attempt kept
        assert int(state.get(b"recycled_weight_update") or 0) >= 1


async def test_a_failing_engine_is_named_and_producers_stay_paused(
    redis_url: str, redis: Redis, ns: str
) -> None:
    await make_namespace(redis, ns)
    dead = f"http://127.0.0.1:{free_port()}"
    async with SimEngine(SimConfig()) as sim, GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        async with WeightSync([sim.url, dead], timeout=5) as sync:
            with pytest.raises(WeightSyncError) as caught:
                await sync.update(consumer, "/ckpt/1", 1)
        assert caught.value.engine == dead and caught.value.stage == "pause"
        assert dead in str(caught.value)
        assert await consumer.control.paused(), "a failed update leaves producers paused"
        async with WeightSync([sim.url]) as sync:
            with pytest.raises(WeightSyncError, match="reload") as failed:
                await sync.update(consumer, "/ckpt/POISON", 1)
        assert failed.value.engine == sim.url and "500" in failed.value.detail
        with pytest.raises(ConfigError):
            await WeightSync([sim.url]).update(consumer, "/x", 1, mode="later")  # type: ignore[arg-type]


class _SlowTokenizer(PromptTokenizer):
    """Loads in 0.5 s, remembering when it finished (the stand-in for a Hugging Face load)."""

    def __init__(self) -> None:
        super().__init__(tokenizer=object())
        self.loaded_at: float | None = None
        self._loaded = threading.Event()

    def load(self) -> None:
        time.sleep(0.5)
        self.loaded_at = time.time()
        self._loaded.set()

    def encode(self, text: str) -> list[int]:
        assert self._loaded.is_set(), "encode before load"
        return tokenize(text)


async def test_the_tokenizer_is_loaded_before_the_heartbeat_says_running(
    redis_url: str, redis: Redis, ns: str, sim: SimEngine
) -> None:
    await make_namespace(redis, ns)
    tokenizer = _SlowTokenizer()
    client = EngineClient(EngineSettings(urls=(sim.url,), api="vllm"), tokenizer=tokenizer)
    settings = ProducerSettings(namespace=ns, concurrency=4, name="warm", heartbeat_interval=0.2)
    producer = await Producer.connect(redis_url, settings, client, _reward())
    run = asyncio.create_task(producer.run())

    async def loaded_when_running() -> tuple[bool] | None:
        beat = json.loads((await redis.hget(Keys(ns).producers, "warm")) or "{}")
        return (tokenizer.loaded_at is not None,) if beat.get("state") == "running" else None

    try:  # no prompt is ever added: only the start-up can have loaded it
        (loaded,) = await wait_until(loaded_when_running, timeout=20, interval=0.01, message="a running heartbeat")
        assert loaded, "the heartbeat said running before the tokenizer was loaded"
    finally:
        producer.stop()
        await asyncio.wait_for(run, 30)
        await producer.aclose()
        await client.aclose()
