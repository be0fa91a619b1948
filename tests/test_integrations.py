"""rollstream.integrations without a pipeline: conversions, configuration errors, reward adapter."""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from typing import Any

import pytest
from integration_helpers import STANDINS, set_env, slime_args
from rollstream.common.errors import ConfigError
from rollstream.common.models import Group, Sample, Status
from rollstream.integrations import convert, environment
from rollstream.integrations.convert import MILES, SLIME, from_framework, to_framework
from rollstream.integrations.framework_rewards import is_framework_reward, load_framework_reward, reward_args
from rollstream.integrations.slime import RollstreamDataSource, generate_rollout, parse_weight_version


def _group(statuses: list[Status], *, with_mask: bool = True) -> Group:
    samples = []
    for i, status in enumerate(statuses):
        response = [100 + i, 101 + i, 102 + i][: 1 + i % 3]
        samples.append(
            Sample(
                index=i,
                tokens=[1, 2, 3, *response],
                response="abc"[: len(response)],
                response_length=len(response),
                reward={"score": 0.5, "len": float(i)} if i % 2 else float(i),
                status=status,
                finish_reason={"completed": "stop", "truncated": "length", "aborted": "abort"}.get(status.value),
                weight_versions=[3, 4][: 1 + i % 2],
                rollout_log_probs=[-0.5 * (k + 1) for k in range(len(response))],
                loss_mask=([1, 0, 1][: len(response)] if with_mask and i % 2 == 0 else None),
                metadata={"engine": "e0", "sample_key": i},
            )
        )
    return Group(
        index=7,
        prompt=[{"role": "user", "content": "2+2?"}],
        samples=samples,
        label="4",
        epoch=2,
        attempt=1,
        metadata={"rm_type": "math", "source": "gsm"},
        producer="p-0",
        history=["aborted"],
    )


@pytest.mark.parametrize("framework", [SLIME, MILES], ids=["slime", "miles"])
def test_conversion_round_trips_every_field(framework: convert.Framework) -> None:
    statuses = [Status.COMPLETED, Status.TRUNCATED, Status.ABORTED, Status.FAILED]
    group = _group(statuses)
    sample_cls = framework.sample_class()
    converted = to_framework(group, sample_cls)
    assert [type(s) for s in converted] == [sample_cls] * 4
    for fw, original in zip(converted, group.samples, strict=True):
        assert fw.group_index == 7
        assert fw.index == 7 * 4 + original.index
        assert fw.rollout_id == fw.index
        assert fw.prompt == group.prompt and fw.label == "4"
        assert fw.tokens == original.tokens.tolist()
        assert fw.tokens[: len(fw.tokens) - fw.response_length] == [1, 2, 3]
        assert fw.response == original.response and fw.response_length == original.response_length
        assert fw.reward == original.reward
        assert len(fw.loss_mask) == fw.response_length
        assert len(fw.rollout_log_probs) == fw.response_length
        assert fw.weight_versions == [str(v) for v in original.weight_versions]
        assert fw.status is sample_cls.Status[original.status.name]
        assert fw.metadata["rm_type"] == "math" and fw.metadata["sample_key"] == original.index
    assert [s.status for s in converted] == [
        sample_cls.Status.COMPLETED, sample_cls.Status.TRUNCATED, sample_cls.Status.ABORTED, sample_cls.Status.FAILED,
    ]
    assert converted[1].loss_mask == [1] * converted[1].response_length  # none sent: all ones
    back = from_framework(converted)
    assert back == group
    for a, b in zip(back.samples, group.samples, strict=True):
        assert a == b


def test_conversion_of_a_mask_over_the_whole_sequence_and_bad_lengths() -> None:
    sample_cls = SLIME.sample_class()
    group = _group([Status.COMPLETED])
    group.samples[0].loss_mask = [0, 0, 0, 1]  # prompt + response
    (fw,) = to_framework(group, sample_cls)
    assert fw.loss_mask == [1]
    group.samples[0].loss_mask = [1, 1]
    with pytest.raises(ValueError, match="loss_mask has 2 entries"):
        to_framework(group, sample_cls)
    group = _group([Status.COMPLETED])
    group.samples[0].rollout_log_probs = [0.0, 0.0]
    with pytest.raises(ValueError, match="rollout log-probs"):
        to_framework(group, sample_cls)


