"""Routing replay (R3) and teacher log-probs: from the engine's reply to the trainer, token by token."""

from __future__ import annotations

import asyncio
import base64
import json
from array import array
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import ProcessPool, add_prompts, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common.models import Prompt, Sample, Status
from rollstream.consumer import GroupConsumer
from rollstream.producer.engine import EngineClient, EngineReplyInvalid, EngineSettings
from rollstream.producer.engine import sglang as replies
from rollstream.producer.rewards import PythonReward
from rollstream.producer.rollout import Rollout
from rollstream.producer.teacher import TeacherScorer
from rollstream.testing.sim.simulator import SimConfig, SimEngine, routed_expert, teacher_logprob

MOE = (4, 2, 16)


def _b64(values: list[int]) -> str:
    return base64.b64encode(array("i", values).tobytes()).decode()


def test_decode_routed_experts_packs_and_checks_the_reply() -> None:
    values = [e % 16 for e in range(3 * 4 * 2)]
    packed = replies.decode_routed_experts(_b64(values), 4, 2, 16)
    assert packed.shape == (3, 4, 2) and packed.typecode == "B" and packed.data.tolist() == values
    assert replies.decode_routed_experts(_b64([300] * 8), 4, 2, 512).typecode == "H"
    with pytest.raises(EngineReplyInvalid, match="not base64"):
        replies.decode_routed_experts("!!!", 4, 2, 16)
    with pytest.raises(EngineReplyInvalid, match="whole number"):
        replies.decode_routed_experts(_b64([1] * 7), 4, 2, 16)
    with pytest.raises(EngineReplyInvalid, match=r"expert id 16 outside 0\.\.15"):
        replies.decode_routed_experts(_b64([16] * 8), 4, 2, 16)
    with pytest.raises(EngineReplyInvalid, match="expert id -1"):
        replies.decode_routed_experts(_b64([-1] * 8), 4, 2, 16)


def test_parse_teacher_checks_every_scored_token() -> None:
    tokens = array("i", [5, 6, 7, 8])
    reply = json.dumps({"meta_info": {"input_token_logprobs": [[-1.0, 6, None], [-2.0, 7, None], [-3.0, 8, None]]}})
    assert replies.parse_teacher(reply.encode(), tokens, 2).tolist() == [-2.0, -3.0]
    wrong = json.dumps({"meta_info": {"input_token_logprobs": [[-1.0, 6, None], [-2.0, 9, None]]}})
    with pytest.raises(EngineReplyInvalid, match="teacher_mismatch"):
        replies.parse_teacher(wrong.encode(), tokens, 2)
    with pytest.raises(EngineReplyInvalid, match="teacher_count"):
        replies.parse_teacher(reply.encode(), tokens, 4)
    null = json.dumps({"meta_info": {"input_token_logprobs": [[None, 7, None], [-3.0, 8, None]]}})
    with pytest.raises(EngineReplyInvalid, match="null"):
        replies.parse_teacher(null.encode(), tokens, 2)


class SplicingEngine:
    """An SGLang-like engine whose continuation replay starts at ``routed_experts_start_len``."""

    def __init__(self, finish: str = "stop", start_len: int | None = None) -> None:
        self.finish = finish
        self.start_len = start_len
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": [7, 8, 9]})
        if request.url.path != "/generate":
            return httpx.Response(404)
        body = json.loads(request.content)
        self.bodies.append(body)
        output = [100 + len(self.bodies), 101 + len(self.bodies)]
        tokens = [*body["input_ids"], *output]
        start = self.start_len if self.start_len is not None else 0
        rows = [routed_expert(t, layer, k, 16) for t in tokens[start:-1] for layer in range(4) for k in range(2)]
        meta = {"finish_reason": {"type": self.finish}, "weight_version": "1",
                "output_token_logprobs": [[-0.5, t, None] for t in output], "routed_experts": _b64(rows)}
        if start:
            meta["routed_experts_start_len"] = start
        return httpx.Response(200, json={"text": "ab", "output_ids": output, "meta_info": meta})


def _rollout(engine: Any, partial: bool = False) -> Rollout:
    settings = EngineSettings(urls=("http://e",), max_new_tokens=16, routed_experts=MOE)
    client = EngineClient(settings, transport=httpx.MockTransport(engine))
    reward = PythonReward(lambda sample, prompt, label: 1.0, name="one")
    return Rollout(client, reward, 1, partial_rollout=partial)


def _check_rows(sample: Sample) -> None:
    assert sample.routed_experts is not None
    experts = sample.routed_experts.numpy()
    assert experts.shape == (len(sample.tokens) - 1, 4, 2)
    for r, token in enumerate(sample.tokens[:-1]):
        assert experts[r].tolist() == [[routed_expert(token, layer, k, 16) for k in range(2)] for layer in range(4)], r


