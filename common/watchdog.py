"""Event-loop lag: a stalled loop is noticed, timed and named (issue 32, DESIGN §4.16).

User code that blocks the loop (a synchronous tool, ``requests.get``, ``subprocess.run``, a heavy
reward) freezes every other prompt of the process. Nothing on the loop can see that while it
happens, so the watchdog has two halves:

* a **ticker** task on the loop wakes every :data:`TICK` seconds and measures how late it woke
  (the loop's lag); a lag over the threshold is a stall: counted, and logged once when it ends,
  with its length and the code that held the loop;
* a daemon **thread** looks at the ticker's last stamp; once the loop has not ticked for the
  threshold, it samples the loop thread's stack (``sys._current_frames()``) and the task running
  on the loop (``asyncio.current_task``) once per stall: that is the code holding the loop, found
  while it holds it (the ticker only learns of the stall once it is over).

A stall during which the thread could not run either and the process used no CPU is no code's:
the whole process was stopped (SIGSTOP, a debugger, a suspended machine). It is logged as such,
counted apart (:attr:`LoopWatchdog.stops`) and blamed on nothing.

Used by every long-running process: the producer (heartbeat ``loop_*`` fields, ``inspect``,
metrics), the feeder and the integrations' loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from .errors import ConfigError

TICK = 0.1
"""Seconds between two ticks of the loop (the resolution of the lag measurement)."""
STALL_FRACTION = 0.2
"""The default threshold as a fraction of the lease (at most :data:`MAX_STALL_AFTER`)."""
MAX_STALL_AFTER = 5.0
"""The default threshold's cap (seconds): a long lease must not hide a stall of seconds."""
_ASYNCIO_DIR = os.path.dirname(asyncio.__file__)
_THIS_FILE = os.path.abspath(__file__)
STOPPED_CPU = 0.2
"""A stall the watchdog's thread did not see while it lasted, during which the process used less
CPU than this fraction of its length, was the process stopped (a blocked loop that held the GIL
in C code uses a core the whole time)."""
HINT = "run blocking calls with asyncio.to_thread or an executor (docs/rollouts.md)"


def default_stall_after(lease_seconds: float) -> float:
    """The default stall threshold for a lease: a fraction of it, at most :data:`MAX_STALL_AFTER`."""
    return min(MAX_STALL_AFTER, lease_seconds * STALL_FRACTION)


@dataclass(frozen=True, slots=True)
class Stall:
    """One stall of the loop: how long, the task that ran, the code that held it."""

    seconds: float
    task: str = ""
    """The running task's name and coroutine, e.g. ``work-1-0 (Producer._run_work)``."""
    where: str = ""
    """Where the loop thread's stack, sampled during the stall, was: the innermost frame with its
    code line and its callers (:func:`_where`); empty when no sample was taken."""

    def describe(self) -> str:
        parts = [f"{self.seconds:.1f} s"]
        if self.task:
            parts.append(f"in task {self.task}")
        parts.append(f"held at {self.where}" if self.where else "(not sampled)")
        return ", ".join(parts)


def _frame_text(frame: traceback.FrameSummary) -> str:
    filename = frame.filename
    with_root = os.path.relpath(filename) if not filename.startswith("<") else filename
    if with_root.startswith(".."):
        with_root = filename
    return f"{with_root}:{frame.lineno} in {frame.name}"


def _where(stack: traceback.StackSummary, depth: int = 3) -> str:
    """The innermost frame outside asyncio and the watchdog, with its code line, and up to
    ``depth - 1`` of its callers: ``file:line in fn: code (called from file:line in fn <- ...)``."""
    frames = [f for f in stack if not f.filename.startswith(_ASYNCIO_DIR) and os.path.abspath(f.filename) != _THIS_FILE]
    if not frames:
        return ""
    inner, *callers = frames[-depth:][::-1]
    text = _frame_text(inner)
    line = (inner.line or "").strip()
    if line:
        text += f": {line[:120]}"
    if callers:
        text += f" (called from {' <- '.join(_frame_text(f) for f in callers)})"
    return text


def _task_text(task: asyncio.Task[object] | None) -> str:
    if task is None:
        return ""
    coro = task.get_coro()
    name = getattr(coro, "__qualname__", type(coro).__name__)
    return f"{task.get_name()} ({name})"