def test_training_refuses_samples_without_prompt_ids() -> None:
    group = _group([Status.COMPLETED])
    group.samples[0].metadata["prompt_ids"] = "unknown"
    to_framework(group, SLIME.sample_class())  # fine for a reward
    with pytest.raises(ConfigError, match="--tokenizer"):
        to_framework(group, SLIME.sample_class(), for_training=True)


def test_pending_framework_sample_is_refused() -> None:
    sample_cls = SLIME.sample_class()
    with pytest.raises(ValueError, match="pending"):
        from_framework([sample_cls(group_index=0, index=0, tokens=[1], status=sample_cls.Status.PENDING)])


@pytest.mark.parametrize(
    ("missing", "text"),
    [
        # without a URL the run starts its own pipeline, from its flags (tests/test_one_flag.py)
        ("ROLLSTREAM_REDIS_URL", "--prompt-data is not set"),
        ("ROLLSTREAM_NAMESPACE", "ROLLSTREAM_NAMESPACE is not set"),
        ("ROLLSTREAM_CONSUMER_NAME", "ROLLSTREAM_CONSUMER_NAME is not set"),
    ],
)
def test_missing_environment_variable_is_named(monkeypatch: pytest.MonkeyPatch, missing: str, text: str) -> None:
    set_env(monkeypatch, "redis://localhost:1/0", "ns1")
    monkeypatch.delenv(missing)
    with pytest.raises(ConfigError, match=text):
        RollstreamDataSource(slime_args())


@pytest.mark.parametrize(
    ("name", "value", "text"),
    [
        ("ROLLSTREAM_REDIS_URL", "localhost:6379", "not a redis://"),
        ("ROLLSTREAM_NAMESPACE", "bad ns!", "ROLLSTREAM_NAMESPACE: invalid namespace"),
        ("ROLLSTREAM_TAKE_TIMEOUT", "soon", "ROLLSTREAM_TAKE_TIMEOUT='soon'"),
        ("ROLLSTREAM_KEEP_CHECKPOINTS", "0", "ROLLSTREAM_KEEP_CHECKPOINTS='0'"),
        ("ROLLSTREAM_ALLOW_JOURNAL_GAP", "yes", "ROLLSTREAM_ALLOW_JOURNAL_GAP='yes'"),
    ],
)
def test_malformed_environment_variable_is_named(name: str, value: str, text: str) -> None:
    env = {"ROLLSTREAM_REDIS_URL": "redis://h:1/0", "ROLLSTREAM_NAMESPACE": "ns", "ROLLSTREAM_CONSUMER_NAME": "t"}
    env[name] = value
    with pytest.raises(ConfigError, match=text):
        environment.Settings.from_env(env)


def test_settings_defaults() -> None:
    env = {"ROLLSTREAM_REDIS_URL": "redis://h:1/0", "ROLLSTREAM_NAMESPACE": "ns", "ROLLSTREAM_CONSUMER_NAME": "t"}
    got = environment.Settings.from_env(env)
    assert (got.keep_checkpoints, got.take_timeout, got.eval_function, got.allow_journal_gap) == (2, None, None, False)


def test_rollout_function_needs_the_rollstream_data_source() -> None:
    with pytest.raises(ConfigError, match=r"--data-source-path rollstream\.integrations\.slime\.RollstreamDataSource"):
        generate_rollout(slime_args(), 0, object())


def test_data_source_refuses_prompt_traffic(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, "redis://localhost:1/0", "ns1")
    source = RollstreamDataSource(slime_args())
    with pytest.raises(RuntimeError, match="rollstream feed"):
        source.get_samples(4)
    with pytest.raises(RuntimeError, match="recycles"):
        source.add_samples([[]])
    assert len(source) == 0


@pytest.mark.parametrize(
    ("payload", "expected"),
    [({"weight_version": "12"}, 12), ({"weight_version": 3}, 3), ({"weight_version": "abc"}, None),
     ({}, None), ([], None), ({"weight_version": True}, None), ({"weight_version": -1}, None)],
)
def test_parse_weight_version(payload: Any, expected: int | None) -> None:
    assert parse_weight_version(payload) == expected


def test_framework_reward_specs() -> None:
    assert is_framework_reward("slime:user_rm.rm")
    assert is_framework_reward("miles-group:user_rm:group_rm")
    assert not is_framework_reward("user_rm:rm")
    assert not is_framework_reward("slime:")


