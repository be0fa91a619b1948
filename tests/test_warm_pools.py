"""Warm pools: a generate function's ``prepare(info)`` hook runs for a prompt admitted beyond the
concurrency (``--warm``) before its episodes start, its result reaches the episode that asks
for it, and every result no episode took is released, whether the group is published or the
prompt goes back with a drain. Real ``rollstream produce`` processes on the simulator."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import ProcessPool, add_prompts, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.consumer import GroupConsumer
from rollstream.testing.sim import SimEngine
from test_faults import wait_exit

FN = f"{Path(__file__).with_name('warm_fns.py')}:generate"


def _lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


async def _start(redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool, tmp_path: Path,
                 monkeypatch: pytest.MonkeyPatch, prompts: int) -> tuple[Path, Path, subprocess.Popen[bytes]]:
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=1)
    await add_prompts(redis, ns, prompts, text="Compute 3 + 4.")
    log, release = tmp_path / "warm.log", tmp_path / "release"
    monkeypatch.setenv("TOOL_LOG", str(log))
    monkeypatch.setenv("RELEASE", str(release))
    producer = procs.producer(redis_url, ns, sim.url, "--generate", FN, "--warm", "1", "--drain-timeout", "1",
                              name="p", concurrency=2)  # one prompt runs, one more is admitted warm

    def warmed_ahead() -> bool:
        lines = _lines(log)
        return {"prepare 1 0", "prepare 1 1", "episode 0 0", "episode 0 1"} <= set(lines) and not any(
            line.startswith("episode 1") for line in lines)

    await wait_until(warmed_ahead, message="prompt 1 prepared while prompt 0 runs")
    return log, release, producer


async def test_prepare_runs_ahead_its_result_reaches_the_episode_and_unused_ones_are_released(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log, release, _ = await _start(redis, redis_url, ns, sim, procs, tmp_path, monkeypatch, 3)
    release.touch()
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        async with asyncio.timeout(60):
            batch = await consumer.take(3)
        await consumer.commit(batch)
    for group in batch.groups:
        boxes = {s.index: s.metadata.get("box") for s in group.samples}
        assert boxes == {0: f"box-{group.index}-0", 1: None}  # the prepared result reached member 0
    lines = _lines(log)
    assert sorted(line for line in lines if line.startswith("prepare")) == [
        f"prepare {i} {m}" for i in range(3) for m in range(2)]  # once per episode
    # member 1 never took its resource: released; member 0's was used: not released
    assert sorted(line for line in lines if line.startswith("release")) == [f"release box-{i}-1" for i in range(3)]


async def test_a_drain_releases_what_its_unrun_and_unfinished_prompts_prepared(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log, _, producer = await _start(redis, redis_url, ns, sim, procs, tmp_path, monkeypatch, 2)
    producer.send_signal(signal.SIGTERM)
    assert await wait_exit(producer) == 0, procs.log_of(producer)
    assert "returned 2 prompts" in procs.log_of(producer)
    released = sorted(line for line in _lines(log) if line.startswith("release"))
    # prompt 1 (warm, never run) both; prompt 0 (cancelled by the drain) the one its episodes left
    assert released == ["release box-0-1", "release box-1-0", "release box-1-1"]
