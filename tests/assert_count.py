"""A pytest plugin that counts the assert statements the suite runs (issue 50: moving or speeding
up tests must not lose coverage). pytest's assertion rewriting calls ``pytest_assertion_pass``
for every assert that passes in a rewritten module (the test files and conftest.py)::

    PYTHONPATH=tests ./scripts/test -p assert_count -o enable_assertion_pass_hook=true

prints ``asserts run: N passed in tests/, M failed`` at the end. Only asserts of files under
``tests/`` count: pytest rewrites the asserts of installed pytest plugins too (anyio's asyncio
backend runs thousands under httpx, a number that depends on timing, not on the tests). With the
hook on, each passing assert also builds its explanation: assert-heavy tests
(tests/test_fuzz.py) run several times slower, so time the suite without it. Under pytest-xdist
each worker counts its own tests and hands its counts to the controller, which prints the sum.
A module rewritten without the hook and cached (``scripts/test`` writes bytecode) would never call
it: loaded first (in the controller, before any worker starts), the plugin deletes those caches."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

_counts = {"passed": 0, "failed": 0, "elsewhere": 0}
TESTS = str(Path(__file__).resolve().parent) + "/"

if "PYTEST_XDIST_WORKER" not in os.environ:  # pytest's rewritten modules, named *.pytest-*.pyc
    for cached in Path(TESTS).glob("**/__pycache__/*-pytest-*.pyc"):
        cached.unlink(missing_ok=True)


def pytest_assertion_pass(item: pytest.Item, lineno: int, orig: str, expl: str) -> None:
    frame = sys._getframe(1)
    for _ in range(12):  # up through pluggy's hook calls to the assert's own frame
        if frame is None:
            break
        if frame.f_code.co_filename.startswith(TESTS) and frame.f_code.co_filename != __file__:
            _counts["passed"] += 1
            return
        frame = frame.f_back
    _counts["elsewhere"] += 1


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    yield
    if call.excinfo is not None and call.excinfo.errisinstance(AssertionError):
        _counts["failed"] += 1


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller sums (pytest_testnodedown)
        workeroutput["assert_count"] = dict(_counts)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    for name, count in getattr(node, "workeroutput", {}).get("assert_count", {}).items():
        _counts[name] += count


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line(
        f"asserts run: {_counts['passed']} passed in tests/, {_counts['failed']} failed "
        f"({_counts['elsewhere']} in rewritten plugin modules, not counted)"
    )
