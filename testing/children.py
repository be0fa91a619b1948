"""Child processes of a single-machine run (the demo; also the benchmarks and tests):
start ``rollstream`` commands with their output in a log file, stop them the way an operator
would (SIGTERM, a bounded wait for the drain, then SIGKILL), and wait for an engine to answer."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import httpx


def start_cli(args: Sequence[str], log: Path, *, new_session: bool = True) -> subprocess.Popen[bytes]:
    """``python -m rollstream.cli ARGS`` with stdout and stderr appended to ``log``."""
    with open(log, "ab") as handle:
        return subprocess.Popen(
            [sys.executable, "-m", "rollstream.cli", *args],
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=new_session,
        )


def stop_processes(children: Iterable[subprocess.Popen[bytes]], timeout: float = 20.0) -> None:
    """SIGTERM every live child, wait up to ``timeout`` in all for them to drain, then SIGKILL."""
    children = list(children)
    for child in children:
        if child.poll() is None:
            child.terminate()
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            child.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def wait_for_http(url: str, timeout: float = 20.0) -> None:
    """Block until ``url/health`` answers 200 (an engine or the simulator came up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        time.sleep(0.05)
    raise RuntimeError(f"no engine answered at {url}/health within {timeout} s")
