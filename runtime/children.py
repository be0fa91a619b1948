"""Child processes of a single-machine run (the demo, the one-flag slime/miles run; also the
benchmarks and tests): start a process with its output in a log file (:func:`spawn`; a
``rollstream`` command: :func:`start_cli`), wait for it to be ready while watching it does not
exit (:func:`wait_until`), stop them the way an operator would (SIGTERM, a bounded wait for the
drain, then SIGKILL), and supervise long-running children (:class:`Supervisor`: restarts with a
backoff, no orphans after the owner dies). The embedded Redis and the testing Mooncake cluster
start and wait for their processes through the same helpers."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from rollstream.common.backoff import Backoff

logger = logging.getLogger(__name__)

T = TypeVar("T")

FATAL_FILE_ENV = "ROLLSTREAM_FATAL_FILE"
"""Set for every supervised child: a ``rollstream`` command that stops on a ConfigError writes its
message there (``cli.main``), and the supervisor does not restart it."""


def spawn(
    argv: Sequence[str],
    log: Path,
    *,
    parent_death: bool = False,
    new_session: bool = False,
    env: Mapping[str, str] | None = None,
    stdin: int | None = subprocess.DEVNULL,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` with stdout and stderr appended to ``log``. ``parent_death``: under
    :mod:`rollstream.runtime.parent_death`, so the kernel kills it when this process dies;
    ``new_session``: in its own session (out of reach of the terminal's Ctrl-C); ``env``: the
    whole environment (None: this one's); ``stdin``: none by default (None: this one's)."""
    command = [*argv]
    if parent_death:
        command = [sys.executable, "-m", "rollstream.runtime.parent_death", str(os.getpid()), "--", *command]
    with open(log, "ab") as handle:
        return subprocess.Popen(
            command,
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=stdin,
            env=None if env is None else dict(env),
            start_new_session=new_session,
        )


def wait_until(
    ready: Callable[[], bool],
    *,
    what: str,
    timeout: float,
    process: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
    interval: float = 0.05,
) -> None:
    """Block until ``ready()`` is true, asking every ``interval`` seconds. RuntimeError naming
    ``what`` (the awaited condition) when ``process`` exits first or ``timeout`` seconds pass;
    with the end of ``log`` when one is given."""
    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with {_exit_text(process.returncode)}{_log_note(log)}")
        if ready():
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout} s{_log_note(log)}")
        time.sleep(interval)


def log_tail(log: Path, limit: int = 3000) -> str:
    """The last ``limit`` characters of ``log`` (a child's output), for an error message."""
    try:
        return log.read_text(errors="replace")[-limit:]
    except OSError:
        return "(no log)"


def _log_note(log: Path | None) -> str:
    return "" if log is None else f" (log {log}):\n{log_tail(log)}"


class WorkDir:
    """A child's directory: ``dir`` when given (made if missing), else a temporary one named
    ``prefix...`` that :meth:`cleanup` removes (a given one is kept)."""

    def __init__(self, dir: str | os.PathLike[str] | None, prefix: str) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix=prefix)
            dir = self._tmp.name
        self.path = Path(dir)
        self.path.mkdir(parents=True, exist_ok=True)

    def cleanup(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def start_cli(args: Sequence[str], log: Path, *, new_session: bool = True) -> subprocess.Popen[bytes]:
    """``python -m rollstream.cli ARGS`` with stdout and stderr appended to ``log`` (its stdin
    is this process's: a command may ask on the terminal)."""
    return spawn([sys.executable, "-m", "rollstream.cli", *args], log, new_session=new_session, stdin=None)


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


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""The health checks' opener: the engines are asked directly, never through an environment proxy."""


def healthy(url: str, timeout: float = 1.0) -> bool:
    """Whether ``url/health`` answers 200 within ``timeout`` seconds (blocking; stdlib HTTP)."""
    try:
        with _NO_PROXY.open(url + "/health", timeout=timeout) as reply:
            return bool(reply.status == 200)
    except (OSError, http.client.HTTPException, ValueError):  # refused, reset, timeout, non-2xx, garbage
        return False


def wait_for_http(url: str, timeout: float = 20.0) -> None:
    """Block until ``url/health`` answers 200 (an engine or the simulator came up)."""
    wait_until(lambda: healthy(url), what=f"an engine answering at {url}/health", timeout=timeout)


# -- supervised children (the one-flag slime/miles run) ----------------------------------------


@dataclass
class ChildSpec:
    """One supervised child: its command line (run under :mod:`rollstream.runtime.parent_death`)."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    """Added to (and overriding) the parent's environment."""
    ready: Callable[[subprocess.Popen[bytes]], None] | None = None
    """Called after each start, in the supervisor's thread; raises when the child is not usable."""
    stage: int = 1
    """Stop order: higher stages are stopped first (all children of a stage together)."""
    stop_timeout: float = 40.0
    """Seconds a SIGTERM'd child may take to exit (a producer drains) before SIGKILL."""
    give_up_after: int | None = 5
    """Failures in a row (none lasting ``stable_after``) after which the child is not restarted
    any more and counts as failed (:meth:`Supervisor.failed`); None: restart forever."""


@dataclass
class Child:
    spec: ChildSpec
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    failures_in_a_row: int = 0
    restart_at: float | None = None
    done: bool = False
    """Exited 0 on its own (a finished feeder): not restarted."""
    fatal: str | None = None
    """Stopped on a configuration error (its message): not restarted."""
    gave_up: str | None = None
    """Failed ``give_up_after`` times in a row (the last exit and log line): not restarted."""


def _last_line(path: Path, limit: int = 4096) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - limit))
            lines = handle.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""


