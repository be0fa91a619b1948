"""Every option of every command says what it does, its unit and its default (issue 43: 26
options had no help, among them the settings a new user most needs)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest
from rollstream.cli.main import build_parser
from rollstream.common.config import PipelineConfig
from rollstream.common.settings_fields import documented

NO_DEFAULT_SHOWN = (None, False, True, [], (), argparse.SUPPRESS)
TIME_WORDS = ("timeout", "interval", "lease", "latency", "after", "time", "wait", "seconds")
"""Float options whose names say they are durations: their help names the unit."""


def options() -> Iterator[tuple[str, argparse.Action]]:
    def walk(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.Action]]:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, f"{path} {name}".strip())
            elif action.option_strings and not isinstance(action, argparse._HelpAction | argparse._VersionAction):
                yield path, action

    yield from walk(build_parser(), "")


def shown_help(action: argparse.Action) -> str:
    return (action.help or "") % {**vars(action), "prog": "rollstream"}


def test_every_option_has_help() -> None:
    missing = [f"{path} {action.option_strings[0]}" for path, action in options() if not (action.help or "").strip()]
    assert not missing, f"options without help: {missing}"


def test_every_option_with_a_default_says_it() -> None:
    unsaid = []
    for path, action in options():
        default = action.default
        if any(default is d or default == d for d in NO_DEFAULT_SHOWN) or action.nargs == 0:
            continue
        text = shown_help(action)
        said = (
            (default != "" and str(default) in text) or (default == "" and "default: none" in text)
            or (isinstance(default, float) and f"{default:g}" in text) or "$" in text
        )
        if "default" not in text.lower() or not said:
            unsaid.append(f"{path} {action.option_strings[0]} (default {default!r}): {text!r}")
    assert not unsaid, "options whose help does not say their default:\n" + "\n".join(unsaid)


def test_every_duration_says_its_unit() -> None:
    unitless = [
        f"{path} {action.option_strings[0]}: {shown_help(action)!r}"
        for path, action in options()
        if action.type is float and any(word in action.dest for word in TIME_WORDS)
        and not any(unit in shown_help(action).lower() for unit in ("second", " s ", " s)", "seconds"))
    ]
    assert not unitless, "durations whose help names no unit:\n" + "\n".join(unitless)


def test_init_help_is_the_configs_own_declaration() -> None:
    """``init``'s help is derived from PipelineConfig's field docstrings, defaults included."""
    init = next(a for path, a in options() if path == "init" and a.option_strings[0] == "--max-attempts")
    assert init.help == documented(PipelineConfig, "max_attempts") and "(default: 5)" in shown_help(init)


def test_a_field_without_a_docstring_cannot_give_a_flag_help() -> None:
    with pytest.raises(LookupError, match="no docstring"):
        documented(PipelineConfig, "no_such_field")
