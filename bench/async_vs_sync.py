"""Synchronous rollout vs rollstream fully-async, on the simulator with long-tailed lengths.

Both modes use the same engine simulator process, the same producer process and the same
trainer loop (take, "train" = sleep, commit, bump the weight version on the engine and in Redis);
only the scheduling differs:

* sync: add exactly one batch of prompts, wait for all its groups, train, repeat (the engine
  idles while the trainer trains, and each step waits for its longest sample);
* async: prompts are always available; max_staleness 1 (and 2) with staleness-aware admission;
  the engine keeps generating while the trainer trains (no pause: weights update in flight).

The theoretical bound is computed from the simulator's own length draw, and it counts the
staleness window: admission lets batch k in only once step k - s - 1 is committed (s =
max_staleness), so with long tails a step cannot be shorter than (longest sample + train) / (s + 1).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from typing import Any

import httpx
from rollstream.common.connection import connect
from rollstream.common.keys import Keys
from rollstream.common.namespace import read_state, state_int
from rollstream.consumer import GroupConsumer
from rollstream.runtime.redis_server import EmbeddedRedis, free_port

from bench.common import OUT, Table, add_prompts, children, cpu_seconds, init_ns, spawn, wait_engine

N = 8
BATCH = 16
SLOTS = BATCH * N
MEDIAN = 256
SIGMA = 1.0
CAP = 8 * MEDIAN
PER_TOKEN = 0.0008
TRAIN = 1.0
CONCURRENCY = SLOTS
"""Producer concurrency = engine slots: capacity comes back per sample, so a long tail holds one
slot, not its group's n (before per-sample release the benchmark needed 4x over-subscription)."""


