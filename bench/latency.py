"""Latency publish -> take() returned, at low load and at ~80% of the measured ceiling.

The publish time is the millisecond part of the group's stream entry id: Redis assigns it inside
the PUBLISH script, on the same host clock as the trainer's ``time.time()``. The id is floored to
the millisecond, so each latency is over-estimated by up to 1 ms.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rollstream.common.connection import connect
from rollstream.consumer import GroupConsumer
from rollstream.runtime.redis_server import EmbeddedRedis

from bench.common import OUT, Table, add_prompts, children, init_ns, percentile, spawn

N = 8
BATCH = 64
PRODUCERS = 2


async def _feed(redis: Any, keys: Any, rate: float, stop: asyncio.Event, start: int = 0) -> None:
    """Add prompts at ``rate`` per second (paced every 10 ms)."""
    added, t0 = 0, time.monotonic()
    while not stop.is_set():
        due = int(rate * (time.monotonic() - t0)) - added
        if due > 0:
            await add_prompts(redis, keys, start + added, due)
            added += due
        await asyncio.sleep(0.01)


def _ms(entry_id: bytes) -> int:
    return int(entry_id.split(b"-")[0])


async def _phase(url: str, quick: bool) -> dict[str, Any]:
    ns = f"lat-{time.monotonic_ns()}"
    redis = connect(url)
    keys = await init_ns(redis, ns, n_samples_per_prompt=N, batch_size=BATCH, max_backlog=4096)
    out: dict[str, Any] = {}
    with children() as procs:
        for i in range(PRODUCERS):
            procs.append(spawn(["-m", "bench.worker", "produce", "--redis", url, "--ns", ns, "--concurrency", "64",
                                "--name", f"p{i}"], OUT / f"worker-{ns}-{i}.log"))
        async with await GroupConsumer.connect(url, ns, "trainer", stall_timeout=60) as consumer:
            # Warm up and measure the ceiling: a pre-seeded backlog drained as fast as possible.
            base = 0
            warm = 2 if quick else 6
            await add_prompts(redis, keys, base, (warm + 1) * BATCH)
            base += (warm + 1) * BATCH
            batch = await consumer.take(BATCH)
            await consumer.commit(batch)
            t0 = time.perf_counter()
            for _ in range(warm):
                batch = await consumer.take(BATCH)
                await consumer.commit(batch)
            ceiling = warm * BATCH / (time.perf_counter() - t0)
            out["ceiling"] = ceiling
            duration = 2.0 if quick else 15.0
            # Low load: 10 groups/s, the trainer takes one group at a time (always waiting).
            low: list[float] = []
            stop = asyncio.Event()
            feeder = asyncio.create_task(_feed(redis, keys, 10.0, stop, base))
            end = time.monotonic() + duration
            while time.monotonic() < end:
                batch = await consumer.take(1)
                now = time.time() * 1000
                low += [now - _ms(e) for e in batch.entry_ids]
                await consumer.commit(batch)
            stop.set()
            await feeder
            base += 1_000_000
            # Drain what the low phase left.
            await asyncio.sleep(0.3)
            # ~80% of the ceiling, take(64).
            stop = asyncio.Event()
            rate = 0.8 * ceiling
            feeder = asyncio.create_task(_feed(redis, keys, rate, stop, base))
            every: list[float] = []
            last: list[float] = []
            t0 = time.perf_counter()
            taken = 0
            end = time.monotonic() + duration
            first = True
            while time.monotonic() < end:
                batch = await consumer.take(BATCH)
                now = time.time() * 1000
                await consumer.commit(batch)
                if first:  # may hold groups left from the low-load phase
                    first = False
                    t0 = time.perf_counter()
                    continue
                taken += len(batch)
                lat = [now - _ms(e) for e in batch.entry_ids]
                every += lat
                last.append(min(lat))
            out["achieved"] = taken / (time.perf_counter() - t0)
            stop.set()
            await feeder
    await redis.aclose()
    out["low"], out["every"], out["last"], out["rate"] = low, every, last, rate
    return out


async def measure(quick: bool) -> dict[str, Any]:
    with EmbeddedRedis() as server:
        return await _phase(server.url, quick)


def run(quick: bool = False) -> list[Table]:
    r = asyncio.run(measure(quick))

    def stats(values: list[float]) -> list[Any]:
        return [len(values), percentile(values, 50), percentile(values, 99), max(values, default=float("nan"))]

    rows = [
        ["low load: 10 groups/s, take(1)", *stats(r["low"])],
        [f"~80%: {r['rate']:.0f} groups/s offered ({r['achieved']:.0f} taken/s), take(64): batch-completing group",
         *stats(r["last"])],
        ["~80%, take(64): every group (includes waiting for the batch to fill)", *stats(r["every"])],
    ]
    _plot(r)
    return [Table(
        "latency",
        "Latency: publish (stream entry id ms) -> take() returned",
        ["load", "groups", "p50 ms", "p99 ms", "max ms"],
        rows,
        [
            f"{PRODUCERS} producer processes on the instant engine double, groups of 8 x 1k tokens; prompts fed at a "
            f"paced rate; ceiling measured in the same run from a pre-seeded backlog: {r['ceiling']:.0f} groups/s.",
            "Publish time = the ms part of the group's entry id (set by Redis inside the PUBLISH script); ids are "
            "floored to the ms, so latencies are over-estimated by up to 1 ms.",
            "The batch-completing group is the newest group of each batch: its latency is the pipeline's own "
            "(delivery + decode + checks + take's bookkeeping); older groups also waited for the batch to fill.",
            "Target: p99 <= 5 ms at low load.",
        ],
        "python -m bench latency",
    )]


def _plot(r: dict[str, Any]) -> None:
    from bench.common import IMG, plt

    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(6, 4))
    for key, label in (("low", "low load, take(1)"), ("last", "80%, batch-completing group")):
        values = sorted(r[key])
        if values:
            ax.plot(values, [i / len(values) for i in range(1, len(values) + 1)], label=label)
    ax.set_xscale("log")
    ax.set_xlabel("publish -> take() returned (ms)")
    ax.set_ylabel("CDF")
    ax.legend()
    ax.set_title("delivery latency")
    fig.tight_layout()
    IMG.mkdir(parents=True, exist_ok=True)
    fig.savefig(IMG / "latency.png", dpi=100)
    pyplot.close(fig)
