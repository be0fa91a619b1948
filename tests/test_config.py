"""Pipeline config validation and its round trip through a Redis hash."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from rollstream.common.config import PipelineConfig
from rollstream.common.errors import ConfigError, NamespaceNotInitialized
from rollstream.common.keys import Keys, namespace_of, validate_namespace


def test_round_trip_through_redis_hash() -> None:
    config = PipelineConfig(4, 16, max_staleness=2, max_backlog=64, lease_seconds=30, max_attempts=3,
                            partial_rollout=True, admission_control=False, recycle_filtered=True)
    assert PipelineConfig.from_redis({k.encode(): v.encode() for k, v in config.to_redis().items()}) == config


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n_samples_per_prompt": 0, "batch_size": 1},
        {"n_samples_per_prompt": 1, "batch_size": -1},
        {"n_samples_per_prompt": True, "batch_size": 1},
        {"n_samples_per_prompt": 1, "batch_size": 1, "max_staleness": -1},
        {"n_samples_per_prompt": 1, "batch_size": 1, "max_backlog": 0},
        {"n_samples_per_prompt": 1, "batch_size": 1, "lease_seconds": 0.5},
        {"n_samples_per_prompt": 1, "batch_size": 1, "max_attempts": 0},
        {"n_samples_per_prompt": 1, "batch_size": 1, "admission_control": True},
    ],
)
def test_bad_config_raises_config_error(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        PipelineConfig(**kwargs)


def test_admission_defaults_on_with_max_staleness() -> None:
    assert PipelineConfig(1, 1, max_staleness=0).admission_enabled
    assert not PipelineConfig(1, 1, max_staleness=0, admission_control=False).admission_enabled
    assert not PipelineConfig(1, 1).admission_enabled


def test_mismatched_flags_are_refused_with_a_clear_message() -> None:
    config = PipelineConfig(4, 8)
    config.check_matches(n_samples_per_prompt=4, batch_size=None)
    with pytest.raises(ConfigError, match=r"n_samples_per_prompt=8.*configured with n_samples_per_prompt=4"):
        config.check_matches(n_samples_per_prompt=8)


def test_incomplete_or_garbled_config_in_redis() -> None:
    with pytest.raises(ConfigError, match="lacks"):
        PipelineConfig.from_redis({b"batch_size": b"4"})
    with pytest.raises(ConfigError, match="not a valid"):
        PipelineConfig.from_redis({b"n_samples_per_prompt": b"four", b"batch_size": b"4"})


def test_namespace_names_and_hash_tags() -> None:
    keys = Keys("exp-1")
    assert keys.prompts == "rollstream:{exp-1}:prompts"
    assert all(k.startswith("rollstream:{exp-1}:") for k in keys.all_keys())
    assert namespace_of(keys.groups) == "exp-1" and namespace_of("other:key") is None
    for bad in ("", "a b", "x{y}", "a" * 65):
        with pytest.raises(ConfigError):
            validate_namespace(bad)
    assert "rollstream init --ns exp" in str(NamespaceNotInitialized("exp"))


def _settings_errors() -> list[Callable[[], object]]:
    from rollstream.common.codec import CodecLimits
    from rollstream.producer.engine import EngineSettings
    from rollstream.producer.feeder import FeedSettings
    from rollstream.producer.rewards import load_reward
    from rollstream.producer.worker import ProducerSettings
    from rollstream.runtime.redis_server import EmbeddedRedis

    return [
        lambda: CodecLimits(max_tokens=0),
        lambda: EngineSettings(urls=()),
        lambda: FeedSettings(namespace="x", window=0),
        lambda: ProducerSettings(namespace="x", concurrency=0),
        lambda: load_reward("remote:"),
        lambda: load_reward("no-such-module:fn"),
        lambda: EmbeddedRedis(appendfsync="sometimes"),
    ]


@pytest.mark.parametrize("make", _settings_errors())
def test_every_settings_class_raises_config_error(make: Callable[[], object]) -> None:
    with pytest.raises(ConfigError):
        make()


def test_cli_prints_a_config_error_as_one_line_with_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    from rollstream.cli.main import main

    assert main(["init", "--ns", "bad name", "--n-samples", "1", "--batch-size", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rollstream: error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_version_has_one_source(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    import rollstream
    from rollstream.cli.main import main

    assert rollstream.__version__ == version("rollstream")
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.strip() == f"rollstream {rollstream.__version__}"


def test_every_redis_option_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollstream.cli.main import build_parser

    monkeypatch.setenv("ROLLSTREAM_REDIS_URL", "redis://elsewhere:6380/1")
    parser = build_parser()
    for argv in (["inspect", "--ns", "a"], ["ns", "list"], ["dead", "list", "--ns", "a"], ["pause", "--ns", "a"],
                 ["demo"]):
        assert parser.parse_args(argv).redis == "redis://elsewhere:6380/1", argv
    monkeypatch.delenv("ROLLSTREAM_REDIS_URL")
    assert build_parser().parse_args(["pause", "--ns", "a"]).redis == "redis://127.0.0.1:6379/0"
