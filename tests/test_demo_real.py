"""``rollstream demo --real``: the one command of the learning example (examples/tiny_grpo.py).

Without a vLLM interpreter it fails at once with a message saying how to get one (never a
traceback, never a half-built venv when ``$ROLLSTREAM_VLLM_PYTHON`` names the interpreter); with
one, it runs the checkout's example under it with every flag after ``--real`` and returns its exit
code. The learning run itself is tests/test_learning.py (slow, under the vLLM venv).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _demo(env: dict[str, str], *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollstream.cli", "demo", "--real", *flags],
        capture_output=True, text=True, timeout=120, check=False, env={**os.environ, **env},
    )


def test_without_a_vllm_interpreter_it_says_how_to_get_one(tmp_path: Path) -> None:
    run = _demo({"ROLLSTREAM_VLLM_PYTHON": str(tmp_path / "no-such-python")}, "--steps", "3")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "scripts/vllm-env" in run.stderr and "ROLLSTREAM_VLLM_PYTHON" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "no-such-python").exists()


def test_it_runs_the_example_under_the_vllm_interpreter_with_the_flags_after_real(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    fake = tmp_path / "python"
    # answers the "has vLLM?" probe (-c ...) yes; records the real run and exits 7
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-c" ]; then exit 0; fi\n'
        f'printf "%s\\n" "$@" > {calls}\n'
        "exit 7\n"
    )
    fake.chmod(0o755)
    run = _demo({"ROLLSTREAM_VLLM_PYTHON": str(fake)}, "--steps", "3", "--out", str(tmp_path / "out"), "--no-plot")
    assert run.returncode == 7, run.stdout + run.stderr
    assert calls.read_text().splitlines() == [
        str(ROOT / "examples" / "tiny_grpo.py"), "--steps", "3", "--out", str(tmp_path / "out"), "--no-plot",
    ]