def theoretical_bound(draws: int = 2000, seed: int = 0, max_staleness: int = 1) -> dict[str, float]:
    """The speedup the workload allows, from the simulator's own length draw.

    sync step = the longest of a batch's SLOTS samples + TRAIN (the engine has one slot per
    sample, so a batch takes as long as its longest sample); async step = the largest of TRAIN
    (the trainer's own step), the mean sample time (every slot busy) and (longest + TRAIN) /
    (max_staleness + 1): staleness-aware admission admits batch k only after step
    k - max_staleness - 1 is committed, so batch k has max_staleness + 1 steps to finish."""
    rng = random.Random(seed)
    mean = round(MEDIAN * math.exp(SIGMA**2 / 2))
    mu = math.log(mean) - SIGMA**2 / 2

    def sample() -> float:
        return min(CAP, round(rng.lognormvariate(mu, SIGMA))) * PER_TOKEN

    longest = sum(max(sample() for _ in range(SLOTS)) for _ in range(draws // 10)) / (draws // 10)
    average = sum(sample() for _ in range(draws * 10)) / (draws * 10)
    sync_step = longest + TRAIN
    async_step = max(TRAIN, average, (longest + TRAIN) / (max_staleness + 1))
    return {"sync_step": sync_step, "async_step": async_step, "speedup": sync_step / async_step,
            "longest": longest, "mean": average}


async def _sample_slots(url: str, stop: asyncio.Event, out: list[float]) -> None:
    async with httpx.AsyncClient() as http:
        while not stop.is_set():
            try:
                out.append((await http.get(url + "/sim/stats", timeout=2)).json()["running"] / SLOTS)
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            await asyncio.sleep(0.05)


async def _one_mode(
    redis_url: str, engine_url: str, sim_pid: int, mode: str, steps: int, concurrency: int = CONCURRENCY,
    max_staleness: int = 1,
) -> dict[str, Any]:
    ns = f"{mode}-{time.monotonic_ns()}"
    redis = connect(redis_url)
    staleness: dict[str, Any] = {"max_staleness": max_staleness} if mode == "async" else {}
    keys: Keys = await init_ns(redis, ns, n_samples_per_prompt=N, batch_size=BATCH, max_backlog=4 * BATCH, **staleness)
    async with httpx.AsyncClient(timeout=10) as http:
        await http.post(engine_url + "/update_weights_from_disk", json={"model_path": "w0", "weight_version": "0"})
        with children() as procs:
            procs.append(spawn(
                ["-m", "bench.worker", "produce", "--redis", redis_url, "--ns", ns, "--engine", engine_url,
                 "--concurrency", str(concurrency), "--reward", "math", "--max-new-tokens", str(CAP), "--name", "p0"],
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
                cpu0 = (cpu_seconds([sim_pid]), cpu_seconds([procs[0].pid]), time.process_time())
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
                cpu1 = (cpu_seconds([sim_pid]), cpu_seconds([procs[0].pid]), time.process_time())
                stop.set()
                await sampler
                state = await read_state(redis, keys)
    await redis.aclose()
    return {
        "wall": wall, "idle": waiting / wall, "slots": sum(slots) / len(slots) if slots else math.nan,
        "stale": state_int(state, "recycled_stale"), "aborted": state_int(state, "recycled_aborted"),
        "published": state_int(state, "published"), "taken_stale_metric": stale, "takes": takes,
        "cpu": [(b - a) / wall for a, b in zip(cpu0, cpu1, strict=True)],
    }


async def measure(quick: bool) -> dict[str, dict[str, Any]]:
    steps = 2 if quick else 12
    port = free_port()
    engine_url = f"http://127.0.0.1:{port}"
    mean = round(MEDIAN * math.exp(SIGMA**2 / 2))
    results: dict[str, dict[str, Any]] = {}
    with EmbeddedRedis() as server, children() as procs:
        sim = spawn(
            ["-m", "rollstream.cli", "sim-engine", "--port", str(port), "--mean-tokens", str(mean),
             "--length-sigma", str(SIGMA), "--latency-per-token", str(PER_TOKEN), "--max-running", str(SLOTS),
             "--log-level", "WARNING"],
            OUT / "sim-async-vs-sync.log",
        )
        procs.append(sim)
        await wait_engine(engine_url)
        for mode in ("sync", "async"):
            results[mode] = await _one_mode(server.url, engine_url, sim.pid, mode, steps)
        if not quick:
            results["async, max_staleness 2"] = await _one_mode(
                server.url, engine_url, sim.pid, "async", steps, max_staleness=2
            )
            # what per-sample capacity saves: the old 4x over-subscription, for comparison
            results["async, concurrency 4x slots"] = await _one_mode(
                server.url, engine_url, sim.pid, "async", steps, concurrency=4 * CONCURRENCY
            )
        results["steps"] = {"steps": steps}
    return results


def run(quick: bool = False) -> list[Table]:
    r = asyncio.run(measure(quick))
    bound = theoretical_bound()
    steps = r["steps"]["steps"]
    rows = []
    for mode in [k for k in r if k != "steps"]:
        m = r[mode]
        speedup = r["sync"]["wall"] / m["wall"]
        row_bound = theoretical_bound(max_staleness=2 if "max_staleness 2" in mode else 1)
        ideal = row_bound["sync_step" if mode == "sync" else "async_step"]
        fraction = speedup / row_bound["speedup"] if mode != "sync" else "-"
        cpu = m["cpu"]
        rows.append([mode, m["wall"], m["wall"] / steps, ideal, (m["wall"] / steps) / ideal,
                     "-" if mode == "sync" else row_bound["speedup"], speedup, fraction, m["slots"],
                     m["idle"], m["stale"], m["published"], f"{cpu[0]:.2f} / {cpu[1]:.2f} / {cpu[2]:.2f}"])
    return [Table(
        "async_vs_sync",
        f"Synchronous rollout vs rollstream fully-async ({steps} steps of {BATCH} groups x {N})",
        ["mode", "wall s", "s/step", "ideal s/step", "s/step / ideal", "bound speedup", "speedup vs sync",
         "fraction of the bound",
         "engine slot utilisation", "trainer idle fraction",
         "groups recycled stale", "groups published", "CPU cores sim / producer / trainer"],
        rows,
        [
            f"Simulator: log-normal response lengths, median {MEDIAN} tokens (sigma {SIGMA}, mean "
            f"{round(MEDIAN * math.exp(SIGMA**2 / 2))}), truncated at {CAP}; {PER_TOKEN * 1e3:.1f} ms per token, "
            f"so a median sample takes {MEDIAN * PER_TOKEN:.2f} s and the longest {CAP * PER_TOKEN:.2f} s; "
            f"{SLOTS} slots = one batch of samples. Scaled down from a ~1k-token median so the run takes ~1 min.",
            f"Train step: a fixed {TRAIN:.1f} s sleep, then the weight version goes up on the engine and in Redis "
            "(no pause, no abort).",
            f"Both modes: 1 producer process with concurrency {CONCURRENCY} samples (= the engine's slots: capacity "
            "is released per sample, so a long-tailed group holds one slot, not n). The last row repeats async "
            f"with {4 * CONCURRENCY} (the 4x over-subscription the benchmark needed while capacity was released "
            "per group). async: max_staleness 1 with staleness-aware admission.",
            "CPU columns: cores used (CPU-seconds per wall-second) by the simulator, the producer and this "
            "process (the trainer) over the measured steps; a simulator well under 1 core is not CPU-bound.",
            "Slot utilisation: mean of the simulator's running/slots sampled every 50 ms; trainer idle: time "
            "inside take() / wall.",
            f"Theoretical bound (computed here from the same length draw): sync step = longest of {SLOTS} samples "
            f"({bound['longest']:.2f} s) + train = {bound['sync_step']:.2f} s; async step = max(train, mean sample "
            f"{bound['mean']:.2f} s, (longest + train) / (max_staleness + 1)) = {bound['async_step']:.2f} s with "
            f"max_staleness 1 (bound {bound['speedup']:.2f}x), "
            f"{theoretical_bound(max_staleness=2)['async_step']:.2f} s with 2 "
            f"(bound {theoretical_bound(max_staleness=2)['speedup']:.2f}x): admission lets batch k in only after "
            "step k - max_staleness - 1, so a batch has max_staleness + 1 steps for its longest sample. "
            "'fraction of the bound' = measured speedup / the row's bound speedup; 's/step / ideal' compares each "
            "row with its own ideal step (sync included).",
        ],
        "python -m bench async_vs_sync",
    )]
