"""``--eval-interval`` of one-flag slime and miles runs through the eval lane: real redis-server, a
real producer process, the simulator (deterministic per seed) and the stand-in rollout managers.
An eval asked at rollout k returns at once, training goes on, and its metrics come with a later
call, labelled with the versions its samples ran on; its rewards are the stock blocking eval's."""

from __future__ import annotations

import asyncio
import importlib
import json
import math
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import pytest
from conftest import ProcessPool, add_prompts, make_namespace, wait_until
from integration_helpers import miles_args, set_env, slime_args
from redis.asyncio import Redis
from rollstream.common.errors import ConfigError
from rollstream.common.keys import Keys
from rollstream.integrations.eval_calls import eval_datasets, read_items, split_name
from rollstream.testing.sim import SimConfig, SimEngine

EVAL_PROMPTS = 5
N_EVAL = 2


@pytest.fixture
async def fixed_sim() -> AsyncIterator[SimEngine]:
    config = SimConfig(seed=7, mean_tokens=16, latency_per_token=0.001, accuracy=0.5, deterministic=True)
    async with SimEngine(config) as engine:
        yield engine


def _eval_set(tmp_path: Path) -> Path:
    path = tmp_path / "arith.jsonl"
    path.write_text("".join(json.dumps({"input": f"Compute {i} + 5 and box it.", "label": str(i + 5)}) + "\n"
                            for i in range(EVAL_PROMPTS)))
    return path


def _eval_flags(sim: SimEngine, path: Path) -> dict[str, Any]:
    url = urlsplit(sim.url)
    return {
        "eval_prompt_data": ["arith", str(path)], "n_samples_per_eval_prompt": N_EVAL,
        "eval_max_response_len": 64, "eval_temperature": 0.5, "eval_top_p": 0.9, "label_key": "label",
        "rm_type": "math", "eval_interval": 1,
        "sglang_router_ip": url.hostname, "sglang_router_port": url.port,
    }


async def test_slime_eval_goes_through_the_lane_without_blocking_training(
    redis: Redis, redis_url: str, ns: str, fixed_sim: SimEngine, procs: ProcessPool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4)
    await add_prompts(redis, ns, 80)
    procs.producer(redis_url, ns, fixed_sim.url, concurrency=8)
    set_env(monkeypatch, redis_url, ns, "slime-eval", ROLLSTREAM_ENGINE_URL=fixed_sim.url)
    rollout = importlib.import_module("slime.ray.rollout")
    stock = importlib.import_module("slime.rollout.sglang_rollout")
    args = slime_args(**_eval_flags(fixed_sim, _eval_set(tmp_path)))
    stock_calls = len(stock.EVAL_CALLS)
    manager = await asyncio.to_thread(rollout.RolloutManager, args)
    await asyncio.to_thread(manager.load, -1)
    try:
        asked = await asyncio.wait_for(asyncio.to_thread(manager.eval, 0), 60)  # slime's eval before training
        assert asked.data == {}  # submitted; nothing finished yet, and the call did not wait for it
        reported = None
        rollout_id = 0
        async with asyncio.timeout(120):
            while reported is None:  # training goes on while the eval runs
                data, _ = await asyncio.to_thread(manager.generate, rollout_id)
                assert len(set(data["group_indices"])) == 4
                rollout_id += 1
                result = await asyncio.to_thread(manager.eval, rollout_id)
                if result.data:
                    reported = result
        assert len(stock.EVAL_CALLS) == stock_calls  # the stock function never ran
        assert set(reported.data) == {"arith"}
        lane = reported.data["arith"]
        metrics = reported.metrics
        assert metrics["eval/arith/rollstream/rollout_id"] == 0.0  # labelled with the rollout it was asked at
        assert metrics["eval/arith/rollstream/samples"] == EVAL_PROMPTS * N_EVAL == len(lane["rewards"])
        assert metrics["eval/arith/rollstream/weight_version_min"] == metrics["eval/arith/rollstream/weight_version_max"]
        assert metrics["eval/arith/rollstream/lag_steps"] >= 0
        # while rollout 0's eval ran, the calls in between submitted none; the reporting call did
        submitted = {k.decode() for k in await redis.hkeys(Keys(ns).evals)}
        assert submitted == {"arith@0", f"arith@{rollout_id}"}
    finally:
        await asyncio.to_thread(manager.data_source.close)

    # the stock blocking eval on the same (fixed) engine version: the same rewards, sample for sample
    blocking = await asyncio.wait_for(asyncio.to_thread(stock.generate_rollout, args, 99, None, evaluation=True), 60)
    stock_rewards = blocking.data["arith"]["rewards"]
    assert not any(math.isnan(r) for r in lane["rewards"])
    assert sum(lane["rewards"]) / len(lane["rewards"]) == sum(stock_rewards) / len(stock_rewards)
    assert lane["rewards"] == stock_rewards and lane["truncated"] == blocking.data["arith"]["truncated"]
    assert 0 < sum(stock_rewards) < len(stock_rewards)  # a set neither all right nor all wrong
    # the samples too, as slime's Sample (what --save-debug-rollout-data and the eval metrics read)
    assert [s.response for s in lane["samples"]] == [s.response for s in blocking.data["arith"]["samples"]]
    assert [s.reward for s in lane["samples"]] == lane["rewards"]
    assert all(s.weight_versions for s in lane["samples"])


