"""Memory soak: Redis used_memory and producer/consumer RSS while a slow trainer keeps the backlog at its cap."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from rollstream.common.connection import connect
from rollstream.consumer import GroupConsumer
from rollstream.runtime.redis_server import EmbeddedRedis

from bench.common import OUT, Table, add_prompts, children, init_ns, rss_mb, spawn

N = 8
BATCH = 64
BACKLOG = 128
TRAIN = 0.5


async def measure(seconds: float) -> dict[str, Any]:
    samples: list[tuple[float, float, float, float, int]] = []
    with EmbeddedRedis() as server:
        redis = connect(server.url)
        ns = f"mem-{time.monotonic_ns()}"
        keys = await init_ns(redis, ns, n_samples_per_prompt=N, batch_size=BATCH, max_backlog=BACKLOG)
        with children() as procs:
            procs.append(spawn(["-m", "bench.worker", "produce", "--redis", server.url, "--ns", ns,
                                "--concurrency", "64", "--name", "p0"], OUT / f"worker-{ns}.log"))
            stop = asyncio.Event()
            fed = 0

            async def feeder() -> None:
                nonlocal fed
                while not stop.is_set():
                    room = 512 - await redis.xlen(keys.prompts)
                    if room > 0:
                        await add_prompts(redis, keys, fed, room)
                        fed += room
                    await asyncio.sleep(0.1)

            async def sampler() -> None:
                t0 = time.monotonic()
                while not stop.is_set():
                    info = await redis.info("memory")
                    samples.append((time.monotonic() - t0, info["used_memory"] / 2**20, rss_mb(procs[0].pid),
                                    rss_mb(os.getpid()), int(await redis.xlen(keys.groups))))
                    await asyncio.sleep(0.5)

            tasks = [asyncio.create_task(feeder()), asyncio.create_task(sampler())]
            committed = 0
            async with await GroupConsumer.connect(server.url, ns, "trainer", stall_timeout=60) as consumer:
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    batch = await consumer.take(BATCH)
                    await asyncio.sleep(TRAIN)  # the slow trainer
                    await consumer.commit(batch)
                    committed += len(batch)
            stop.set()
            await asyncio.gather(*tasks)
        await redis.aclose()
    return {"samples": samples, "committed": committed, "seconds": seconds}


def run(quick: bool = False) -> list[Table]:
    r = asyncio.run(measure(4.0 if quick else 90.0))
    s = r["samples"]
    warm = [x for x in s if x[0] >= min(10.0, s[-1][0] / 3)] or s
    half = len(warm) // 2 or 1
    rows = []
    for col, name in ((1, "Redis used_memory MB"), (2, "producer RSS MB"), (3, "consumer RSS MB"), (4, "groups backlog (XLEN)")):
        first = sum(x[col] for x in warm[:half]) / len(warm[:half])
        second = sum(x[col] for x in warm[half:]) / max(1, len(warm[half:]))
        rows.append([name, min(x[col] for x in warm), max(x[col] for x in warm), first, second, second - first])
    _plot(s)
    return [Table(
        "memory",
        f"Memory soak: {r['seconds']:.0f} s, {r['committed']} groups committed, backlog cap {BACKLOG}",
        ["metric", "min", "max", "mean 1st half", "mean 2nd half", "drift"],
        rows,
        [
            f"1 producer (instant engine, 8 x 1k tokens, concurrency 64) against a slow trainer (take(64), "
            f"{TRAIN} s step, commit): the producer is held at max_backlog={BACKLOG} by admission; a feeder keeps "
            "512 prompts queued.",
            "Sampled every 0.5 s; the first ~10 s (start-up, first fill) are excluded from the statistics, not "
            "from the plot. Drift = mean of the 2nd half - mean of the 1st half.",
        ],
        "python -m bench memory",
    )]


def _plot(s: list[tuple[float, float, float, float, int]]) -> None:
    from bench.common import IMG, plt

    pyplot = plt()
    fig, axes = pyplot.subplots(2, 1, figsize=(7, 6), sharex=True)
    t = [x[0] for x in s]
    axes[0].plot(t, [x[1] for x in s], label="Redis used_memory")
    axes[0].plot(t, [x[2] for x in s], label="producer RSS")
    axes[0].plot(t, [x[3] for x in s], label="consumer RSS")
    axes[0].set_ylabel("MB")
    axes[0].legend()
    axes[1].plot(t, [x[4] for x in s], color="tab:red")
    axes[1].set_ylabel("groups backlog")
    axes[1].set_xlabel("seconds")
    fig.suptitle("memory soak (slow trainer, backlog capped)")
    fig.tight_layout()
    IMG.mkdir(parents=True, exist_ok=True)
    fig.savefig(IMG / "memory.png", dpi=100)
    pyplot.close(fig)