class LoopWatchdog:
    """Measures the lag of the loop :meth:`run` is awaited on; stalls over ``threshold`` seconds
    are counted (:attr:`stalls`, :attr:`stall_seconds`, :attr:`longest`), logged once each on
    ``logger`` (``what`` names the process) and handed to ``on_stall``; ``on_lag`` gets every
    tick's lag (the metrics' gauge)."""

    def __init__(
        self,
        what: str,
        threshold: float,
        logger: logging.Logger,
        *,
        on_stall: Callable[[Stall], None] | None = None,
        on_lag: Callable[[float], None] | None = None,
        tick: float = TICK,
    ) -> None:
        if not threshold > 0:
            raise ConfigError(f"the loop stall threshold must be positive, got {threshold!r}")
        self.what = what
        self.threshold = threshold
        self.tick = min(tick, threshold / 2)
        self._logger = logger
        self._on_stall = on_stall
        self._on_lag = on_lag
        self.stalls = 0
        self.stall_seconds = 0.0
        self.longest: Stall | None = None
        self.max_lag = 0.0
        """The largest lag since :meth:`take_max_lag` last read it."""
        self._stamp = time.monotonic()
        self._sample: tuple[float, str, str] | None = None
        """(the stamp of the stall it belongs to, task, where): written by the thread only."""
        self._live = 0.0
        """The stamp of the stall the thread saw while it lasted (it ran on time): written by the thread only."""
        self._cpu = time.process_time()
        """The process's CPU seconds at the last tick: a stopped process uses none."""
        self.stops = 0
        """Stalls that were the whole process stopped, not code holding the loop."""
        self.stopped_seconds = 0.0
        self._stop = threading.Event()

    def take_max_lag(self) -> float:
        """The largest lag since the last call (for a heartbeat), and start over."""
        lag, self.max_lag = self.max_lag, 0.0
        return lag

    async def run(self) -> None:
        """Tick until cancelled; the sampling thread lives as long as this coroutine."""
        loop = asyncio.get_running_loop()
        thread = threading.Thread(
            target=self._watch, args=(loop, threading.get_ident()), name=f"loop-watchdog-{self.what}", daemon=True
        )
        self._stamp = time.monotonic()
        self._stop.clear()
        thread.start()
        try:
            while True:
                before, cpu_before = self._stamp, self._cpu
                await asyncio.sleep(self.tick)
                now = time.monotonic()
                self._stamp, self._cpu = now, time.process_time()
                lag = max(0.0, now - before - self.tick)
                if lag >= self.threshold and self._live != before and self._cpu - cpu_before < STOPPED_CPU * lag:
                    self._stopped(lag)
                    continue
                self.max_lag = max(self.max_lag, lag)
                if self._on_lag is not None:
                    self._on_lag(lag)
                if lag >= self.threshold:
                    self._stalled(lag, before)
        finally:
            self._stop.set()

    def _stopped(self, seconds: float) -> None:
        self.stops += 1
        self.stopped_seconds += seconds
        self._logger.warning(
            "%s: the whole process was stopped for %.1f s (SIGSTOP, a debugger or a suspended machine: no thread "
            "ran, no CPU was used); no code of its own held the loop", self.what, seconds,
        )

    def _stalled(self, seconds: float, stamp: float) -> None:
        sample = self._sample
        task, where = (sample[1], sample[2]) if sample is not None and sample[0] == stamp else ("", "")
        stall = Stall(round(seconds, 2), task, where)
        self.stalls += 1
        self.stall_seconds += seconds
        if self.longest is None or stall.seconds > self.longest.seconds:
            self.longest = stall
        self._logger.warning(
            "%s: event loop stalled %s (threshold %.1f s): every other task waited; %s",
            self.what, stall.describe(), self.threshold, HINT,
        )
        if self._on_stall is not None:
            self._on_stall(stall)

    def _watch(self, loop: asyncio.AbstractEventLoop, ident: int) -> None:
        """The thread: sample the loop thread once per stall, while it stalls."""
        poll = min(0.25, self.threshold / 4)
        last = time.monotonic()
        while not self._stop.wait(poll):
            now = time.monotonic()
            late, last = now - last > poll + max(poll, 0.5), now  # this thread was stopped too
            stamp = self._stamp  # the last tick: a stall is known by it
            if late or now - stamp < 2 * poll:
                continue
            self._live = stamp
            if now - stamp < self.threshold or (self._sample is not None and self._sample[0] == stamp):
                continue
            frame = sys._current_frames().get(ident)
            where = _where(traceback.extract_stack(frame)) if frame is not None else ""
            try:
                task = _task_text(asyncio.current_task(loop))
            except RuntimeError:
                task = ""
            self._sample = (stamp, task, where)
