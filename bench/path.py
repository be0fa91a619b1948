"""The path of one prompt through a producer: rollstream files entered and rollstream frames deep.

``python -m bench path``. One real producer in this process (embedded Redis, the math reward,
the engine simulator over real HTTP in a thread of its own) runs one prompt of ``n`` samples
while ``sys.setprofile`` watches the event loop's thread. Only frames of the ``rollstream``
package count (``rollstream.testing`` excluded: the simulator is not the producer); the renewal
thread and the simulator's thread are not watched. Nothing here names a rollstream function but
the markers, which are public seams:

* **admission → publish**: from the call of the ADMIT script to the reply of the PUBLISH script
  (redis-py's ``AsyncScript.__call__``, told apart by the scripts' sources in ``common.lua``).
  The prompt's code is the task that ran ADMIT until it starts the task that leads to PUBLISH
  (the hand-off), then that task and every task it starts, with the frames on the stack at the
  ADMIT call. Loop callbacks outside any task (a protocol's ``data_received``) are not counted.
* **generate → socket write**: from a call of the engine client's public ``generate`` /
  ``generate_n`` to the first ``socket.send`` under it (across the tasks it starts).

A task's stack ends at the event loop; *with the tasks that started it* a task's stack is
prefixed by its parent's stack at the moment it was created (what one follows reading the code).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import BuiltinMethodType, CodeType, FrameType
from typing import Any

from redis.commands.core import AsyncScript
from rollstream.common import lua
from rollstream.common.connection import connect
from rollstream.common.keys import Keys
from rollstream.producer.engine import EngineClient, EngineSettings
from rollstream.producer.rewards import load_reward
from rollstream.producer.settings import ProducerSettings
from rollstream.producer.worker import Producer
from rollstream.runtime.redis_server import EmbeddedRedis
from rollstream.testing.sim import SimConfig, SimEngine

from bench.common import ROOT, Table, add_prompts, init_ns

N = 8
SENDS = frozenset({"send", "sendall", "sendmsg", "sendto"})
GENERATE_SEAMS = ("generate", "generate_n")
"""The engine client's public generation methods: the start of the second stage."""


@dataclass
class Event:
    """One call of a rollstream function seen by the profiler."""

    index: int
    task: asyncio.Task[Any] | None
    code: CodeType
    chain: tuple[FrameType, ...]
    """Rollstream frames from the outermost (the spawning tasks' first) to this one."""
    own: int
    """How many of them belong to the task itself (its stack as a traceback shows it)."""


@dataclass
class Seam:
    """One call of a generate seam and what ran under it until its first socket write."""

    files: set[str] = field(default_factory=set)
    written: bool = False
    frames: int = 0
    """Rollstream frames from the seam's frame down to the write (across tasks)."""
    own: int = 0
    """Rollstream frames of the writing task's own stack at the write."""
    chain: tuple[FrameType, ...] = ()


