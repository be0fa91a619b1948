"""OpenAI-compatible engines (vLLM's /v1/completions and /v1/chat/completions) and chat prompts,
through real producer processes, the simulator over HTTP and a GroupConsumer; the retry and
abort behaviour is checked on both engine APIs behind the one ``--engine-api`` flag."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from conftest import ProcessPool, add_prompts, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common.codec import prompt_fields
from rollstream.common.keys import Keys
from rollstream.common.models import Prompt, Status
from rollstream.consumer import GroupConsumer
from rollstream.testing.sim import SimConfig, SimEngine
from rollstream.testing.sim.simulator import detokenize, render_chat, tokenize

TESTS_DIR = Path(__file__).resolve().parent
OPENAI = ("--engine-api", "openai", "--model", "rollstream-sim")
APIS = {"sglang": (), "openai": OPENAI}


async def _faults(sim: SimEngine, **faults: object) -> None:
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{sim.url}/sim/faults", json=faults)
        response.raise_for_status()


async def _heartbeat(redis: Redis, ns: str, name: str) -> dict[str, object]:
    return json.loads((await redis.hget(Keys(ns).producers, name)) or "{}")


async def _add_chat(redis: Redis, ns: str, count: int) -> list[list[dict[str, str]]]:
    chats = []
    for index in range(count):
        messages = [
            {"role": "system", "content": "Answer in a box."},
            {"role": "user", "content": f"Compute {index} + 2."},
        ]
        await redis.xadd(Keys(ns).prompts, prompt_fields(Prompt(index=index, prompt=messages, label=str(index + 2))))
        chats.append(messages)
    return chats


async def test_completions_round_trip_token_ids_and_logprobs_one_request_per_group(
    redis_url: str, redis: Redis, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=4, batch_size=3)
    await _faults(sim, model_info="missing")  # like vLLM: no weight version anywhere
    await add_prompts(redis, ns, 6)
    producer = procs.producer(redis_url, ns, sim.url, *OPENAI, name="vllm", concurrency=8)
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        await consumer.set_weight_version(3)
        batches = [await asyncio.wait_for(consumer.take(3), 120) for _ in range(2)]
        for batch in batches:
            await consumer.commit(batch)
    groups = [g for b in batches for g in b.groups]
    assert sorted(g.index for g in groups) == list(range(6)), procs.logs()
    for group in groups:
        assert len(group.samples) == 4
        prompt_ids = tokenize(group.prompt)  # the simulator's byte tokenizer
        for sample in group.samples:
            assert sample.status in (Status.COMPLETED, Status.TRUNCATED)
            assert sample.finish_reason in ("stop", "length")
            assert list(sample.tokens[: len(prompt_ids)]) == prompt_ids
            response_ids = list(sample.tokens[len(prompt_ids) :])
            assert len(response_ids) == sample.response_length > 0
            assert detokenize(response_ids) == sample.response
            assert sample.rollout_log_probs is not None and len(sample.rollout_log_probs) == sample.response_length
            assert all(lp < 0 for lp in sample.rollout_log_probs)
            assert sample.weight_versions == [3]
            assert sample.metadata["weight_version_source"] == "trainer_at_admission"
            assert "prompt_ids" not in sample.metadata
    await procs.astop_all()  # drain: every request in flight ends in a published group
    assert producer.returncode == 0, procs.log_of(producer)
    published = int(await redis.hget(Keys(ns).state, "published") or 0)
    assert sim.state.requests == published, "one /v1/completions request (n=4) per group"


@pytest.mark.parametrize("api", ["sglang", "openai"])
async def test_finish_reasons_map_on_both_apis(
    api: str, redis_url: str, redis: Redis, ns: str, procs: ProcessPool
) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=4, batch_size=4)
    await add_prompts(redis, ns, 4)
    # lengths around the limit: about 40 % of the 16 samples hit it
    async with SimEngine(SimConfig(seed=3, mean_tokens=30, length_sigma=0.5)) as sim:
        procs.producer(redis_url, ns, sim.url, *APIS[api], "--max-new-tokens", "30", name=f"fin-{api}")
        async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
            batch = await asyncio.wait_for(consumer.take(4), 120)
    samples = [s for g in batch.groups for s in g.samples]
    reasons = {s.finish_reason for s in samples}
    assert reasons == {"stop", "length"}, f"want both reasons in 16 samples, got {reasons}"
    for sample in samples:
        if sample.finish_reason == "length":
            assert sample.status == Status.TRUNCATED and sample.response_length == 30
        else:
            assert sample.status == Status.COMPLETED and sample.response.endswith("}.")


@pytest.mark.parametrize("api", ["sglang", "openai"])
async def test_engine_500s_are_retried_on_both_apis(
    api: str, redis_url: str, redis: Redis, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    await make_namespace(redis, ns)
    await _faults(sim, generate_errors=2, generate_error_status=500)
    await add_prompts(redis, ns, 2)
    producer = procs.producer(redis_url, ns, sim.url, *APIS[api], name=f"retry-{api}")
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        batch = await asyncio.wait_for(consumer.take(2), 120)
    assert sorted(g.index for g in batch.groups) == [0, 1]
    assert sim.state.faults_injected == 2
    await wait_until(
        lambda: _retries_at_least(redis, ns, f"retry-{api}", 2), timeout=10, message="2 retries in the heartbeat"
    )
    assert producer.poll() is None, procs.log_of(producer)


async def _retries_at_least(redis: Redis, ns: str, name: str, count: int) -> bool:
    beat = await _heartbeat(redis, ns, name)
    return int(beat.get("engine_retries", 0)) >= count  # type: ignore[call-overload]


@pytest.mark.parametrize("api", ["sglang", "openai"])
async def test_abort_all_recycles_the_group_on_both_apis(
    api: str, redis_url: str, redis: Redis, ns: str, procs: ProcessPool
) -> None:
    slow = SimConfig(seed=2, mean_tokens=40, length_sigma=0, latency_per_token=0.05)  # 2 s per sample
    async with SimEngine(slow) as sim:
        await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2, partial_rollout=False)
        await add_prompts(redis, ns, 2)
        procs.producer(redis_url, ns, sim.url, *APIS[api], name=f"abort-{api}", concurrency=4)
        await wait_until(lambda: sim.state.running >= 2, timeout=15, message="generation running on the sim")
        async with httpx.AsyncClient() as http:
            (await http.post(f"{sim.url}/abort_request", json={"abort_all": True})).raise_for_status()
        async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
            batch = await asyncio.wait_for(consumer.take(2), 120)
        assert sim.state.aborted >= 2
        assert batch.metrics.get("recycled_aborted", 0) >= 1 or int(
            await redis.hget(Keys(ns).state, "recycled_aborted") or 0
        ) >= 1, procs.logs()
        assert sorted(g.index for g in batch.groups) == [0, 1]
        recycled = [g for g in batch.groups if g.attempt > 0]
        assert recycled, "the aborted groups come back as a new attempt"
        assert all(s.status != Status.ABORTED for g in batch.groups for s in g.samples)


async def test_chat_prompts_on_the_openai_api_use_chat_completions(
    redis_url: str, redis: Redis, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2)
    chats = await _add_chat(redis, ns, 2)
    procs.producer(redis_url, ns, sim.url, *OPENAI, name="chat")
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        batch = await asyncio.wait_for(consumer.take(2), 120)
    for group in batch.groups:
        prompt_ids = tokenize(render_chat(chats[group.index]))  # the server's template, reported back
        for sample in group.samples:
            assert list(sample.tokens[: len(prompt_ids)]) == prompt_ids
            assert sample.response_length == len(sample.tokens) - len(prompt_ids) > 0
            assert sample.rollout_log_probs is not None and len(sample.rollout_log_probs) == sample.response_length
            assert sample.reward is not None


@pytest.mark.parametrize("api", ["sglang", "openai"])
async def test_chat_prompts_with_a_tokenizer_go_as_input_ids(
    api: str, redis_url: str, redis: Redis, ns: str, sim: SimEngine, procs: ProcessPool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(TESTS_DIR))  # the producer process imports fake_tokenizer
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2)
    chats = await _add_chat(redis, ns, 2)
    procs.producer(
        redis_url, ns, sim.url, *APIS[api], "--tokenizer", "fake_tokenizer:FakeChatTokenizer", name=f"tok-{api}"
    )
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        batch = await asyncio.wait_for(consumer.take(2), 120)
    for group in batch.groups:
        rendered = "".join(f"[FAKE]{m['role']}: {m['content']}|" for m in chats[group.index]) + "[FAKE]assistant:"
        for sample in group.samples:
            assert sample.status in (Status.COMPLETED, Status.TRUNCATED)
            assert detokenize(list(sample.tokens[: len(rendered)])) == rendered
            assert sample.response_length == len(sample.tokens) - len(rendered)


async def test_chat_prompts_on_sglang_without_tokenizer_fail_with_a_clear_reason(
    redis_url: str, redis: Redis, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2, max_attempts=1)
    await _add_chat(redis, ns, 1)
    procs.producer(redis_url, ns, sim.url, name="nochat")
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:

        async def dead() -> list[object]:
            with __import__("contextlib").suppress(TimeoutError):
                async with asyncio.timeout(0.5):
                    await consumer.take(1)
            return await redis.xrange(Keys(ns).dead)

        entries = await wait_until(dead, timeout=20, interval=0.1, message="a dead-lettered chat prompt")
    reason = b" ".join(v for _, fields in entries for k, v in fields.items() if k == b"reason").decode()
    assert "tokenizer" in reason and "openai" in reason, reason
    assert sim.state.requests == 0, "nothing was sent to /generate"


# -- issue 32, item 2: versions on the OpenAI API where the engine has them ---------------------


async def test_vllm_behind_the_openai_api_reports_its_versions_from_weight_info(
    redis_url: str, redis: Redis, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    """vLLM's OpenAI server has no /model_info but answers /weight_info (dev mode): the OpenAI
    dialect reads it like the native dialect does, and the heartbeat and inspect say so."""
    from test_inspect import inspect_json

    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2)
    await _faults(sim, model_info="vllm")
    async with httpx.AsyncClient() as http:
        (await http.post(f"{sim.url}/update_weight_version", json={"new_version": 5})).raise_for_status()
    await add_prompts(redis, ns, 4)
    producer = procs.producer(redis_url, ns, sim.url, *OPENAI, name="vllm-openai")
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        await consumer.set_weight_version(3)
        batches = [await asyncio.wait_for(consumer.take(2), 120) for _ in range(2)]
        for batch in batches:
            await consumer.commit(batch)
    samples = [s for b in batches for g in b.groups for s in g.samples]
    assert len(samples) == 8, procs.logs()
    for sample in samples:
        assert sample.weight_versions == [5], procs.log_of(producer)  # the engine's, not the trainer's 3
        assert sample.metadata.get("weight_version_source") != "trainer_at_admission"
    beat = await wait_until(
        lambda: _beat_with(redis, ns, "vllm-openai", "weight_versions_from"), message="weight_versions_from"
    )
    assert beat["weight_versions_from"] == "GET /weight_info"
    _, snap = await inspect_json(redis_url, ns)
    (row,) = [p for p in snap["producers"] if p["name"] == "vllm-openai"]
    assert row["weight_versions_from"] == "GET /weight_info"
    assert "report no weight version" not in procs.log_of(producer)


async def test_an_engine_with_no_version_anywhere_is_named_once_at_start(
    redis_url: str, redis: Redis, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    """vLLM's OpenAI server without dev mode: no version endpoint at all. The producer says so once,
    at start, naming the engine and the API that would give versions; inspect shows the source."""
    from test_inspect import run_inspect

    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2)
    await _faults(sim, model_info="absent")
    await add_prompts(redis, ns, 4)
    producer = procs.producer(redis_url, ns, sim.url, *OPENAI, name="silent")
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        await consumer.set_weight_version(2)
        for _ in range(2):
            batch = await asyncio.wait_for(consumer.take(2), 120)
            assert all(s.weight_versions == [2] for g in batch.groups for s in g.samples)
            assert all(s.metadata["weight_version_source"] == "trainer_at_admission"
                       for g in batch.groups for s in g.samples)
            await consumer.commit(batch)
    log = procs.log_of(producer)
    warnings = [line for line in log.splitlines() if "report no weight version" in line]
    assert len(warnings) == 1, log
    assert sim.url in warnings[0] and "--engine-api openai" in warnings[0]
    assert "GET /weight_info" in warnings[0] and "VLLM_SERVER_DEV_MODE" in warnings[0]
    assert "--engine-api vllm" in warnings[0]
    await wait_until(lambda: _beat_with(redis, ns, "silent", "weight_versions_from"), message="heartbeat")
    _, text = await run_inspect(redis_url, ns)
    assert "trainer at admission" in text, text


async def _beat_with(redis: Redis, ns: str, name: str, field: str) -> dict[str, object] | None:
    beat = await _heartbeat(redis, ns, name)
    return beat if beat.get(field) else None


async def test_a_resume_re_reads_the_version_before_anything_is_sent(
    redis_url: str, redis: Redis, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    """Issue 43: behind the OpenAI API the version comes from ``GET /weight_info``, cached; after a
    live update the producer labelled new samples with the cached old version. The resume (the
    control channel) now has every engine read again before a request is sent: with a cache
    believed for 60 s, every sample of the prompts fed after the resume says version 1."""
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2)
    await _faults(sim, model_info="vllm")
    producer = procs.producer(redis_url, ns, sim.url, *OPENAI, "--model-info-ttl", "60", name="resumed")
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer, httpx.AsyncClient() as http:
        await consumer.set_weight_version(0)
        await add_prompts(redis, ns, 4)
        before = [await asyncio.wait_for(consumer.take(2), 120) for _ in range(2)]
        for batch in before:
            await consumer.commit(batch)
        await consumer.pause()
        (await http.post(f"{sim.url}/update_weight_version", json={"new_version": 1})).raise_for_status()
        await consumer.resume(1)
        await add_prompts(redis, ns, 4, start=4)
        after = [await asyncio.wait_for(consumer.take(2), 120) for _ in range(2)]
        for batch in after:
            await consumer.commit(batch)
    assert {v for b in before for g in b.groups for s in g.samples for v in s.weight_versions} == {0}
    labels = [s.weight_versions for b in after for g in b.groups for s in g.samples]
    assert labels == [[1]] * 8, (labels, procs.log_of(producer))


async def test_a_version_that_moves_while_a_request_runs_is_recorded_both_ways() -> None:
    """A reply sent before a version read that changed the version is checked against a read
    after it: the versions differ and nothing says where the change fell, so the sample records
    both, oldest first, and says the split is unknown."""
    from rollstream.producer.engine import EngineClient, EngineSettings
    from rollstream.producer.outcomes import to_sample

    slow = SimConfig(seed=5, latency_per_token=0.01, mean_tokens=200, length_sigma=0.0)
    async with SimEngine(slow) as sim, httpx.AsyncClient() as http:
        await _faults(sim, model_info="vllm")
        settings = EngineSettings(urls=(sim.url,), api="openai", model="rollstream-sim", max_new_tokens=400,
                                  model_info_ttl=60.0)
        async with EngineClient(settings) as client:
            assert (await client.generate(text="Compute 1 + 2.")).weight_version == 0
            running = asyncio.create_task(client.generate(text="Compute 2 + 2."))
            await wait_until(lambda: sim.state.requests >= 2, message="the request running")
            assert not running.done()
            (await http.post(f"{sim.url}/update_weight_version", json={"new_version": 1})).raise_for_status()
            client.versions_moved()  # the pipeline's news: every engine read again, after the send
            generation = await asyncio.wait_for(running, 60)
            assert (generation.weight_version_before, generation.weight_version) == (0, 1)
            sample = to_sample(0, None, generation, admitted_version=0)
            assert sample.weight_versions == [0, 1] and sample.metadata["weight_version_split"] == "unknown"
            assert sample.oldest_version == 0  # staleness counts from the oldest, as before
            assert (await client.generate(text="Compute 3 + 2.")).weight_version == 1
