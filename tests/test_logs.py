"""Who wrote a log line is said once, where the object is built (``common/logs.py``), not by hand
at every call: the prefix, its escaping, the caller's line, and no hand-written prefix left."""

from __future__ import annotations

import ast
import logging
import re

import pytest
from rollstream.common.logs import Prefixed
from test_layers import ROOT, library_files

HAND_WRITTEN = re.compile(r"^(producer|consumer) %s(:| \(ns %s\))|^feeder \(ns %s\)")


def test_the_prefix_names_the_role_the_name_and_the_namespace(caplog: pytest.LogCaptureFixture) -> None:
    log = Prefixed(logging.getLogger("rollstream.test_logs"), "producer", "p%1", "demo")
    with caplog.at_level(logging.DEBUG, logger="rollstream.test_logs"):
        log.info("draining %d prompts (up to %.0f s)", 3, 30.0)
        log.warning("no arguments: 100%")
        Prefixed(logging.getLogger("rollstream.test_logs"), "feeder", namespace="ns1").info("fed %d", 2)
    assert [r.getMessage() for r in caplog.records] == [
        "producer p%1 (ns demo): draining 3 prompts (up to 30 s)",
        "producer p%1 (ns demo): no arguments: 100%",
        "feeder (ns ns1): fed 2",
    ]
    assert {r.funcName for r in caplog.records} == {"test_the_prefix_names_the_role_the_name_and_the_namespace"}


def test_a_disabled_level_formats_nothing(caplog: pytest.LogCaptureFixture) -> None:
    class Loud:
        def __str__(self) -> str:
            raise AssertionError("formatted a line nobody reads")

    log = Prefixed(logging.getLogger("rollstream.test_logs"), "consumer", "t0", "demo")
    with caplog.at_level(logging.INFO, logger="rollstream.test_logs"):
        log.debug("renewed %s", Loud())
    assert not caplog.records


def hand_written_prefixes() -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.value[:40]!r}"
        for _, path in library_files()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and HAND_WRITTEN.match(node.value)
    ]


def test_no_log_call_writes_the_prefix_by_hand() -> None:
    found = hand_written_prefixes()
    assert not found, "use the object's Prefixed logger (common/logs.py):\n" + "\n".join(found)
    assert HAND_WRITTEN.match("producer %s (ns %s): drain requested")  # what the check looks for