async def test_a_continuation_splices_a_partial_replay_onto_the_prefix_rows() -> None:
    first = (await _rollout(SplicingEngine(finish="abort")).run(Prompt(index=0, prompt="hi"), 0)).samples[0]
    assert first.status == Status.ABORTED
    _check_rows(first)
    engine = SplicingEngine(start_len=len(first.tokens) - 1)
    retry = Prompt(index=0, prompt="hi", attempt=1, input_ids=[7, 8, 9], partial=[first])
    sample = (await _rollout(engine, partial=True).run(retry, 0)).samples[0]
    assert sample.status == Status.COMPLETED and len(sample.tokens) == len(first.tokens) + 2
    _check_rows(sample)


async def test_a_replay_that_does_not_line_up_fails_the_sample() -> None:
    first = (await _rollout(SplicingEngine(finish="abort")).run(Prompt(index=0, prompt="hi"), 0)).samples[0]
    engine = SplicingEngine(start_len=len(first.tokens) + 5)  # more rows skipped than the prefix holds
    retry = Prompt(index=0, prompt="hi", attempt=1, input_ids=[7, 8, 9], partial=[first])
    sample = (await _rollout(engine, partial=True).run(retry, 0)).samples[0]
    assert sample.status == Status.FAILED and sample.error is not None and "routed_experts_start_len" in sample.error


async def test_a_missing_replay_is_an_invalid_reply() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": [7]})
        return httpx.Response(200, json={"text": "a", "output_ids": [1], "meta_info": {
            "finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.5, 1, None]]}})

    group = await _rollout(handler).run(Prompt(index=0, prompt="hi"), 0)
    assert group.status == Status.FAILED and "enable-return-routed-experts" in (group.samples[0].error or "")


@pytest.fixture
async def teacher_sim() -> AsyncIterator[SimEngine]:
    async with SimEngine(SimConfig(seed=3)) as engine:
        yield engine


async def test_the_teacher_scores_every_response_token(teacher_sim: SimEngine) -> None:
    async with SimEngine(SimConfig(seed=1, mean_tokens=30, moe=MOE)) as policy:
        settings = EngineSettings(urls=(policy.url,), max_new_tokens=64, routed_experts=MOE)
        teacher = TeacherScorer(EngineClient(dataclasses_replace(settings, urls=(teacher_sim.url,))))
        async with EngineClient(settings) as client, teacher:
            reward = PythonReward(lambda sample, prompt, label: 1.0, name="one")
            rollout = Rollout(client, reward, 3, teacher=teacher)
            group = await rollout.run(Prompt(index=0, prompt="Compute 2 + 3."), 0)
    assert group.status in (Status.COMPLETED, Status.TRUNCATED)
    for sample in group.samples:
        _check_teacher(sample)
        _check_rows_sim(sample)
    assert teacher.scored == 3


async def test_a_teacher_that_refuses_fails_the_sample(teacher_sim: SimEngine) -> None:
    settings = EngineSettings(urls=(teacher_sim.url,), max_new_tokens=8)
    async with TeacherScorer(EngineClient(settings)) as teacher:
        poisoned = Sample(index=0, tokens=list(b"POISON ab"), response_length=2, prompt_length=7)
        no_prompt = Sample(index=1, tokens=[1, 2], response_length=2, prompt_length=0)
        await teacher.score([poisoned, no_prompt])
    assert poisoned.status == Status.FAILED and poisoned.error is not None and poisoned.error.startswith("teacher:")
    assert no_prompt.status == Status.FAILED and "prompt token ids" in (no_prompt.error or "")


def dataclasses_replace(settings: EngineSettings, **changes: Any) -> EngineSettings:
    import dataclasses

    return dataclasses.replace(settings, routed_experts=None, **changes)


def _check_teacher(sample: Sample) -> None:
    assert sample.teacher_log_probs is not None and len(sample.teacher_log_probs) == sample.response_length
    tokens = sample.tokens
    start = sample.prompt_length
    for i, lp in enumerate(sample.teacher_log_probs):
        assert lp == teacher_logprob(tokens[start + i - 1], tokens[start + i]), i


def _check_rows_sim(sample: Sample) -> None:
    layers, topk, experts = MOE
    assert sample.routed_experts is not None
    got = sample.routed_experts.numpy()
    assert got.shape == (len(sample.tokens) - 1, layers, topk)
    tokens = np.frombuffer(sample.tokens, dtype=np.int32)[:-1]
    want = np.array([[[routed_expert(int(t), layer, k, experts) for k in range(topk)] for layer in range(layers)]
                     for t in tokens])
    np.testing.assert_array_equal(got, want.reshape(got.shape))


@pytest.fixture
async def slow_moe_sim() -> AsyncIterator[SimEngine]:
    """Fixed-length, slow generations (200 tokens at 5 ms: one second) to abort mid-way, with R3."""
    config = SimConfig(seed=2, mean_tokens=200, length_sigma=0.0, latency_per_token=0.005, accuracy=0.5, moe=MOE)
    async with SimEngine(config) as engine:
        yield engine


async def test_r3_and_teacher_log_probs_stay_aligned_across_a_partial_rollout(
    redis: Redis, redis_url: str, ns: str, slow_moe_sim: SimEngine, teacher_sim: SimEngine, procs: ProcessPool
) -> None:
    await make_namespace(redis, ns, partial_rollout=True)
    await add_prompts(redis, ns, 1)
    procs.producer(redis_url, ns, slow_moe_sim.url, "--routed-experts", "4x2x16", "--teacher-engine", teacher_sim.url,
                   concurrency=2)
    async with httpx.AsyncClient(base_url=slow_moe_sim.url) as http:
        await wait_until(lambda: slow_moe_sim.state.running == 2, timeout=30, message="both samples generating")
        await asyncio.sleep(0.3)  # at least 0.3 s of tokens (60) before the abort
        await http.post("/abort_request", json={"abort_all": True})
    # Partial rollout on: each aborted call is continued inside its episode (the pipeline is not
    # paused, so at once) and the group is published whole, in its first attempt.
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        async with asyncio.timeout(60):
            batch = await consumer.take(1)
        (group,) = batch.groups
        assert (group.index, group.attempt) == (0, 0) and group.status in (Status.COMPLETED, Status.TRUNCATED)
        for sample in group.samples:
            assert len(sample.weight_versions) == 2  # the aborted request and its continuation
            spans = sample.weight_version_spans
            assert spans is not None and len(spans) == 2 and spans[0][0] == 0 and spans[-1][1] == sample.response_length
            assert spans[0][1] == spans[1][0] > 0  # the continuation starts where the abort stopped
            _check_rows_sim(sample)  # every row, the continued ones included, routes its own token
            _check_teacher(sample)  # every response token, on both sides of the continuation
            assert sample.rollout_log_probs is not None and len(sample.rollout_log_probs) == sample.response_length
        views = batch.routed_experts_numpy()
        assert all(v is not None and v.dtype == np.uint8 and not v.flags.writeable for v in views)
        teacher = batch.teacher_log_probs_numpy()
        assert [len(t) for t in teacher if t is not None] == [s.response_length for s in group.samples]
        await consumer.commit(batch)
    await procs.astop_all()




def test_the_images_of_a_chat_prompt_are_its_multimodal_inputs() -> None:
    from rollstream.common.models import multimodal_of

    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                                             {"type": "text", "text": "what?"}, {"type": "image", "image": "b.png"}]}]
    assert multimodal_of(messages) == {"images": ["data:image/png;base64,AA==", "b.png"]}
    assert multimodal_of("text", ["c.png"]) == {"images": ["c.png"]}
    assert multimodal_of("text") is None


