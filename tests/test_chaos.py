"""A shortened chaos run (bench/chaos.py): producers, the trainer and Redis SIGKILLed mid-run,
then the exact accounting: every fed index committed once, dead-lettered, or still queued."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_short_chaos_run_loses_and_doubles_nothing(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "bench.chaos", "--steps", "10", "--batch-size", "4", "--n-samples", "2",
        "--producers", "3", "--concurrency", "8", "--kill-every", "1.5", "--trainer-kill-at", "2",
        "--poison", "2", "--latency-per-token", "0.01", "--mean-tokens", "32", "--timeout", "240",
        "--out", str(tmp_path / "chaos"),
    ]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "RESULT: OK" in out
    figures = dict(line.strip().split("  ", 1) for line in out.splitlines() if line.startswith("  ") and "  " in line.strip())
    assert figures["lost"].strip() == "0" and figures["duplicated"].strip() == "0"
    assert "1 trainer SIGKILL, 1 Redis SIGKILL+restart" in figures["kills survived"]
    assert figures["groups committed"].strip() == "40"
    assert "1 redelivered after the trainer kill" in figures["batches committed"]