class Supervisor:
    """Starts children, restarts the ones that die (exponential backoff with jitter, reset once a
    child has run ``stable_after`` seconds), and stops them all.

    Every child is started from the supervisor's own thread, in a new session (its own process
    group, out of reach of the terminal's Ctrl-C), under :mod:`rollstream.runtime.parent_death`, which sets
    the Linux parent-death signal: the kernel kills the children when that thread dies, i.e. when
    the owning process exits in any way, SIGKILL included. :meth:`stop` is the graceful way:
    SIGTERM by stage, a bounded wait, then SIGKILL of each process group.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        *,
        backoff: Backoff | None = None,
        poll_interval: float = 0.2,
        stable_after: float = 60.0,
        pids_file: str | os.PathLike[str] | None = None,
    ) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.backoff = backoff or Backoff(base=0.5, cap=30.0)
        self.poll_interval = poll_interval
        self.stable_after = stable_after
        self.pids_file = Path(pids_file) if pids_file is not None else None
        self.children: list[Child] = []
        self._calls: queue.Queue[tuple[Callable[[], Any], Future[Any]]] = queue.Queue()
        self._stopping = threading.Event()
        self._no_restarts = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="rollstream-supervisor", daemon=True)
        self._thread.start()

    # -- any thread -------------------------------------------------------------------------

    def start(self, spec: ChildSpec, timeout: float = 120.0) -> Child:
        """Start ``spec`` (from the supervisor's thread) and wait until it is ready."""
        child = Child(spec)
        self._call(lambda: self._spawn(child, first=True), timeout)
        return child

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def restarts(self) -> dict[str, int]:
        with self._lock:
            return {c.spec.name: c.restarts for c in self.children}

    def fatal(self) -> dict[str, str]:
        """Children stopped for good on a configuration error: name -> message."""
        with self._lock:
            return {c.spec.name: c.fatal for c in self.children if c.fatal is not None}

    def failed(self) -> dict[str, str]:
        """Children given up after failing ``give_up_after`` times in a row: name -> what happened."""
        with self._lock:
            return {c.spec.name: c.gave_up for c in self.children if c.gave_up is not None}

    def fatal_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.fatal"

    def pids(self) -> dict[str, int]:
        with self._lock:
            return {c.spec.name: c.process.pid for c in self.children if c.process is not None}

    def stop(self) -> None:
        """Stop restarting, then SIGTERM the children stage by stage (highest first), SIGKILL what
        is still there after its ``stop_timeout``; the supervisor's thread ends last (its end is
        the children's parent death: the kernel would SIGKILL them at once). Idempotent."""
        self._no_restarts.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            settled: Future[None] = Future()  # the loop's current turn (a restart under way) is over
            self._calls.put((lambda: None, settled))
            with contextlib.suppress(Exception):
                settled.result(timeout=60)
        with self._lock:
            children = list(self.children)
        for stage in sorted({c.spec.stage for c in children}, reverse=True):
            batch = [c for c in children if c.spec.stage == stage and c.process is not None]
            for child in batch:
                _signal_group(child.process, signal.SIGTERM)  # type: ignore[arg-type]
            deadline = time.monotonic() + max((c.spec.stop_timeout for c in batch), default=0.0)
            for child in batch:
                process = child.process
                if process is None:
                    continue
                try:
                    process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning("%s (pid %d) did not stop in time: SIGKILL", child.spec.name, process.pid)
                _signal_group(process, signal.SIGKILL)  # and anything it left in its group
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(10)
        self._stopping.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    # -- the supervisor's thread --------------------------------------------------------------

    def _call(self, fn: Callable[[], T], timeout: float) -> T:
        if self._no_restarts.is_set():
            raise RuntimeError("the supervisor is stopped")
        future: Future[T] = Future()
        self._calls.put((fn, future))
        return future.result(timeout)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                fn, future = self._calls.get(timeout=self.poll_interval)
            except queue.Empty:
                pass
            else:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as exc:  # handed to the caller of start()
                        future.set_exception(exc)
            try:
                self._check()
            except Exception:  # this thread's end would kill every child (their parent death)
                logger.exception("supervisor: checking the children failed; carrying on")

    def _spawn(self, child: Child, *, first: bool = False) -> None:
        spec = child.spec
        log = self.log_path(spec.name)
        fatal = self.fatal_path(spec.name)
        fatal.unlink(missing_ok=True)
        env = {**os.environ, **spec.env, FATAL_FILE_ENV: str(fatal)}
        process = spawn(spec.argv, log, parent_death=True, new_session=True, env=env)
        child.process, child.started_at, child.restart_at = process, time.monotonic(), None
        logger.info("started %s (pid %d, log %s)", spec.name, process.pid, log)
        if spec.ready is not None:
            try:
                spec.ready(process)
            except BaseException:
                if first:
                    _signal_group(process, signal.SIGKILL)
                    process.wait()
                raise
        if first:
            with self._lock:
                self.children.append(child)
        self._write_pids()

    def _check(self) -> None:
        now = time.monotonic()
        with self._lock:
            children = list(self.children)
        for child in children:
            process = child.process
            if child.done or child.fatal or child.gave_up or process is None or self._no_restarts.is_set():
                continue
            code = process.poll()
            if code is None:
                continue
            if child.restart_at is None:
                if code == 0:
                    child.done = True
                    logger.info("%s (pid %d) finished", child.spec.name, process.pid)
                    continue
                reason = self._fatal_reason(child)
                if reason is not None:
                    with self._lock:
                        child.fatal = reason
                    logger.error(
                        "%s (pid %d) stopped on a configuration error, not restarted (log %s): %s",
                        child.spec.name, process.pid, self.log_path(child.spec.name), reason,
                    )
                    continue
                if now - child.started_at >= self.stable_after:
                    child.failures_in_a_row = 0
                delay = self.backoff.delay(child.failures_in_a_row)
                child.failures_in_a_row += 1
                log = self.log_path(child.spec.name)
                limit = child.spec.give_up_after
                if limit is not None and child.failures_in_a_row >= limit:
                    with self._lock:
                        child.gave_up = (
                            f"exited with {_exit_text(code)} {limit} times in a row (log {log}): {_last_line(log)}"
                        )
                    logger.error("%s (pid %d) not restarted: %s", child.spec.name, process.pid, child.gave_up)
                    continue
                child.restart_at = now + delay
                with self._lock:
                    child.restarts += 1
                logger.warning(
                    "%s (pid %d) exited with %s; restarting it in %.1f s (restart %d, log %s): %s",
                    child.spec.name, process.pid, _exit_text(code), delay, child.restarts, log, _last_line(log),
                )
            elif now >= child.restart_at:
                try:
                    self._spawn(child)
                except Exception as exc:
                    logger.error("restarting %s failed: %s", child.spec.name, exc)
                    child.started_at = time.monotonic()
                    child.restart_at = None  # counted as another failure at the next check

    def _fatal_reason(self, child: Child) -> str | None:
        try:
            return self.fatal_path(child.spec.name).read_text(encoding="utf-8").strip() or "configuration error"
        except OSError:
            return None

    def _write_pids(self) -> None:
        if self.pids_file is None:
            return
        tmp = self.pids_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.pids(), sort_keys=True))
        os.replace(tmp, self.pids_file)


def _exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
    return f"code {code}"


def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    """Signal the child's process group (its session: it was started with start_new_session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)
    with contextlib.suppress(ProcessLookupError):
        if process.poll() is None:
            process.send_signal(sig)