async def test_a_prompt_with_images_sends_them_and_carries_them_to_the_group() -> None:
    engine = SplicingEngine()
    prompt = Prompt(index=0, prompt="describe", input_ids=[7, 8], multimodal_inputs={"images": ["a.png"]})
    group = await _rollout(engine).run(prompt, 0)
    assert engine.bodies[0]["image_data"] == ["a.png"]
    assert group.multimodal_inputs == {"images": ["a.png"]}


async def test_engine_stats_sum_over_a_continuation_when_asked_for() -> None:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": [7, 8, 9]})
        if request.url.path != "/generate":
            return httpx.Response(404)
        calls.append(1)
        finish = "abort" if len(calls) == 1 else "stop"
        return httpx.Response(200, json={"text": "a", "output_ids": [1, 2], "meta_info": {
            "finish_reason": {"type": finish}, "output_token_logprobs": [[-0.5, 1, None], [-0.5, 2, None]],
            "cached_tokens": 2, "prompt_tokens": 3 + 2 * (len(calls) - 1), "completion_tokens": 2,
            "spec_accept_token_num": 1, "spec_draft_token_num": 2, "spec_verify_ct": 1, "weight_version": "0"}})

    def make(stats: bool, partial: bool = False) -> Rollout:
        settings = EngineSettings(urls=("http://e",), max_new_tokens=16, engine_stats=stats)
        client = EngineClient(settings, transport=httpx.MockTransport(handler))
        return Rollout(client, PythonReward(lambda s, p, lab: 1.0, name="one"),
                       1, partial_rollout=partial)

    first = (await make(True).run(Prompt(index=0, prompt="hi"), 0)).samples[0]
    assert first.prefix_cache_info == {"cached_tokens": 2, "total_prompt_tokens": 3}
    retry = Prompt(index=0, prompt="hi", attempt=1, input_ids=[7, 8, 9], partial=[first])
    sample = (await make(True, partial=True).run(retry, 0)).samples[0]
    assert sample.prefix_cache_info == {"cached_tokens": 4, "total_prompt_tokens": 8}
    assert sample.spec_info == {"spec_accept_token_num": 2, "spec_draft_token_num": 4, "spec_verify_ct": 2,
                                "completion_token_num": 4}
    calls.clear()
    plain = (await make(False).run(Prompt(index=1, prompt="hi"), 0)).samples[0]
    assert plain.prefix_cache_info is None and plain.spec_info is None  # off by default: wire format v2