class Tracer:
    """The profile hook, the task factory and the script markers of one run."""

    def __init__(self) -> None:
        self.index = 0
        self.events: list[Event] = []
        self.created: dict[asyncio.Task[Any], tuple[int, asyncio.Task[Any] | None, tuple[FrameType, ...]]] = {}
        """Task → (index at creation, parent task, the parent's chain at that moment)."""
        self.admit: tuple[int, asyncio.Task[Any] | None, tuple[FrameType, ...]] | None = None
        self.pending_admit: tuple[int, asyncio.Task[Any] | None, tuple[FrameType, ...]] | None = None
        self.publish: tuple[int, asyncio.Task[Any] | None] | None = None
        self.running_at_publish: set[asyncio.Task[Any]] = set()
        """Tasks still running when PUBLISH replied: not the prompt's (a monitor it happened to start)."""
        self.published = asyncio.Event()
        self.seams: dict[FrameType, Seam] = {}
        self._ours: dict[CodeType, bool] = {}
        self._seam_codes = {inspect.unwrap(getattr(EngineClient, name)).__code__ for name in GENERATE_SEAMS}

    # -- classification --------------------------------------------------------------------------

    def ours(self, frame: FrameType) -> bool:
        """A function of a rollstream module (the simulator's excluded), by its module's name."""
        code = frame.f_code
        known = self._ours.get(code)
        if known is None:
            name = frame.f_globals.get("__name__", "")
            known = self._ours[code] = name.startswith("rollstream.") and not name.startswith("rollstream.testing")
        return known

    def chain(self, frame: FrameType | None) -> tuple[tuple[FrameType, ...], int]:
        """The rollstream frames of the current task's stack prefixed by its spawning chain, and
        how many are the task's own."""
        own: list[FrameType] = []
        while frame is not None:
            if self.ours(frame):
                own.append(frame)
            frame = frame.f_back
        own.reverse()
        task = _current_task()
        prefix = self.created[task][2] if task in self.created else ()
        return prefix + tuple(own), len(own)

    # -- hooks ---------------------------------------------------------------------------------

    def hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            if not self.ours(frame):
                return
            self.index += 1
            chain, own = self.chain(frame)
            self.events.append(Event(self.index, _current_task(), frame.f_code, chain, own))
            seam = self._seam(chain)
            if seam is not None and not seam.written:
                seam.files.add(frame.f_code.co_filename)
        elif event == "c_call" and type(arg) is BuiltinMethodType and arg.__name__ in SENDS \
                and isinstance(arg.__self__, socket.socket):
            chain, own = self.chain(frame)
            seam = self._seam(chain)
            if seam is not None and not seam.written:
                start = next(i for i, f in enumerate(chain) if f.f_code in self._seam_codes)
                seam.written, seam.frames, seam.own, seam.chain = True, len(chain) - start, own, chain

    def _seam(self, chain: tuple[FrameType, ...]) -> Seam | None:
        """The outermost generate seam on ``chain``, if any."""
        for frame in chain:
            if frame.f_code in self._seam_codes:
                return self.seams.setdefault(frame, Seam())
        return None

    def task_factory(self, loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        parent = _current_task()
        prefix, _ = self.chain(sys._getframe(1))
        task: asyncio.Task[Any] = asyncio.Task(coro, loop=loop, **kwargs)
        self.index += 1
        self.created[task] = (self.index, parent, prefix)
        return task

    @contextlib.contextmanager
    def markers(self) -> Iterator[None]:
        """redis-py's script call wrapped: the ADMIT that admitted the prompt, the PUBLISH reply."""
        original = AsyncScript.__call__
        tracer = self

        async def call(script: AsyncScript, *args: Any, **kwargs: Any) -> Any:
            source = script.script.decode() if isinstance(script.script, bytes) else script.script
            if source == lua.ADMIT.source and tracer.admit is None:
                tracer.index += 1
                tracer.pending_admit = (tracer.index, _current_task(), tracer.chain(sys._getframe(1))[0])
            reply = await original(script, *args, **kwargs)
            if source == lua.ADMIT.source and tracer.admit is None and lua.status(reply[0]) == "ok":
                tracer.admit = tracer.pending_admit
            elif source == lua.PUBLISH.source and tracer.admit is not None and tracer.publish is None:
                tracer.index += 1
                tracer.publish = (tracer.index, _current_task())
                tracer.running_at_publish = {task for task in tracer.created if not task.done()}
                tracer.published.set()
            return reply

        AsyncScript.__call__ = call  # type: ignore[method-assign]
        try:
            yield
        finally:
            AsyncScript.__call__ = original  # type: ignore[method-assign]

    # -- the figures ------------------------------------------------------------------------------

    def admission_to_publish(self) -> tuple[set[str], Event, Event, tuple[FrameType, ...]]:
        """Files entered on the prompt's path, its deepest event by its own stack and by its
        chain, and the stack at the ADMIT call."""
        if self.admit is None or self.publish is None:
            raise RuntimeError("the prompt was not admitted and published while traced")
        start, admitter, at_admit = self.admit
        end, publisher = self.publish
        lineage = [publisher]
        while lineage[-1] is not admitter:
            parent = self.created.get(lineage[-1], (0, None, ()))[1]  # type: ignore[arg-type]
            if parent is None:
                raise RuntimeError("PUBLISH ran in a task that does not descend from the one that ran ADMIT")
            lineage.append(parent)
        hand_off = self.created[lineage[-2]][0] if len(lineage) > 1 else end
        family = set(lineage[:-1])
        grew = True
        while grew:
            grown = {t for t, (_, parent, _) in self.created.items()
                     if parent in family and t not in self.running_at_publish} - family
            family |= grown
            grew = bool(grown)
        path = [e for e in self.events if start <= e.index <= end
                and (e.task in family or (e.task is admitter and e.index <= hand_off))]
        files = _sources({e.code.co_filename for e in path} | {f.f_code.co_filename for f in at_admit})
        return files, max(path, key=lambda e: e.own), max(path, key=lambda e: len(e.chain)), at_admit


def _current_task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


def _sources(files: set[str]) -> set[str]:
    """Source files only: code made by ``exec`` (a dataclass's ``__init__``) is ``<string>``."""
    return {f for f in files if not f.startswith("<")}


def _where(code: CodeType) -> str:
    return os.path.relpath(code.co_filename, ROOT)


def _names(chain: tuple[FrameType, ...]) -> str:
    return " → ".join(f"{_where(f.f_code).removesuffix('.py')}:{f.f_code.co_qualname}" for f in chain)


@contextlib.contextmanager
def _engine_thread(config: SimConfig) -> Iterator[str]:
    """The simulator on an event loop of its own thread (not profiled); its URL."""
    ready: list[str] = []
    started = threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def serve() -> None:
        async with SimEngine(config) as engine:
            ready.append(engine.url)
            started.set()
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), name="sim-engine", daemon=True)
    thread.start()
    if not started.wait(30):
        raise RuntimeError("the engine simulator did not start within 30 s")
    try:
        yield ready[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()


async def trace(redis_url: str, engine_url: str, tokens: int) -> Tracer:
    """One prompt of ``N`` samples through one producer, traced from its start to its publish."""
    redis = connect(redis_url)
    ns = f"path-{time.monotonic_ns()}"
    keys: Keys = await init_ns(redis, ns, n_samples_per_prompt=N, batch_size=1, max_backlog=4)
    await add_prompts(redis, keys, 0, 1, with_ids=False)
    tracer = Tracer()
    reward = load_reward("math")
    settings = ProducerSettings(namespace=ns, concurrency=N, name="path", drain_timeout=5.0)
    loop = asyncio.get_running_loop()
    async with EngineClient(EngineSettings(urls=(engine_url,), max_new_tokens=tokens)) as engine:
        producer = await Producer.connect(redis_url, settings, engine, reward)
        previous = loop.get_task_factory()
        try:
            with tracer.markers():
                loop.set_task_factory(tracer.task_factory)  # type: ignore[arg-type]
                sys.setprofile(tracer.hook)
                try:
                    running = asyncio.create_task(producer.run(), name="producer")
                    async with asyncio.timeout(60):
                        await tracer.published.wait()
                finally:
                    sys.setprofile(None)
                    loop.set_task_factory(previous)
            producer.stop()
            async with asyncio.timeout(30):
                await running
        finally:
            await producer.aclose()
            await reward.aclose()
    await redis.aclose()
    return tracer


def run(quick: bool = False) -> list[Table]:
    tokens = 32 if quick else 256
    config = SimConfig(seed=1, mean_tokens=tokens, length_sigma=0.0, max_tokens_cap=tokens, latency_per_token=0.0)
    with EmbeddedRedis() as server, _engine_thread(config) as engine_url:
        tracer = asyncio.run(trace(server.url, engine_url, tokens))
    files, deepest_own, deepest, at_admit = tracer.admission_to_publish()
    seams = [s for s in tracer.seams.values() if s.written]
    if not seams:
        raise RuntimeError("no generate call reached a socket write while traced")
    for seam in seams:
        seam.files = _sources(seam.files)
    widest = max(seams, key=lambda s: len(s.files))
    deep = max(seams, key=lambda s: s.frames)
    rows: list[list[Any]] = [
        ["admission → publish (ADMIT script call → PUBLISH reply)", len(files), deepest_own.own, len(deepest.chain)],
        ["generate → socket write (the engine client's generate → socket.send)", len(widest.files), deep.own,
         deep.frames],
        ["the prompt's stack at the socket write (from the admission loop)",
         len(_sources({f.f_code.co_filename for f in deep.chain})), deep.own, len(deep.chain)],
    ]
    load = os.getloadavg()
    return [Table(
        name="path",
        title=f"The path of one prompt ({N} samples of {tokens} tokens, simulator over HTTP) through a producer",
        headers=["stage", "rollstream files", "deepest rollstream frames, one task",
                 "deepest rollstream frames, with the tasks that started it"],
        rows=rows,
        notes=[
            "Counted: functions of the rollstream package only (not rollstream.testing, asyncio, redis-py or "
            "llhttp), on the event loop's thread; 'one task': the stack a traceback shows, 'with the tasks that "
            "started it': each task's stack prefixed by its parent's at its creation. The prompt's tasks: the one "
            "that ran ADMIT until it starts the one leading to PUBLISH, then that one and the tasks it starts that "
            "ended by the PUBLISH reply (a fleet monitor the first request starts is not the prompt's).",
            f"Generate rows: the widest and deepest of the {len(seams)} requests (the first opens the connection).",
            f"Load average while measured: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (the figures do not depend on it).",
            f"Files, admission → publish: {', '.join(sorted(os.path.relpath(f, ROOT) for f in files))}.",
            f"Files, generate → socket write: {', '.join(sorted(os.path.relpath(f, ROOT) for f in widest.files))}.",
            f"Deepest stack, admission → publish: {_names(deepest.chain)}.",
            f"Deepest stack of one task, admission → publish: {_names(deepest_own.chain[-deepest_own.own:])}.",
            f"Deepest stack at the socket write: {_names(deep.chain)}.",
            f"Stack at the ADMIT call: {_names(at_admit)}.",
        ],
        command="python -m bench path",
    )]
