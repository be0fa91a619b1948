"""Smoke test: every benchmark's entry point runs with tiny sizes and produces its table rows."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ lives at the repository root
# Quick runs write their tables and plots to a temporary directory, not over the committed ones.
os.environ.setdefault("ROLLSTREAM_BENCH_OUT", tempfile.mkdtemp(prefix="rollstream-bench-smoke-"))
bench_main = pytest.importorskip("bench.__main__")


def test_codec_quick_produces_rows() -> None:
    (table,) = bench_main.run(["codec"], quick=True)
    assert table.name == "codec"
    assert len(table.rows) == 2
    assert "rollstream µs" in table.markdown()


@pytest.mark.timeout(60)
def test_throughput_quick_produces_rows() -> None:
    (table,) = bench_main.run(["throughput"], quick=True)
    assert [row[0] for row in table.rows] == [1, 1, 2, 2, "in-process (1 proc)"]
    assert [row[1] for row in table.rows[:2]] == ["fake (HTTP + JSON)", "none"]
    assert all(isinstance(row[2], float) and row[2] > 0 for row in table.rows)


@pytest.mark.timeout(60)
def test_take_quick_produces_rows() -> None:
    (table,) = bench_main.run(["take"], quick=True)
    assert table.name == "take"
    assert [row[1] for row in table.rows[:3]] == ["raw", "raw+decode", "take"]
    assert all(row[2] > 0 and row[5] > 0 for row in table.rows)


@pytest.mark.timeout(120)
def test_episodes_quick_produces_rows() -> None:
    table, session = bench_main.run(["episodes"], quick=True)
    assert all(row[1] > 0 for row in session.rows) and len(session.rows) == 2
    assert [row[0] for row in table.rows] == [
        "single-turn (default plug-in)", "3 turns, tool instant", "3 turns, tool sleeps 0.2 s",
    ]
    # quick windows are too short for CPU figures (psutil's clock ticks): only the rates must be there
    assert all(row[1] > 0 and row[2] > 0 for row in table.rows)
