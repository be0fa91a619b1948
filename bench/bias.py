"""Does the trainer see the dataset, or its fast half? Issue 38's scenario on the simulator.

One epoch of 160 prompts, 80 % short (``[reply=40]``) and 20 % long (``[reply=500]``), 2 ms per
token, so a long reply takes about 1.5 training steps; n = 4, batch 8, ``max_staleness`` 1; one
producer process (``rollstream produce``, concurrency 64). Each step follows slime's pattern:
``take(8)``, 0.3 s of "training", ``commit``, then ``WeightSync(kind="sglang").update(...,
mode="abort")`` (pause with abort, reload, continue). Run with partial rollout off (the
namespace default) and on.

Measured from outside the pipeline (the benchmark knows which prompts are long): prompts
dead-lettered, long prompts trained within the epoch, the long prompts' share of the trained
groups against their share of the dataset (0.20), tokens the engine generated per token trained,
and how many steps after the short prompts fed beside them the long ones were trained.
``python -m bench bias`` (``--quick``: 40 prompts).
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections import Counter
from typing import Any

import httpx
from rollstream import WeightSync
from rollstream.common import bias
from rollstream.common.codec import prompt_fields
from rollstream.common.connection import connect
from rollstream.common.keys import PRODUCERS_GROUP, TRAINER_GROUP, Keys, StateField
from rollstream.common.models import Prompt
from rollstream.common.namespace import read_state, state_int
from rollstream.common.protocol import TrainerMonitor
from rollstream.consumer import GroupConsumer
from rollstream.consumer.biaswatch import BiasWatch
from rollstream.runtime.redis_server import EmbeddedRedis, free_port

from bench.common import IMG, OUT, Table, children, init_ns, make_group, spawn, wait_engine

N = 4
BATCH = 8
PROMPTS = 160
LONG_EVERY = 5
"""Every fifth prompt is long: 20 % of the dataset."""
SHORT_TOKENS = 40
LONG_TOKENS = 500
PER_TOKEN = 0.002
TRAIN = 0.3
CONCURRENCY = 64
MAX_STEPS = 80
"""A run stops here even if prompts are still out (a pipeline that never trains them)."""
LONG_BUCKET = "bias/response/128-511"
"""The long prompts' bucket in the pipeline's own ledger (``Batch.metrics``)."""
IDLE_END = 20.0
"""Seconds without a group before a run gives up on the prompts still out."""


def is_long(index: int) -> bool:
    return index % LONG_EVERY == LONG_EVERY - 1


def bias_prompt(index: int) -> Prompt:
    a, b = index % 97, (index * 7) % 89
    reply = LONG_TOKENS if is_long(index) else SHORT_TOKENS
    return Prompt(index=index, prompt=f"What is {a} + {b}? [reply={reply}]", label=str(a + b))


async def _dead_indices(redis: Any, keys: Keys) -> list[int]:
    return [int(fields[b"index"]) for _, fields in await redis.xrange(keys.dead) if b"index" in fields]


class _Warnings(logging.Handler):
    """Counts take()'s "does not see the dataset" warnings."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "does not see the dataset" in record.getMessage():
            self.lines.append(record.getMessage())


