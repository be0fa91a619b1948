"""The process helpers every local child is started and awaited with (runtime/children.py): the
embedded Redis, the supervisor, the Mooncake cluster and the vLLM server share them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from rollstream.runtime.children import WorkDir, spawn, wait_until


def test_spawn_appends_the_childs_output_to_its_log_and_gives_it_no_stdin(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    log.write_text("before\n")
    child = spawn([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); print(sys.stdin.read() == '')"], log)
    assert child.wait(30) == 0
    assert log.read_text().splitlines() == ["before", "out", "err", "True"]


def test_spawn_under_parent_death_runs_the_command_and_passes_the_environment(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    child = spawn([sys.executable, "-c", "import os; print(os.environ['ROLLSTREAM_X'])"], log,
                  parent_death=True, env={"ROLLSTREAM_X": "seen", "PATH": "/usr/bin:/bin"})
    assert child.wait(30) == 0
    assert log.read_text().strip() == "seen"


def test_wait_until_returns_once_ready() -> None:
    answers = iter([False, False, True])
    wait_until(lambda: next(answers), what="the third answer", timeout=10, interval=0.001)


def test_wait_until_names_the_condition_and_shows_the_log_when_the_process_exits(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    child = spawn([sys.executable, "-c", "print('cannot bind'); raise SystemExit(3)"], log)
    child.wait(30)
    with pytest.raises(RuntimeError, match=r"(?s)server answering: the process exited with code 3 .*cannot bind"):
        wait_until(lambda: False, what="server answering", timeout=30, process=child, log=log)


def test_wait_until_gives_up_after_its_timeout() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(RuntimeError, match=r"never: not within 0.05 s"):
            wait_until(lambda: False, what="never", timeout=0.05, process=child, interval=0.01)
    finally:
        child.kill()
        child.wait()


def test_a_workdir_of_its_own_is_removed_and_a_given_one_kept(tmp_path: Path) -> None:
    own = WorkDir(None, "rollstream-test-")
    assert own.path.is_dir() and own.path.name.startswith("rollstream-test-")
    own.cleanup()
    own.cleanup()
    assert not own.path.exists()
    given = WorkDir(tmp_path / "a" / "b", "unused-")
    assert given.path == tmp_path / "a" / "b" and given.path.is_dir()
    given.cleanup()
    assert given.path.is_dir()
