"""A pytest plugin that counts the assert statements the suite runs (issue 50: moving or speeding
up tests must not lose coverage). pytest's assertion rewriting calls ``pytest_assertion_pass``
for every assert that passes in a rewritten module (the test files and conftest.py)::

    rm -rf tests/__pycache__  # rewritten modules are cached without the hook
    PYTHONPATH=tests ./scripts/test -p assert_count -o enable_assertion_pass_hook=true

prints ``asserts run: N passed, M failed`` at the end. With the hook on, each passing assert
also builds its explanation: assert-heavy tests (tests/test_fuzz.py) run several times slower,
so time the suite without it."""

from __future__ import annotations

from typing import Any

import pytest

_counts = {"passed": 0, "failed": 0}


def pytest_assertion_pass(item: pytest.Item, lineno: int, orig: str, expl: str) -> None:
    _counts["passed"] += 1


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    yield
    if call.excinfo is not None and call.excinfo.errisinstance(AssertionError):
        _counts["failed"] += 1


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line(f"asserts run: {_counts['passed']} passed, {_counts['failed']} failed")
