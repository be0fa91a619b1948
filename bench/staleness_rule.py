"""Which staleness rule for continued samples, and should partial rollout be on by default
(issue 38 item 2): the cadence's cost in generated tokens, steps and the trained length mix.

``python -m bench staleness_rule``. In one process: the engine simulator (SGLang API) with
long-tailed response lengths (log-normal, sigma 1: a long reply outlasts a training step), 64
in-process producers, and a trainer whose step is modelled (a sleep per response token of the
batch), then a weight update the way slime does it (``WeightSync``: pause with abort, load,
version, continue), ``max_staleness`` 1, the namespace's other defaults (``max_attempts`` 5).
Prompts carry their token ids, so an aborted call can be continued. Modes, each on a fresh
namespace, same engine and prompts:

* partial rollout off (the default before issue 38): every update aborts the samples in flight
  and they start again from nothing (the group is recycled);
* partial rollout on, ``oldest_token`` (the strict rule): a continued sample counts its
  staleness from its first token, so a long one goes stale and is recycled from scratch;
* partial rollout on, ``newest_token`` (the rule chosen): it counts from its last engine call,
  and each token's lag goes to the trainer (``token_lag_*``, ``Batch.token_lags_numpy``).

Reported: s/step, engine tokens generated per response token trained (1 = nothing thrown away),
groups recycled (aborted, stale) and dead-lettered, the mean response length trained against the
simulator's mean (the length bias), and the tokens' version lags in the batches.
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
from rollstream.producer.settings import ProducerSettings
from rollstream.producer.worker import Producer
from rollstream.runtime.redis_server import EmbeddedRedis
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
TRAIN_PER_TOKEN = 1.5e-5
"""Modelled trainer seconds per response token of the batch (~0.3 s a step: generation is the
slower side, so what an abort throws away costs time)."""
MAX_STALENESS = 1
MODES = (
    ("partial rollout off", False, "oldest_token"),
    ("partial on, oldest_token (strict)", True, "oldest_token"),
    ("partial on, newest_token (chosen)", True, "newest_token"),
)


async def _one_mode(redis_url: str, engine: SimEngine, mode: str, partial: bool, rule: str,
                    steps: int) -> dict[str, Any]:
    ns = f"rule-{mode.split(' ')[0]}-{rule}-{time.monotonic_ns()}"
    redis = connect(redis_url)
    keys = await init_ns(redis, ns, n_samples_per_prompt=N, batch_size=BATCH, max_backlog=4 * BATCH,
                         max_staleness=MAX_STALENESS, partial_rollout=partial, staleness_rule=rule)
    await add_prompts(redis, keys, 0, (steps + 8) * BATCH)
    engine.state.weight_version = 0
    generated_before = engine.state.generated_tokens
    producers: list[Producer] = []
    clients: list[EngineClient] = []
    try:
        for i in range(PRODUCERS):
            client = EngineClient(EngineSettings(urls=(engine.url,), max_new_tokens=CAP))
            clients.append(client)
            settings = ProducerSettings(namespace=ns, concurrency=N, name=f"p{i}", drain_timeout=5.0,
                                        heartbeat_interval=5.0)
            producers.append(await Producer.connect(redis_url, settings, client, ConstReward()))
        async with asyncio.TaskGroup() as tasks:
            running = [tasks.create_task(p.run()) for p in producers]
            try:
                result = await _train(redis_url, ns, engine, steps)
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
    generated = engine.state.generated_tokens - generated_before
    result["dead"] = state_int(state, "dead_lettered")
    result["tokens_per_trained"] = generated / max(1, result["trained_tokens"])
    return result


async def _train(redis_url: str, ns: str, engine: SimEngine, steps: int) -> dict[str, Any]:
    lengths: list[int] = []
    lag_means: list[float] = []
    lag_max = staleness_max = 0.0
    recycled = {"aborted": 0, "stale": 0}
    async with (
        await GroupConsumer.connect(redis_url, ns, "trainer", stall_timeout=120) as consumer,
        WeightSync([engine.url], kind="sglang") as sync,
    ):
        started = 0.0
        for step in range(steps):
            async with asyncio.timeout(180):
                batch = await consumer.take(BATCH)
            batch_lengths = [s.response_length for g in batch.groups for s in g.samples]
            await asyncio.sleep(sum(batch_lengths) * TRAIN_PER_TOKEN)
            await consumer.commit(batch)
            await sync.update(consumer, f"w{step + 1}", step + 1, mode="abort")
            for kind in recycled:
                recycled[kind] += int(batch.metrics.get(f"recycled_{kind}", 0))
            lengths += batch_lengths
            lag_means.append(batch.metrics["token_lag_mean"])
            lag_max = max(lag_max, batch.metrics["token_lag_max"])
            staleness_max = max(staleness_max, batch.metrics["staleness_max"])
            if step == 0:
                started = time.perf_counter()  # the first batch waits for the pipeline to fill
        wall = time.perf_counter() - started
    return {**recycled, "s_per_step": wall / max(1, steps - 1), "trained_tokens": sum(lengths),
            "mean_length": statistics.mean(lengths), "lag_mean": statistics.mean(lag_means), "lag_max": lag_max,
            "staleness_max": staleness_max}


async def measure(steps: int) -> dict[str, dict[str, Any]]:
    mean = round(MEDIAN * math.exp(SIGMA**2 / 2))
    config = SimConfig(mean_tokens=mean, length_sigma=SIGMA, max_tokens_cap=CAP, latency_per_token=PER_TOKEN,
                       max_running=SLOTS)
    results = {}
    with EmbeddedRedis() as server:
        async with SimEngine(config) as engine:
            for mode, partial, rule in MODES:
                results[mode] = await _one_mode(server.url, engine, mode, partial, rule, steps)
    return results


def run(quick: bool = False) -> list[Table]:
    steps = 3 if quick else 16
    r = asyncio.run(measure(steps))
    rows = [
        [mode, m["s_per_step"], m["tokens_per_trained"], m["aborted"], m["stale"], m["dead"], m["mean_length"],
         m["lag_mean"], m["lag_max"], m["staleness_max"]]
        for mode, m in r.items()
    ]
    mean = round(MEDIAN * math.exp(SIGMA**2 / 2))
    return [Table(
        "staleness_rule",
        f"Partial rollout and the staleness rule of continued samples: {steps} steps of {BATCH} groups x {N}, "
        f"max_staleness {MAX_STALENESS}, a weight update (abort) every step",
        ["mode", "s/step", "tokens generated per token trained", "groups recycled aborted",
         "groups recycled stale", "dead-lettered", "mean response length trained", "token lag mean",
         "token lag max", "staleness max (the rule's)"],
        rows,
        [
            f"Simulator: log-normal response lengths, median {MEDIAN} tokens (sigma {SIGMA}, mean ~{mean}), cut "
            f"at {CAP}; {PER_TOKEN * 1e3:.1f} ms per token, {SLOTS} slots; {PRODUCERS} in-process producers of "
            f"{N} samples in flight each. A continued request draws a fresh length for its remainder, so continued "
            "samples run longer than the draw; every token of them is trained.",
            f"Trainer: {TRAIN_PER_TOKEN * 1e6:.0f} µs per response token of the batch (a sleep), then WeightSync "
            "(SGLang kind: pause with abort, /update_weights_from_disk, version, continue). s/step from the "
            "first batch on.",
            "Tokens generated per token trained: the simulator's generated tokens (aborted ones included) over "
            "the response tokens of the committed batches; the tokens still in flight at the end count as "
            "generated, so 1.0 is not reachable exactly.",
            "token lag: trainer version minus the version of each trained token (Batch.metrics token_lag_mean "
            "averaged over steps, token_lag_max over the run).",
        ],
        "python -m bench staleness_rule",
    )]