async def one_run(redis_url: str, engine_url: str, *, partial: bool, prompts: int, label: str) -> dict[str, Any]:
    """One epoch; what became of every prompt, per step."""
    warned = _Warnings()
    logging.getLogger("rollstream.consumer.group_consumer").addHandler(warned)
    ns = f"bias-{label}-{time.monotonic_ns()}"
    redis = connect(redis_url)
    keys = await init_ns(redis, ns, n_samples_per_prompt=N, batch_size=BATCH, max_staleness=1, partial_rollout=partial)
    async with redis.pipeline(transaction=False) as pipe:
        for i in range(prompts):
            pipe.xadd(keys.prompts, prompt_fields(bias_prompt(i)))  # type: ignore[arg-type]
        await pipe.execute()
    async with httpx.AsyncClient(timeout=10) as http:
        before = (await http.get(engine_url + "/sim/stats")).json()["generated_tokens"]
    trained_at: dict[int, int] = {}
    trained_tokens = 0
    steps: list[dict[str, float]] = []
    metrics: list[dict[str, float]] = []
    started = time.perf_counter()
    with children() as procs:
        procs.append(spawn(
            ["-m", "rollstream.cli", "produce", "--redis", redis_url, "--ns", ns, "--engine", engine_url,
             "--concurrency", str(CONCURRENCY), "--reward", "math", "--max-new-tokens", "1024", "--name", "p0",
             "--log-level", "WARNING"],
            OUT / f"bias-{label}.log",
        ))
        async with (
            await GroupConsumer.connect(redis_url, ns, "trainer", stall_timeout=60) as consumer,
            WeightSync([engine_url], kind="sglang") as sync,
        ):
            version = 0
            for step in range(MAX_STEPS):
                dead = await _dead_indices(redis, keys)
                left = prompts - len(trained_at) - len(set(dead))
                if left <= 0:
                    break
                try:
                    async with asyncio.timeout(IDLE_END):
                        batch = await consumer.take(min(BATCH, left))
                except TimeoutError:
                    break
                for group in batch.groups:
                    trained_at.setdefault(group.index, step)
                    trained_tokens += sum(s.response_length for s in group.samples)
                metrics.append(dict(batch.metrics))
                await asyncio.sleep(TRAIN)
                await consumer.commit(batch)
                version += 1
                await sync.update(consumer, f"/weights/{version}", version, mode="abort")
                long_trained = sum(1 for i in trained_at if is_long(i))
                steps.append({"step": step, "trained": len(trained_at), "long_trained": long_trained,
                              "batch_long": sum(1 for g in batch.groups if is_long(g.index)) / len(batch.groups),
                              "fed_long": sum(1 for i in range(max(trained_at) + 1) if is_long(i)),
                              "fed": max(trained_at) + 1})
        wall = time.perf_counter() - started
        state = await read_state(redis, keys)
        dead = await _dead_indices(redis, keys)
    async with httpx.AsyncClient(timeout=10) as http:
        generated = (await http.get(engine_url + "/sim/stats")).json()["generated_tokens"] - before
    await redis.aclose()
    logging.getLogger("rollstream.consumer.group_consumer").removeHandler(warned)
    long_total = sum(1 for i in range(prompts) if is_long(i))
    trained = len(trained_at)
    long_trained = sum(1 for i in trained_at if is_long(i))
    lags = []
    for i, at in trained_at.items():
        if not is_long(i):
            continue
        beside = [trained_at[j] for j in range(i - LONG_EVERY, i + LONG_EVERY + 1) if j in trained_at and not is_long(j)]
        if beside:
            lags.append(at - statistics.fmean(beside))
    return {
        "label": label, "partial": partial, "wall": wall, "steps": len(steps), "step_rows": steps,
        "dead_long": sum(1 for i in set(dead) if is_long(i)), "dead_short": sum(1 for i in set(dead) if not is_long(i)),
        "long_total": long_total, "long_trained": long_trained, "trained": trained,
        "long_share": long_trained / trained if trained else math.nan, "fed_share": long_total / prompts,
        "tokens_per_trained": generated / trained_tokens if trained_tokens else math.nan,
        "long_lag_steps": statistics.fmean(lags) if lags else math.nan,
        "recycled_aborted": state_int(state, "recycled_aborted"), "recycled_stale": state_int(state, "recycled_stale"),
        "recycled_weight_update": state_int(state, "recycled_weight_update"),
        "metrics": metrics, "warnings": warned.lines,
        "late": sum(int(m.get("lateness/groups", 0)) for m in metrics),
        "late_max": max((int(m.get("lateness/steps_max", 0)) for m in metrics), default=0),
        "ledger_long": _ledger_share(metrics),
    }


def _ledger_share(metrics: list[dict[str, float]]) -> str:
    """The pipeline's own view at the last batch: the long bucket's trained / fed share."""
    last = metrics[-1] if metrics else {}
    key = LONG_BUCKET
    if f"{key}/fed_share" not in last:
        return "-"
    return f"{last.get(f'{key}/trained_share', 0.0):.3f} / {last[f'{key}/fed_share']:.3f}"


async def measure(quick: bool) -> list[dict[str, Any]]:
    prompts = 40 if quick else PROMPTS
    port = free_port()
    engine_url = f"http://127.0.0.1:{port}"
    results = []
    with EmbeddedRedis() as server, children() as procs:
        procs.append(spawn(
            ["-m", "rollstream.cli", "sim-engine", "--port", str(port), "--length-sigma", "0",
             "--latency-per-token", str(PER_TOKEN), "--max-running", str(CONCURRENCY), "--log-level", "WARNING"],
            OUT / "sim-bias.log",
        ))
        await wait_engine(engine_url)
        for partial in (False, True):
            label = "partial-on" if partial else "partial-off"
            results.append(await one_run(server.url, engine_url, partial=partial, prompts=prompts, label=label))
    return results


def plot(results: list[dict[str, Any]], path: Any) -> None:
    """Per step: the long prompts' share of the groups trained so far and of the prompts fed so far
    (fed FIFO: every index up to the newest trained), against the dataset's 0.20."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    for r, color in zip(results, ("tab:blue", "tab:orange"), strict=False):
        rows = r["step_rows"]
        name = "partial rollout on (default)" if r["partial"] else "partial rollout off"
        steps = [x["step"] for x in rows]
        ax.plot(steps, [x["long_trained"] / x["trained"] for x in rows], color=color, label=f"trained, {name}")
        ax.plot(steps, [x["fed_long"] / x["fed"] for x in rows], color=color, linestyle="--", label=f"fed, {name}")
    if results:
        ax.axhline(results[0]["fed_share"], color="black", linestyle=":", label="dataset")
    ax.set_xlabel("training step")
    ax.set_ylabel("share of long prompts")
    ax.set_ylim(0, 0.4)
    ax.set_title("Long prompts: trained vs fed, a weight update (abort) every step")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def _mark_take_before(redis: Any, keys: Keys) -> None:
    """``TrainerMonitor.mark_take`` before the ledger (db2d175): one field of the state hash."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hset(keys.state, StateField.LAST_TAKE_MS, 1)
        pipe.xlen(keys.groups)
        pipe.xpending(keys.groups, TRAINER_GROUP)
        pipe.xpending(keys.prompts, PRODUCERS_GROUP)
        pipe.xpending(keys.retry, PRODUCERS_GROUP)
        pipe.hget(keys.state, StateField.ADMISSION_BLOCKED_MS)
        pipe.hgetall(keys.producers)
        await pipe.execute(raise_on_error=False)
    await redis.publish(keys.control, "taken")


