"""Scale-out: groups/s with 1, 2, 4, 8 producer processes against the simulator with a fixed latency."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rollstream.common.connection import connect
from rollstream.consumer import GroupConsumer
from rollstream.runtime.redis_server import EmbeddedRedis, free_port

from bench.async_vs_sync import _wait_engine
from bench.common import OUT, Table, add_prompts, children, cpu_seconds, init_ns, spawn

N = 8
BATCH = 64
LATENCY = 0.05
TOKENS = 1024
SLOTS = 1024
CONCURRENCY = 64


async def one(url: str, engine_url: str, sim_pid: int, redis_pid: int, producers: int, batches: int) -> dict[str, Any]:
    ns = f"so{producers}-{time.monotonic_ns()}"
    redis = connect(url)
    keys = await init_ns(redis, ns, n_samples_per_prompt=N, batch_size=BATCH, max_backlog=4 * BATCH)
    await add_prompts(redis, keys, 0, (batches + 1) * BATCH + 4 * BATCH + producers * CONCURRENCY // N)
    with children() as procs:
        for i in range(producers):
            procs.append(spawn(["-m", "bench.worker", "produce", "--redis", url, "--ns", ns, "--engine", engine_url,
                                "--concurrency", str(CONCURRENCY), "--name", f"p{i}"], OUT / f"worker-{ns}-{i}.log"))
        async with await GroupConsumer.connect(url, ns, "trainer", stall_timeout=60) as consumer:
            batch = await consumer.take(BATCH)
            await consumer.commit(batch)
            pids = [p.pid for p in procs]
            c0 = (cpu_seconds(pids), cpu_seconds([redis_pid]), cpu_seconds([sim_pid]), time.process_time())
            t0 = time.perf_counter()
            for _ in range(batches):
                batch = await consumer.take(BATCH)
                await consumer.commit(batch)
            wall = time.perf_counter() - t0
            c1 = (cpu_seconds(pids), cpu_seconds([redis_pid]), cpu_seconds([sim_pid]), time.process_time())
    await redis.aclose()
    cpu = [(b - a) / wall for a, b in zip(c0, c1, strict=True)]
    return {"rate": batches * BATCH / wall, "cpu": cpu}


async def measure(quick: bool) -> list[tuple[int, dict[str, Any]]]:
    counts = [1, 2] if quick else [1, 2, 4, 8]
    batches = 1 if quick else 3
    port = free_port()
    engine_url = f"http://127.0.0.1:{port}"
    out = []
    with EmbeddedRedis() as server, children() as procs:
        procs.append(spawn(["-m", "rollstream.cli", "sim-engine", "--port", str(port), "--mean-tokens", str(TOKENS),
                            "--length-sigma", "0", "--base-latency", str(LATENCY), "--max-running", str(SLOTS),
                            "--log-level", "WARNING"], OUT / "sim-scaleout.log"))
        await _wait_engine(engine_url)
        assert server.process is not None
        for p in counts:
            out.append((p, await one(server.url, engine_url, procs[0].pid, server.process.pid, p, batches)))
    return out


def run(quick: bool = False) -> list[Table]:
    results = asyncio.run(measure(quick))
    base = results[0][1]["rate"]
    rows = []
    for p, r in results:
        ideal = p * CONCURRENCY / N / LATENCY
        prod, red, sim, trainer = r["cpu"]
        rows.append([p, r["rate"], r["rate"] / base, ideal, prod, red, sim, trainer, prod + red + sim + trainer])
    _plot(results)
    return [Table(
        "scaleout",
        f"Scale-out: producer processes against the simulator ({LATENCY * 1e3:.0f} ms per request, {TOKENS} tokens, {SLOTS} slots)",
        ["producers", "groups/s", "x vs 1", "latency-bound ideal groups/s", "CPU producers", "CPU redis",
         "CPU simulator", "CPU trainer", "CPU total (of 2)"],
        rows,
        [
            f"Each producer: concurrency {CONCURRENCY} samples = {CONCURRENCY // N} groups in flight; the simulator "
            f"answers every request after a fixed {LATENCY * 1e3:.0f} ms with {TOKENS} tokens + log-probs (sigma 0) "
            f"and has {SLOTS} slots, so engine slots never limit. Ideal = producers x {CONCURRENCY // N} / "
            f"{LATENCY} s.",
            "CPU columns: cores used (CPU-seconds per wall-second) in the measured window.",
        ],
        "python -m bench scaleout",
    )]


def _plot(results: list[tuple[int, dict[str, Any]]]) -> None:
    from bench.common import IMG, plt

    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(6, 4))
    ps = [p for p, _ in results]
    ax.plot(ps, [r["rate"] for _, r in results], marker="o", label="measured")
    ax.plot(ps, [p * CONCURRENCY / N / LATENCY for p in ps], linestyle="--", label="latency-bound ideal")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ps, [str(p) for p in ps])
    ax.set_yscale("log")
    ax.set_xlabel("producer processes")
    ax.set_ylabel("groups/s")
    ax.legend()
    ax.set_title("scale-out against the simulator (2 cores)")
    fig.tight_layout()
    IMG.mkdir(parents=True, exist_ok=True)
    fig.savefig(IMG / "scaleout.png", dpi=100)
    pyplot.close(fig)
