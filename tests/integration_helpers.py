"""Shared by the integration tests: the stand-in frameworks on sys.path, args, env."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest

STANDINS = Path(__file__).parent / "standins"
if str(STANDINS) not in sys.path:
    sys.path.insert(0, str(STANDINS))


def set_env(monkeypatch: pytest.MonkeyPatch, redis_url: str, ns: str, name: str = "trainer-0", **extra: str) -> None:
    monkeypatch.setenv("ROLLSTREAM_REDIS_URL", redis_url)
    monkeypatch.setenv("ROLLSTREAM_NAMESPACE", ns)
    monkeypatch.setenv("ROLLSTREAM_CONSUMER_NAME", name)
    for key, value in extra.items():
        monkeypatch.setenv(key, value)


def slime_args(**overrides: Any) -> argparse.Namespace:
    values: dict[str, Any] = {
        "rollout_batch_size": 4,
        "n_samples_per_prompt": 2,
        "data_source_path": "rollstream.integrations.slime.RollstreamDataSource",
        "rollout_function_path": "rollstream.integrations.slime.generate_rollout",
        "eval_function_path": "rollstream.integrations.slime.generate_rollout",
        "rollout_global_dataset": True,
        "update_weights_interval": 1,
        "reward_key": None,
        "sglang_router_ip": None,
        "sglang_router_port": None,
    }
    values.update(overrides)
    return argparse.Namespace(**values)


def miles_args(**overrides: Any) -> argparse.Namespace:
    values: dict[str, Any] = {
        "rollout_batch_size": 4,
        "n_samples_per_prompt": 2,
        "data_source_path": "rollstream.integrations.miles.RollstreamDataSource",
        "rollout_function_path": "rollstream.integrations.miles.RollstreamRolloutFn",
        "eval_function_path": "rollstream.integrations.miles.RollstreamRolloutFn",
        "rollout_global_dataset": True,
        "max_weight_staleness": None,
    }
    values.update(overrides)
    return argparse.Namespace(**values)