async def ledger_cost(quick: bool) -> list[list[Any]]:
    """What the ledger adds to a take: per group, per take's round trip, per take's metrics."""
    rounds = 50 if quick else 400
    groups = [make_group(8, 256, index=i) for i in range(64)]
    started = time.perf_counter()
    for _ in range(rounds // 10):
        counts: Counter[str] = Counter()
        for group in groups:
            bias.deltas(group, "trained", counts)
    per_group = (time.perf_counter() - started) / (rounds // 10) / len(groups)
    fields = {bias.field(e, d, b, k): 5 for e in (0, 1) for d in ("prompt", "response", "attempts", "source")
              for b in "abcde" for k in bias.KINDS}
    watch = BiasWatch("bench", "bench", 30.0)
    started = time.perf_counter()
    for _ in range(rounds):
        watch.observe(groups, fields, counts)
    observe = (time.perf_counter() - started) / rounds
    with EmbeddedRedis() as server:
        redis = connect(server.url)
        keys = await init_ns(redis, "ledger", n_samples_per_prompt=8, batch_size=64)
        await redis.hset(keys.state, mapping=fields)  # type: ignore[arg-type]
        monitor = TrainerMonitor(redis, keys)
        increments = dict.fromkeys(list(fields)[:10], 1)
        calls = {
            "before (one state field)": lambda: _mark_take_before(redis, keys),
            "now, 200 ledger fields read": monitor.mark_take,
            "now, 200 read + 10 incremented": lambda: monitor.mark_take(increments),
        }
        seconds: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(rounds):  # interleaved: the server's drift falls on every variant alike
            for name, call in calls.items():
                t0 = time.perf_counter()
                await call()
                seconds[name].append(time.perf_counter() - t0)
        await redis.aclose()
    rows: list[list[Any]] = [["bias.deltas, per group (8 samples)", per_group * 1e6]]
    rows += [[f"mark_take: {name}", statistics.median(xs) * 1e6] for name, xs in seconds.items()]
    rows.append(["BiasWatch.observe, per take (200 ledger fields, 64 groups)", observe * 1e6])
    return rows


def run(quick: bool = False) -> list[Table]:
    cost = asyncio.run(ledger_cost(quick))
    results = asyncio.run(measure(quick))
    if not quick:
        try:
            plot(results, IMG / "bias-shares.png")
        except ImportError:
            pass
    rows = [[
        r["label"], r["steps"], f"{r['dead_long']} / {r['dead_short']}", f"{r['long_trained']} / {r['long_total']}",
        r["long_share"], r["fed_share"], r["tokens_per_trained"], r["long_lag_steps"],
        r["recycled_aborted"], r["recycled_weight_update"], r["recycled_stale"], r["ledger_long"],
        len(r["warnings"]), f"{r['late']} (max {r['late_max']})", r["wall"],
    ] for r in results]
    notes = [
        f"n={N}, batch {BATCH}, max_staleness 1, {PER_TOKEN * 1000:g} ms/token, long {LONG_TOKENS} / short "
        f"{SHORT_TOKENS} tokens, train {TRAIN} s, WeightSync(kind='sglang').update(mode='abort') after every commit.",
        *[f"{r['label']}: first bias warning: {r['warnings'][0]}" for r in results if r["warnings"]],
    ]
    cost_table = Table(
        "bias-cost", "The bias ledger's cost on the take path", ["what", "us (median)"], cost,
        ["mark_take is take()'s one statistics round trip (embedded Redis, interleaved calls); the ledger's "
         "increments of a take's hand-backs ride in it, a batch's trained counts go with commit."],
        command="python -m bench bias",
    )
    return [cost_table, Table(
        "bias",
        f"The trainer's view of the dataset: {results[0]['long_total'] if results else 0} long prompts of "
        f"{PROMPTS if not quick else 40}, a weight update (mode abort) every step",
        ["run", "steps", "dead-lettered long / short", "long trained", "long share trained", "long share fed",
         "tokens generated / trained", "long trained, steps after short", "recycled aborted",
         "recycled weight update", "recycled stale", "ledger: response 128-511 trained / fed share",
         "bias warnings", "late groups (most steps)", "wall s"],
        rows,
        notes,
        command="python -m bench bias",
    )]
