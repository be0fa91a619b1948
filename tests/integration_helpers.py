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
    """A slime run's args, parsed by the stand-in of slime's parser (its flags and defaults), naming
    rollstream's rollout function and data source; ``overrides`` set attributes afterwards."""
    from slime.utils.arguments import parse_args

    args = parse_args([
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--rollout-function-path", "rollstream.integrations.slime.generate_rollout",
        "--data-source-path", "rollstream.integrations.slime.RollstreamDataSource",
    ])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def miles_args(**overrides: Any) -> argparse.Namespace:
    """The same with the stand-in of miles' parser."""
    from miles.utils.arguments import parse_args

    args = parse_args([
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--rollout-function-path", "rollstream.integrations.miles.RollstreamRolloutFn",
        "--data-source-path", "rollstream.integrations.miles.RollstreamDataSource",
    ])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args
