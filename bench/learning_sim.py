"""The learning-speed measurement at scale, simulated (issue 30 item 4): sync vs async step time
against the same bound, partial rollout on and off.

``python -m bench learning_sim``. In one process: the engine simulator (SGLang API) with
long-tailed response lengths (log-normal, sigma 1), 64 producers, and a trainer whose step is
modelled: a sleep proportional to the batch's response tokens, then the weight update the way a
trainer does it (``WeightSync``: pause with abort, load, version, continue). Redis is a real
embedded server. Modes, each on a fresh namespace, same engine, same prompts:

* ``sync``: max_staleness 0 (admission lets batch k in only once version k is set: generation
  and training alternate, and each step waits for its batch's longest sample);
* ``async, partial rollout off``: max_staleness 2; an update aborts the samples in flight and
  they start again from nothing, so a sample longer than a step's worth of tokens is aborted
  again and again;
* ``async, partial rollout on``: the same, and an aborted sample continues from its tokens.

The bound uses the sync run's own per-step generation time G (its wait in take()) and training
time T: sync costs G + T per step, a perfect overlap max(G, T). With long tails async can beat
this bound (its batches are not held up by their own longest sample: the mix of a batch comes
from what finished first), so a fraction above 1 is possible and says so.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from typing import Any

from rollstream.common.connection import connect
from rollstream.common.namespace import read_state, state_int
from rollstream.consumer import GroupConsumer
from rollstream.producer.engine import EngineClient, EngineSettings
from rollstream.producer.settings import EpisodeSettings, ProducerSettings
from rollstream.producer.worker import Producer
from rollstream.runtime.redis_server import EmbeddedRedis
from rollstream.testing.learning import Bound
from rollstream.testing.sim import SimConfig, SimEngine
from rollstream.weight_sync import WeightSync

from bench.common import ConstReward, Table, add_prompts, init_ns

PRODUCERS = 64
N = 8
BATCH = 16
SLOTS = BATCH * N
MEDIAN = 96
SIGMA = 1.0
CAP = 8 * MEDIAN
PER_TOKEN = 0.001
"""Engine seconds per generated token (every slot decodes in parallel)."""
TRAIN_PER_TOKEN = {"trainer-bound": 4e-5, "engine-bound": 1.5e-5}
"""Modelled trainer seconds per response token of the batch (~128 x 150 tokens: ~0.8 s a step, or
~0.3 s: then generation is the slower side and the work an abort throws away costs time)."""
MODES = (("sync", 0, False), ("async, partial rollout off", 2, False), ("async, partial rollout on", 2, True))


async def _one_mode(redis_url: str, engine: SimEngine, mode: str, max_staleness: int, partial: bool,
                    steps: int, per_token: float) -> dict[str, Any]:
    ns = f"sim-{mode.replace(' ', '-').replace(',', '')}-{time.monotonic_ns()}"
    redis = connect(redis_url)
    keys = await init_ns(redis, ns, n_samples_per_prompt=N, batch_size=BATCH, max_backlog=4 * BATCH,
                         max_staleness=max_staleness, partial_rollout=partial, max_attempts=1000)
    await add_prompts(redis, keys, 0, (steps + 6) * BATCH, with_ids=False)
    engine.state.weight_version = 0
    producers: list[Producer] = []
    clients: list[EngineClient] = []
    try:
        for i in range(PRODUCERS):
            client = EngineClient(EngineSettings(urls=(engine.url,), max_new_tokens=CAP))
            clients.append(client)
            settings = ProducerSettings(namespace=ns, concurrency=N, name=f"p{i}", drain_timeout=5.0,
                                        heartbeat_interval=5.0, episodes=EpisodeSettings(tokenize_prompts=False))
            producers.append(await Producer.connect(redis_url, settings, client, ConstReward()))
        async with asyncio.TaskGroup() as tasks:
            running = [tasks.create_task(p.run()) for p in producers]
            try:
                result = await _train(redis_url, ns, engine, steps, per_token)
            finally:
                for producer in producers:
                    producer.stop()
            del running
        state = await read_state(redis, keys)
    finally:
        for producer in producers:
            await producer.aclose()
        for client in clients:
            await client.aclose()
    await redis.aclose()
    result["dead"] = state_int(state, "dead_lettered")
    return result


async def _train(redis_url: str, ns: str, engine: SimEngine, steps: int, per_token: float) -> dict[str, Any]:
    generate, train, tokens = [], [], []
    recycled = {"aborted": 0, "stale": 0}
    async with (
        await GroupConsumer.connect(redis_url, ns, "trainer", stall_timeout=120) as consumer,
        WeightSync([engine.url], kind="sglang") as sync,
    ):
        started = 0.0
        for step in range(steps):
            t0 = time.perf_counter()
            async with asyncio.timeout(120):
                batch = await consumer.take(BATCH)
            t1 = time.perf_counter()
            batch_tokens = sum(s.response_length for g in batch.groups for s in g.samples)
            await asyncio.sleep(batch_tokens * per_token)
            await consumer.commit(batch)
            await sync.update(consumer, f"w{step + 1}", step + 1, mode="abort")
            t2 = time.perf_counter()
            for kind in recycled:
                recycled[kind] += int(batch.metrics.get(f"recycled_{kind}", 0))
            if step == 0:
                started = t2  # the first batch waits for the pipeline to fill: steps 1.. are timed
            else:
                generate.append(t1 - t0)
                train.append(t2 - t1)
            tokens.append(batch_tokens)
        wall = time.perf_counter() - started
    return {**recycled, "s_per_step": wall / max(1, steps - 1), "generate_s": statistics.median(generate) if generate else math.nan,
            "train_s": statistics.median(train) if train else math.nan,
            "tokens": statistics.mean(tokens)}


async def measure(steps: int) -> dict[tuple[str, str], dict[str, Any]]:
    mean = round(MEDIAN * math.exp(SIGMA**2 / 2))
    config = SimConfig(mean_tokens=mean, length_sigma=SIGMA, max_tokens_cap=CAP, latency_per_token=PER_TOKEN,
                       max_running=SLOTS)
    results = {}
    with EmbeddedRedis() as server:
        async with SimEngine(config) as engine:
            for case, per_token in TRAIN_PER_TOKEN.items():
                for mode, staleness, partial in MODES:
                    results[case, mode] = await _one_mode(server.url, engine, mode, staleness, partial, steps,
                                                          per_token)
    return results


def run(quick: bool = False) -> list[Table]:
    steps = 3 if quick else 12
    r = asyncio.run(measure(steps))
    rows = []
    for case, mode in r:
        sync = r[case, "sync"]
        bound = Bound(sync["generate_s"], sync["train_s"])
        m = r[case, mode]
        speedup = sync["s_per_step"] / m["s_per_step"]
        rows.append([case, mode, m["s_per_step"], m["generate_s"], m["train_s"], m["tokens"],
                     "-" if mode == "sync" else bound.speedup, "-" if mode == "sync" else speedup,
                     "-" if mode == "sync" else bound.fraction(speedup), m["aborted"], m["stale"]])
    return [Table(
        "learning_sim",
        f"Sync vs async at scale, simulated: {PRODUCERS} producers, long-tailed lengths, a modelled trainer "
        f"({steps} steps of {BATCH} groups x {N})",
        ["trainer", "mode", "s/step", "G s (take wait)", "T s (train + update)", "response tokens per batch",
         "bound (sync's G + T over max)", "speed-up vs sync", "fraction of bound", "groups recycled aborted",
         "groups recycled stale"],
        rows,
        [
            f"Simulator: log-normal response lengths, median {MEDIAN} tokens (sigma {SIGMA}), cut at {CAP}; "
            f"{PER_TOKEN * 1e3:.1f} ms per token, {SLOTS} slots; {PRODUCERS} in-process producers of {N} samples "
            "in flight each (one group), so the engine always has work queued in the async modes.",
            "Trainer: "
            + " or ".join(f"{v * 1e6:.0f} µs ({k})" for k, v in TRAIN_PER_TOKEN.items())
            + " per response token of the batch (a sleep), then WeightSync (SGLang kind: pause with abort, "
            "/update_weights_from_disk, version, continue).",
            "G: median wait in take(); T: median of the modelled step + the update (first step excluded; the "
            "clock starts at the first batch). Bound from the sync run's own G and T.",
            "Partial rollout off: an update aborts every sample in flight and it starts over (max_attempts 1000 "
            "here, so none is dead-lettered); on: it continues from its tokens. The difference is the work the "
            "aborts throw away, which grows with the tail.",
        ],
        "python -m bench learning_sim",
    )]
