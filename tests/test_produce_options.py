"""``rollstream produce``'s flags are derived from the settings tree: every flag has a field, every
field a flag or a named source, and a flag given reaches its field (converted) while one left out
gives the field's default."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from rollstream.cli.main import build_parser
from rollstream.cli.produce import ProduceOptions, produce_options
from rollstream.common.errors import ConfigError
from rollstream.common.settings_fields import walk

SHARED = {"--help", "-h", "--log-level", "--log-json", "--redis", "--redis-password-file", "--ns"}
"""The flags every Redis command shares (cli/shared_options.py), not produce's own."""


def produce_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["produce"]


def test_every_flag_has_a_field_and_every_field_a_flag_or_a_source() -> None:
    leaves = list(walk(ProduceOptions))
    undeclared = [leaf.path for leaf in leaves if leaf.option is None]
    assert not undeclared, f"fields without option()/set_by() (add their flag, or say what sets them): {undeclared}"
    unsourced = [leaf.path for leaf in leaves if leaf.flag is None and not leaf.option.source]  # type: ignore[union-attr]
    assert not unsourced, f"fields without a flag must say what sets them: {unsourced}"
    by_flag = {leaf.flag: leaf.path for leaf in leaves if leaf.flag is not None}
    assert len(by_flag) == sum(leaf.flag is not None for leaf in leaves), "two fields declare one flag"
    # an action's first option string is its flag (a BooleanOptionalAction's second, --no-X, negates it)
    own = {a.option_strings[0] for a in produce_parser()._actions if a.option_strings} - SHARED
    assert own - set(by_flag) == set(), "produce flags with no field: add them to the settings tree"
    assert set(by_flag) - own == set(), "fields whose flag produce lacks"


def test_a_flag_given_reaches_its_field_and_one_left_out_gives_the_default() -> None:
    argv = ["produce", "--ns", "n", "--engine", "http://a:1", "--engine", "http://b:1", "--concurrency", "8",
            "--reward", "math", "--max-reply-mib", "2", "--route-balance", "0.5", "--limit", "sandbox=3",
            "--no-adaptive-concurrency", "--catch-up-engines", "--routed-experts", "2x1x4", "--engine-api", "vllm",
            "--episode-timeout", "9", "--no-tokenize-prompts", "--teacher-engine", "http://t:1"]
    options = produce_options(build_parser().parse_args(argv), {})
    assert options.engine.urls == ("http://a:1", "http://b:1") and options.engine.api == "vllm"
    assert options.engine.max_reply_bytes == 2 * 2**20 and options.engine.balance == 0.5
    assert options.engine.adaptive_concurrency is False and options.engine.catch_up is True
    assert options.engine.routed_experts == (2, 1, 4)
    assert options.producer.namespace == "n" and options.producer.concurrency == 8
    assert options.producer.episodes.limits.named == {"sandbox": 3}
    assert options.producer.episodes.limits.episode_timeout == 9.0
    assert options.producer.episodes.tokenize_prompts is False
    assert options.teacher_engines == ("http://t:1",)
    for leaf in walk(ProduceOptions):  # everything else is the field's default
        if leaf.flag is not None and leaf.flag not in argv and f"--no-{leaf.flag[2:]}" not in argv:
            value = _at(options, leaf.path)
            if leaf.default is not dataclasses.MISSING and leaf.path != "producer.name":
                assert value == leaf.default, leaf.path


def test_bad_values_are_config_errors_from_the_fields_own_checks() -> None:
    base = ["produce", "--ns", "n", "--engine", "http://a:1", "--reward", "math"]
    for extra, match in ((["--concurrency", "0"], "concurrency"), (["--concurrency", "4", "--limit", "x"], "--limit"),
                         (["--concurrency", "4", "--reward-failure-limit", "0"], "reward_failure_limit"),
                         (["--concurrency", "4", "--engine-api", "openai"], "--model")):
        with pytest.raises(ConfigError, match=match):
            produce_options(build_parser().parse_args(base + extra), {})
    with pytest.raises(SystemExit):  # argparse's own error: not a number
        build_parser().parse_args([*base, "--concurrency", "many"])


def _at(tree: object, path: str) -> object:
    for name in path.split("."):
        tree = getattr(tree, name)
    return tree


def test_the_help_says_each_default_once() -> None:
    text = produce_parser().format_help()
    assert "(default 1024)" not in text  # a stored one says where it comes from first
    assert "stored rollout flags, see docs/integrations.md, else 1024" in " ".join(text.split())
    assert dataclasses.is_dataclass(ProduceOptions)
