"""Synchronous rollout vs rollstream fully-async, on the simulator with long-tailed lengths.

Both modes use the same engine simulator process, the same producer process and the same
trainer loop (take, "train" = sleep, commit, bump the weight version on the engine and in Redis);
only the scheduling differs:

* sync: add exactly one batch of prompts, wait for all its groups, train, repeat (the engine
  idles while the trainer trains, and each step waits for its longest sample);
* async: prompts are always available; max_staleness 1 with staleness-aware admission; the
  engine keeps generating while the trainer trains (no pause: weights update in flight).
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import httpx
from rollstream.common.connection import connect
from rollstream.common.keys import Keys
from rollstream.common.namespace import read_state, state_int
from rollstream.consumer import GroupConsumer
from rollstream.testing.server import EmbeddedRedis, free_port

from bench.common import OUT, Table, add_prompts, children, init_ns, spawn

N = 8
BATCH = 16
SLOTS = BATCH * N
MEDIAN = 256
SIGMA = 1.0
CAP = 8 * MEDIAN
PER_TOKEN = 0.0008
TRAIN = 1.0
CONCURRENCY = 4 * SLOTS


async def _wait_engine(url: str) -> None:
    async with httpx.AsyncClient() as http:
        for _ in range(400):
            try:
                if (await http.get(url + "/health", timeout=1)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError("simulator did not start")


async def _sample_slots(url: str, stop: asyncio.Event, out: list[float]) -> None:
    async with httpx.AsyncClient() as http:
        while not stop.is_set():
            try:
                out.append((await http.get(url + "/sim/stats", timeout=2)).json()["running"] / SLOTS)
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            await asyncio.sleep(0.05)


async def _one_mode(redis_url: str, engine_url: str, mode: str, steps: int) -> dict[str, Any]:
    ns = f"{mode}-{time.monotonic_ns()}"
    redis = connect(redis_url)
    staleness: dict[str, Any] = {"max_staleness": 1} if mode == "async" else {}
    keys: Keys = await init_ns(redis, ns, n_samples_per_prompt=N, batch_size=BATCH, max_backlog=4 * BATCH, **staleness)
    async with httpx.AsyncClient(timeout=10) as http:
        await http.post(engine_url + "/update_weights_from_disk", json={"model_path": "w0", "weight_version": "0"})
        with children() as procs:
            procs.append(spawn(
                ["-m", "bench.worker", "produce", "--redis", redis_url, "--ns", ns, "--engine", engine_url,
                 "--concurrency", str(CONCURRENCY), "--reward", "math", "--max-new-tokens", str(CAP), "--name", "p0"],
                OUT / f"worker-{ns}.log",
            ))
            while not await redis.hlen(keys.producers):  # noqa: ASYNC110 - polling another process
                await asyncio.sleep(0.05)
            async with await GroupConsumer.connect(redis_url, ns, "trainer", stall_timeout=60) as consumer:
                stop = asyncio.Event()
                slots: list[float] = []
                sampler = asyncio.create_task(_sample_slots(engine_url, stop, slots))
                fed = 0
                if mode == "async":
                    await add_prompts(redis, keys, 0, (steps + 4) * BATCH, with_ids=False)
                waiting = 0.0
                takes: list[float] = []
                stale = 0
                started = time.perf_counter()
                for step in range(steps):
                    if mode == "sync":
                        await add_prompts(redis, keys, fed, BATCH, with_ids=False)
                        fed += BATCH
                    t0 = time.perf_counter()
                    batch = await consumer.take(BATCH)
                    waiting += time.perf_counter() - t0
                    takes.append(time.perf_counter() - t0)
                    stale += int(batch.metrics.get("recycled_stale", 0))
                    await asyncio.sleep(TRAIN)
                    await consumer.commit(batch)
                    version = step + 1
                    await http.post(engine_url + "/update_weights_from_disk",
                                    json={"model_path": f"w{version}", "weight_version": str(version)})
                    await consumer.set_weight_version(version)
                wall = time.perf_counter() - started
                stop.set()
                await sampler
                state = await read_state(redis, keys)
    await redis.aclose()
    return {
        "wall": wall, "idle": waiting / wall, "slots": sum(slots) / len(slots) if slots else math.nan,
        "stale": state_int(state, "recycled_stale"), "aborted": state_int(state, "recycled_aborted"),
        "published": state_int(state, "published"), "taken_stale_metric": stale, "takes": takes,
    }


async def measure(quick: bool) -> dict[str, dict[str, Any]]:
    steps = 2 if quick else 12
    port = free_port()
    engine_url = f"http://127.0.0.1:{port}"
    mean = round(MEDIAN * math.exp(SIGMA**2 / 2))
    results: dict[str, dict[str, Any]] = {}
    with EmbeddedRedis() as server, children() as procs:
        procs.append(spawn(
            ["-m", "rollstream.cli", "sim-engine", "--port", str(port), "--mean-tokens", str(mean),
             "--length-sigma", str(SIGMA), "--latency-per-token", str(PER_TOKEN), "--max-running", str(SLOTS),
             "--log-level", "WARNING"],
            OUT / "sim-async-vs-sync.log",
        ))
        await _wait_engine(engine_url)
        for mode in ("sync", "async"):
            results[mode] = await _one_mode(server.url, engine_url, mode, steps)
        results["steps"] = {"steps": steps}
    return results


def run(quick: bool = False) -> list[Table]:
    r = asyncio.run(measure(quick))
    steps = r["steps"]["steps"]
    rows = []
    for mode in ("sync", "async"):
        m = r[mode]
        rows.append([mode, m["wall"], m["wall"] / steps, r["sync"]["wall"] / m["wall"], m["slots"], m["idle"],
                     m["stale"], m["published"]])
    return [Table(
        "async_vs_sync",
        f"Synchronous rollout vs rollstream fully-async ({steps} steps of {BATCH} groups x {N})",
        ["mode", "wall s", "s/step", "speedup vs sync", "engine slot utilisation", "trainer idle fraction",
         "groups recycled stale", "groups published"],
        rows,
        [
            f"Simulator: log-normal response lengths, median {MEDIAN} tokens (sigma {SIGMA}, mean "
            f"{round(MEDIAN * math.exp(SIGMA**2 / 2))}), truncated at {CAP}; {PER_TOKEN * 1e3:.1f} ms per token, "
            f"so a median sample takes {MEDIAN * PER_TOKEN:.2f} s and the longest {CAP * PER_TOKEN:.2f} s; "
            f"{SLOTS} slots = one batch of samples. Scaled down from a ~1k-token median so the run takes ~1 min.",
            f"Train step: a fixed {TRAIN:.1f} s sleep, then the weight version goes up on the engine and in Redis "
            "(no pause, no abort).",
            f"Both modes: 1 producer process with concurrency {CONCURRENCY} samples (4x the slots: a group holds its n samples of capacity until its slowest sample ends, so concurrency = slots would leave slots idle behind long tails). async: max_staleness 1 with staleness-aware admission.",
            "Slot utilisation: mean of the simulator's running/slots sampled every 50 ms; trainer idle: time "
            "inside take() / wall.",
        ],
        "python -m bench async_vs_sync",
    )]
