"""A restarted producer's CPU per sample: the first producer of a namespace vs the one that
replaces it.

One producer (``python -m bench.worker produce``, the instant engine answering 1024-token replies)
processes a namespace's prompts fed by ``rollstream feed`` (epoch 1) while this process takes
batches of 64 and commits them; then it takes SIGTERM (drains, returns its unfinished prompts to
the retry stream) and a second producer starts on the same namespace while the feeder resumes
with epoch 2. Each producer's CPU-seconds over its measured window (after one warm-up batch) are
divided by the samples *it* published in that window (groups name their producer).
``BENCH_RESTART_PROFILE=DIR`` profiles both producers (cProfile: ``DIR/restart-{1,2}.prof.txt`` and
``.pstats``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from rollstream.common.connection import connect
from rollstream.common.protocol import Heartbeat, Heartbeats
from rollstream.consumer import GroupConsumer
from rollstream.runtime.redis_server import EmbeddedRedis

from bench.common import OUT, Table, children, cpu_seconds, init_ns, spawn, stop_all

BATCH = 64
N = 8
TOKENS = 1024


def _dataset(path: Path, size: int) -> None:
    path.write_text("".join(json.dumps({"prompt": f"What is {i % 97} + {i % 89}?", "label": str(i % 97 + i % 89)})
                            + "\n" for i in range(size)))


async def _phase(
    server: EmbeddedRedis, consumer: GroupConsumer, ns: str, dataset: Path, name: str, epochs: int, batches: int,
    profile: Path | None, engine: str,
) -> tuple[float, int, Any]:
    """Run feeder + producer ``name`` for 1 + ``batches`` batches; (CPU s, samples it published, the
    producer process, still running)."""
    feeder = spawn(["-m", "rollstream.cli", "feed", str(dataset), "--redis", server.url, "--ns", ns,
                    "--epochs", str(epochs), "--log-level", "WARNING"], OUT / f"restart-feed-{ns}-{epochs}.log")
    env = {"BENCH_PROFILE": str(profile)} if profile is not None else None
    producer = spawn(["-m", "bench.worker", "produce", "--redis", server.url, "--ns", ns, "--tokens", str(TOKENS),
                      "--concurrency", "64", "--name", name, "--engine", engine], OUT / f"restart-{ns}-{name}.log", env)
    await consumer.commit(await consumer.take(BATCH))  # warm-up: imports, connections, first groups
    cpu0 = cpu_seconds([producer.pid])
    samples = 0
    for _ in range(batches):
        batch = await consumer.take(BATCH)
        samples += sum(len(g.samples) for g in batch.groups if g.producer == name)
        await consumer.commit(batch)
    cpu = cpu_seconds([producer.pid]) - cpu0
    stop_all([feeder])  # its cursor stays where it is: the next feeder resumes there
    return cpu, samples, producer


async def restart_pair(
    server: EmbeddedRedis, batches: int, *, profile_dir: Path | None = None, engine: str = "",
    names: tuple[str, str] = ("first", "second"), extra_prompts: int = 0,
) -> tuple[float, float, float, float]:
    """(first, second) producer CPU ms per published sample over the measured window, then the
    same over each one's whole life (its CPU from start to SIGTERM, the groups its last heartbeat
    reports as published: start-up and idle time included)."""
    ns = f"restart-{time.monotonic_ns()}"
    redis = connect(server.url)
    keys = await init_ns(redis, ns, n_samples_per_prompt=N, batch_size=BATCH, max_backlog=4 * BATCH)
    dataset = OUT / f"{ns}.jsonl"
    _dataset(dataset, (batches + 1) * BATCH + extra_prompts)  # 0: each phase trains exactly one epoch
    window: list[float] = []
    life: list[float] = []
    with children() as procs:
        async with await GroupConsumer.connect(server.url, ns, "trainer", stall_timeout=120) as consumer:
            for epochs, name in ((1, names[0]), (2, names[1])):
                profile = profile_dir / f"restart-{epochs}.prof.txt" if profile_dir is not None else None
                cpu, samples, producer = await _phase(
                    server, consumer, ns, dataset, name, epochs, batches, profile, engine
                )
                procs.append(producer)
                window.append(cpu / max(1, samples) * 1e3)
                lifetime_cpu = cpu_seconds([producer.pid])
                os.kill(producer.pid, signal.SIGTERM)
                await asyncio.to_thread(producer.wait, 60)
                beat = Heartbeat.parse((await Heartbeats(redis, keys).raw())[name.encode()])
                life.append(lifetime_cpu / max(1, beat.published * N) * 1e3)
    await redis.aclose()
    dataset.unlink()
    return window[0], window[1], life[0], life[1]


async def measure(quick: bool, pairs: int) -> list[list[Any]]:
    batches = 3 if quick else 24
    rows: list[list[Any]] = []
    OUT.mkdir(parents=True, exist_ok=True)
    profile_dir = Path(os.environ["BENCH_RESTART_PROFILE"]) if "BENCH_RESTART_PROFILE" in os.environ else None
    with EmbeddedRedis() as server:
        for i in range(pairs):
            first, second, first_life, second_life = await restart_pair(server, batches, profile_dir=profile_dir)
            rows.append([i + 1, first, second, second / first, first_life, second_life, second_life / first_life])
    return rows


def run(quick: bool = False) -> list[Table]:
    rows = asyncio.run(measure(quick, 1 if quick else 4))
    return [Table(
        "restart",
        "A restarted producer's CPU per sample: first producer vs its replacement (8 x 1k tokens)",
        ["pair", "first producer CPU ms/sample", "second producer CPU ms/sample", "second/first",
         "first, whole life", "second, whole life", "second/first, whole life"],
        rows,
        [
            "Each pair: one namespace; producer 1 (python -m bench.worker produce, instant engine, 1024-token "
            "replies, concurrency 64) with `rollstream feed --epochs 1`, this process taking 64 groups and "
            "committing; SIGTERM; producer 2 (new name) with `rollstream feed --epochs 2` resuming at epoch 2.",
            "CPU ms/sample: the producer process's CPU-seconds over 24 batches after one warm-up batch, divided "
            "by the samples of the groups that producer published in them. Whole life: its CPU-seconds from "
            "start (imports included) to SIGTERM, divided by the samples its last heartbeat reports published.",
        ],
        "python -m bench restart",
    )]