async def test_slime_reward_is_called_with_slime_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_REWARD_ARGS", '{"scale": 2.0}')
    group = _group([Status.COMPLETED, Status.TRUNCATED])
    reward = load_framework_reward("slime:user_rm.rm")
    group.samples[0].response = "it is 4"
    rewards = await reward.score(group.prompt, group.label, group.samples, metadata=group.metadata)
    assert rewards == [2.0, 0.0]
    user_rm = importlib.import_module("user_rm")
    assert user_rm.CALLS[-1].metadata["rm_type"] == "math"
    per_group = load_framework_reward("slime-group:user_rm.group_rm")
    assert await per_group.score(group.prompt, group.label, group.samples) == [0.0, 1.0]


async def test_the_one_reward_loader_builds_framework_rewards_by_their_registered_scheme() -> None:
    from rollstream.integrations.framework_rewards import FrameworkReward
    from rollstream.producer.rewards import load_reward, schemes

    assert {"math", "remote", "slime", "slime-group", "miles", "miles-group"} <= set(schemes())
    reward = load_reward("slime-group:user_rm.group_rm", timeout=7)
    assert isinstance(reward, FrameworkReward) and reward.per_group and reward.deadline == 7
    group = _group([Status.COMPLETED, Status.TRUNCATED])
    assert await reward.score(group.prompt, group.label, group.samples) == [0.0, 1.0]
    with pytest.raises(ConfigError, match="must look like"):
        load_reward("slime:")


def test_reward_args_must_be_a_json_object(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_REWARD_ARGS", "[1]")
    with pytest.raises(ConfigError, match="ROLLSTREAM_REWARD_ARGS"):
        reward_args()
    monkeypatch.setenv("ROLLSTREAM_REWARD_ARGS", "{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        reward_args()
    monkeypatch.setenv("ROLLSTREAM_REWARD_ARGS", '{"rm_type": "math"}')
    assert reward_args() == argparse.Namespace(custom_rm_path=None, rm_type="math", rm_url=None, reward_key=None)


def test_framework_reward_without_the_framework_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "slime" or m.startswith("slime.")] + ["slime", "slime.utils.types"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ConfigError, match="slime package is not importable on this producer node"):
        load_framework_reward("slime:user_rm.rm")


def test_produce_cli_refuses_a_slime_reward_without_slime() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(STANDINS / "nowhere")
    done = subprocess.run(
        [sys.executable, "-m", "rollstream.cli", "produce", "--redis", "redis://127.0.0.1:1/0", "--ns", "x",
         "--engine", "http://127.0.0.1:1", "--concurrency", "1", "--reward", "slime:user_rm.rm"],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert done.returncode != 0
    assert "slime package is not importable on this producer node" in done.stderr + done.stdout


def test_slime_counted_weight_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without an engine answer: 1 + (rollout_id - first rollout of the process) // --update-weights-interval."""
    from rollstream.integrations.slime import counted_version, trainer_version

    set_env(monkeypatch, "redis://localhost:1/0", "ns1", ROLLSTREAM_ENGINE_URL="http://127.0.0.1:9")
    source = RollstreamDataSource(slime_args())
    args = slime_args(update_weights_interval=2)
    source.first_rollout_id = 0
    assert [counted_version(args, source, r) for r in range(5)] == [1, 1, 2, 2, 3]
    source.session.loaded_from = 9  # resumed after checkpoint 9: this process starts at 10
    assert counted_version(args, source, 10) == 1 and counted_version(args, source, 13) == 2
    assert trainer_version(args, source, 13) == (2, False)  # nobody listens on port 9
    source.close()


def test_one_flag_runs_have_partial_rollout_on_unless_the_environment_turns_it_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rollstream.integrations.flags import PARTIAL_ROLLOUT, partial_rollout, pipeline_config

    args = slime_args()
    assert args.partial_rollout is False  # slime's own default, which cannot say "off"
    assert partial_rollout(args, {})
    monkeypatch.delenv(PARTIAL_ROLLOUT, raising=False)
    assert pipeline_config(args).partial_rollout
    monkeypatch.setenv(PARTIAL_ROLLOUT, "0")
    assert not pipeline_config(args).partial_rollout
    assert partial_rollout(args, {PARTIAL_ROLLOUT: "1"})
    assert not partial_rollout(args, {PARTIAL_ROLLOUT: "0"})
    assert partial_rollout(slime_args(partial_rollout=True), {PARTIAL_ROLLOUT: "0"})  # asked for by the run's flag
    with pytest.raises(ConfigError, match=PARTIAL_ROLLOUT):
        partial_rollout(args, {PARTIAL_ROLLOUT: "maybe"})