async def test_miles_eval_goes_through_the_lane(
    redis: Redis, redis_url: str, ns: str, fixed_sim: SimEngine, procs: ProcessPool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4)
    await add_prompts(redis, ns, 80)
    procs.producer(redis_url, ns, fixed_sim.url, concurrency=8)
    set_env(monkeypatch, redis_url, ns, "miles-eval")
    manager_module = importlib.import_module("miles.ray.rollout.rollout_manager")
    stock = importlib.import_module("miles.rollout.inference_rollout.inference_rollout_common")
    stock_calls = len(stock.EVAL_CALLS)
    args = miles_args(**_eval_flags(fixed_sim, _eval_set(tmp_path)))
    manager = await asyncio.to_thread(manager_module.RolloutManager, args)
    try:
        assert (await asyncio.wait_for(manager.eval(3), 60)).data == {}
        reported = None
        rollout_id = 3
        async with asyncio.timeout(120):
            while reported is None:
                await manager.generate(rollout_id)
                rollout_id += 1
                result = await manager.eval(rollout_id)
                if result.data:
                    reported = result
    finally:
        await asyncio.to_thread(manager.data_source.close)
    assert len(stock.EVAL_CALLS) == stock_calls
    assert len(reported.data["arith"]["rewards"]) == len(reported.data["arith"]["samples"]) == EVAL_PROMPTS * N_EVAL
    assert type(reported.data["arith"]["samples"][0]).__module__ == "miles.utils.types"
    assert reported.metrics["eval/arith/rollstream/rollout_id"] == 3.0
    assert "eval/arith/rollstream/weight_version_min" in reported.metrics


def test_eval_datasets_from_flags(tmp_path: Path) -> None:
    path = tmp_path / "e.parquet"
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["Compute 1 + 1.", "Compute 2 + 2."], "answer": ["2", "4"]}), path)
    args = slime_args(eval_prompt_data=["p", str(path)], input_key="question", label_key="answer",
                      n_samples_per_eval_prompt=3, eval_max_response_len=32, eval_top_p=0.5)
    [dataset] = eval_datasets(args)
    assert (dataset.name, dataset.n_samples, dataset.max_new_tokens) == ("p", 3, 32)
    assert (dataset.temperature, dataset.top_p) == (None, 0.5)  # unset: the producers'
    assert [(i["prompt"], i["label"]) for i in read_items(dataset)] == [("Compute 1 + 1.", "2"), ("Compute 2 + 2.", "4")]
    assert eval_datasets(slime_args()) == []
    with pytest.raises(ConfigError, match="pairs"):
        eval_datasets(slime_args(eval_prompt_data=["a", "b", "c"]))
    with pytest.raises(ConfigError, match="without"):
        eval_datasets(slime_args(eval_prompt_data=["a@b", str(path)]))
    assert split_name("arith@12") == ("arith", 12) and split_name("arith") is None


def test_eval_datasets_from_resolved_configs(tmp_path: Path) -> None:
    """slime and miles resolve ``--eval-prompt-data`` / ``--eval-config`` into ``args.eval_datasets``
    (``EvalDatasetConfig``: per-dataset keys and sampling, None where the run's flag applies)."""
    path = tmp_path / "e.jsonl"
    path.write_text(json.dumps({"q": "Compute 3 + 3.", "a": "6", "meta": {"k": 1}}) + "\n")
    cfg = SimpleNamespace(name="aime", path=str(path), n_samples_per_eval_prompt=4, max_response_len=None,
                          input_key="q", label_key="a", metadata_key="meta", tool_key=None, apply_chat_template=True,
                          temperature=0.0, top_p=None)
    args = slime_args(eval_datasets=[cfg], eval_max_response_len=48, eval_prompt_data=["ignored", "x"])
    [dataset] = eval_datasets(args)
    assert (dataset.name, dataset.n_samples, dataset.max_new_tokens) == ("aime", 4, 48)
    assert (dataset.temperature, dataset.top_p) == (0.0, None)  # greedy is kept, not taken for unset
    [item] = read_items(dataset)
    assert item == {"prompt": [{"role": "user", "content": "Compute 3 + 3."}], "label": "6", "metadata": {"k": 1}}


async def test_a_restarted_trainer_gets_the_eval_its_predecessor_asked_for(
    redis: Redis, redis_url: str, ns: str, fixed_sim: SimEngine, procs: ProcessPool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trainer that asked for an eval dies before it finished: the next trainer process reports
    it once (not resubmitted, not reported twice)."""
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4)
    procs.producer(redis_url, ns, fixed_sim.url, concurrency=8)
    set_env(monkeypatch, redis_url, ns, "slime-eval", ROLLSTREAM_ENGINE_URL=fixed_sim.url)
    rollout = importlib.import_module("slime.ray.rollout")
    args = slime_args(**_eval_flags(fixed_sim, _eval_set(tmp_path)))
    first = await asyncio.to_thread(rollout.RolloutManager, args)
    try:
        assert (await asyncio.wait_for(asyncio.to_thread(first.eval, 0), 60)).data == {}
    finally:
        await asyncio.to_thread(first.data_source.close)
    await wait_until(lambda: _eval_groups(redis, ns, EVAL_PROMPTS), message="every eval group published")
    second = await asyncio.to_thread(rollout.RolloutManager, args)
    try:
        result = await asyncio.wait_for(asyncio.to_thread(second.eval, 0), 60)  # the same rollout asked again
        assert result.metrics["eval/arith/rollstream/rollout_id"] == 0.0
        assert len(result.data["arith"]["rewards"]) == EVAL_PROMPTS * N_EVAL
        assert {k.decode() for k in await redis.hkeys(Keys(ns).evals)} == {"arith@0"}  # not resubmitted
        again = await asyncio.wait_for(asyncio.to_thread(second.eval, 1), 60)
        assert again.data == {}  # reported once; arith@1 only just submitted
    finally:
        await asyncio.to_thread(second.data_source.close)


async def _eval_groups(redis: Redis, ns: str, count: int) -> bool:
    return int(await redis.xlen(Keys(ns).eval_groups)) >= count
