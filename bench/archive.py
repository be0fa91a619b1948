"""The archive's cost (issue 41 item 5): ``python -m bench archive``.

1. **take + commit with and without the archive.** Groups of 8 x 1k tokens (log-probs, no R3)
   are published straight into the stream and a trainer takes and commits them in batches of 16:
   on a namespace without an archive, with an archive budget and no archiver (the commit script
   copies each group into the archive stream), and with an archiver running beside it. Rounds
   alternate; medians.
2. **One archiver's rate.** The records the second case left are written to Parquet by one
   ``rollstream archive`` process: records/s and its CPU, against the trainer's rate above (the
   most the pipeline can hand it on this machine).
3. **Redis memory with the archiver stopped for a minute.** A trainer commits at a steady pace
   for ``STOPPED_S`` seconds with no archiver: Redis ``used_memory`` growth against the archive's
   own byte count, once under a budget that holds the minute and once under a small one (the
   oldest records are dropped and counted; memory stays at the budget).
4. **Step time with and without an eval running.** A producer process and the simulator feed a
   trainer that takes 8 groups of 4, trains (a sleep) and commits; then an eval set of 64 prompts
   x 4 samples is submitted with ``GroupConsumer.evaluate`` and the trainer goes on until
   ``eval_results()`` returns it. Mean step time before and during the eval (target: at most
   1.2x), and the same eval run with the trainer waiting for it on a fixed version (what a
   blocking eval costs, and its mean reward to compare).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from rollstream.common.codec import group_fields
from rollstream.common.connection import connect
from rollstream.common.keys import Keys, StateField
from rollstream.consumer import GroupConsumer
from rollstream.runtime.redis_server import EmbeddedRedis
from rollstream.testing.sim import SimConfig, SimEngine

from bench.common import OUT, Table, add_prompts, cpu_seconds, init_ns, make_group, spawn, stop_all

BATCH = 16
STOPPED_S = 60.0
PACE_GROUPS_S = 16.0
"""The steady trainer of part 3: one batch of 16 groups a second."""


async def _publish(redis: Redis, keys: Keys, fields: dict[str, Any], count: int) -> None:
    async with redis.pipeline(transaction=False) as pipe:
        for _ in range(count):
            pipe.xadd(keys.groups, fields)  # type: ignore[arg-type]
        await pipe.execute()


async def _state(redis: Redis, keys: Keys, name: str) -> int:
    return int(await redis.hget(keys.state, name) or 0)


async def _take_commit(url: str, ns: str, groups: int) -> float:
    """Groups/s of take + commit of ``groups`` groups already in the stream."""
    async with await GroupConsumer.connect(url, ns, "bench-trainer") as consumer:
        started = time.perf_counter()
        for _ in range(groups // BATCH):
            batch = await consumer.take(BATCH)
            await consumer.commit(batch)
        return groups / (time.perf_counter() - started)


async def _archive_until_empty(url: str, redis: Redis, keys: Keys, out: Path, log: Path) -> tuple[float, float, int]:
    """(records/s, archiver CPU seconds, records) of one archiver emptying the archive stream,
    timed from the moment it said it was running (``archive_seen_ms``) to its last confirmation."""
    recorded = await _state(redis, keys, StateField.ARCHIVE_RECORDED)
    await redis.hdel(keys.state, StateField.ARCHIVE_SEEN_MS)
    child = spawn(["-m", "rollstream.cli", "archive", "--redis", url, "--ns", keys.namespace, "--out", str(out),
                   "--flush-seconds", "0.5", "--log-level", "WARNING"], log=log)
    try:
        began: float | None = None
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if began is None and await _state(redis, keys, StateField.ARCHIVE_SEEN_MS):
                began = time.perf_counter()
            if began is not None and await _state(redis, keys, StateField.ARCHIVED) >= recorded:
                break
            if child.poll() is not None:
                raise RuntimeError(f"the archiver exited {child.returncode}; see {log}")
            await asyncio.sleep(0.005)
        else:
            raise RuntimeError(f"the archiver did not finish; see {log}")
        elapsed = time.perf_counter() - (began or 0.0)
        return recorded / elapsed, cpu_seconds([child.pid]), recorded
    finally:
        stop_all([child])


async def _paced_minute(
    redis: Redis, url: str, ns: str, n: int, fields: dict[str, Any], seconds: float, budget: int
) -> dict[str, float]:
    """A trainer committing PACE_GROUPS_S groups/s for ``seconds`` with no archiver running."""
    keys = await init_ns(redis, ns, n_samples_per_prompt=n, batch_size=BATCH, max_backlog=10_000, archive_bytes=budget)
    await redis.execute_command("MEMORY", "PURGE")
    before = int((await redis.info("memory"))["used_memory"])
    async with await GroupConsumer.connect(url, ns, "bench-trainer") as consumer:
        started = time.monotonic()
        step = 0
        while time.monotonic() - started < seconds:
            await _publish(redis, keys, fields, BATCH)
            await consumer.commit(await consumer.take(BATCH))
            step += 1
            await asyncio.sleep(max(0.0, started + step * BATCH / PACE_GROUPS_S - time.monotonic()))
    after = int((await redis.info("memory"))["used_memory"])
    return {
        "groups": step * BATCH, "used_mb": (after - before) / 2**20,
        "archive_mb": await _state(redis, keys, StateField.ARCHIVE_BYTES) / 2**20,
        "records": await redis.xlen(keys.archive), "dropped": await _state(redis, keys, StateField.ARCHIVE_DROPPED),
    }


TRAIN_S = 0.3
"""The trainer's step in part 4 (a sleep)."""
EVAL_PROMPTS = 64


async def _eval_beside_training(url: str, redis: Redis, quick: bool) -> dict[str, Any]:
    """Part 4: step times before and during an eval, and the same eval with training stopped."""
    steps = 3 if quick else 15
    eval_set = [{"prompt": f"What is {i} + {i % 7}?", "label": str(i + i % 7)} for i in range(8 if quick else EVAL_PROMPTS)]
    ns = "arch-eval"
    keys = await init_ns(redis, ns, n_samples_per_prompt=4, batch_size=8, max_backlog=32)
    await add_prompts(redis, keys, 0, 4000)
    config = SimConfig(seed=5, accuracy=0.6, mean_tokens=48, latency_per_token=0.002, max_running=64)
    out: dict[str, Any] = {}
    async with SimEngine(config) as engine:
        child = spawn(["-m", "rollstream.cli", "produce", "--redis", url, "--ns", ns, "--engine", engine.url,
                       "--concurrency", "48", "--reward", "math", "--max-new-tokens", "256", "--log-level", "WARNING"],
                      log=OUT / "archive-eval-producer.log")
        try:
            async with await GroupConsumer.connect(url, ns, "bench-trainer") as consumer:
                version = 0

                async def step() -> float:
                    nonlocal version
                    started = time.perf_counter()
                    batch = await consumer.take(8)
                    await asyncio.sleep(TRAIN_S)
                    await consumer.commit(batch)
                    version += 1
                    engine.state.set_version(version)  # the simulator takes the new weights at once
                    await consumer.set_weight_version(version)
                    return time.perf_counter() - started

                async with asyncio.timeout(900):
                    for _ in range(2):  # warm-up: the producer's start and the first groups
                        await step()
                    before = [await step() for _ in range(steps)]
                    submitted = time.perf_counter()
                    await consumer.evaluate("beside", eval_set, n_samples=4, max_new_tokens=128)
                    during: list[float] = []
                    results: list[Any] = []
                    while not results:
                        during.append(await step())
                        results = [r for r in await consumer.eval_results() if r.name == "beside"]
                    out["eval_s"] = time.perf_counter() - submitted
                    # the same eval with the trainer waiting for it (a blocking eval on a fixed version)
                    blocked = time.perf_counter()
                    await consumer.evaluate("blocking", eval_set, n_samples=4, max_new_tokens=128)
                    fixed: list[Any] = []
                    while not fixed:
                        await asyncio.sleep(0.05)
                        fixed = [r for r in await consumer.eval_results() if r.name == "blocking"]
                    out["blocking_s"] = time.perf_counter() - blocked
        finally:
            stop_all([child])
    out.update(before=before, during=during, beside=results[0], fixed=fixed[0])
    return out


async def _run(quick: bool) -> list[Table]:
    n, tokens = (2, 64) if quick else (8, 1024)
    groups = BATCH * (2 if quick else 128)
    rounds = 1 if quick else 3
    stopped = 3.0 if quick else STOPPED_S
    group = make_group(n, tokens, seed=1)
    fields: dict[str, Any] = dict(group_fields(group))
    group_bytes = len(fields["data"])
    work = Path(tempfile.mkdtemp(prefix="rs-bench-archive-"))
    with EmbeddedRedis(dir=work / "redis") as server:
        url = server.url
        redis = connect(url)
        try:
            rates: dict[str, list[float]] = {"off": [], "on, no archiver": [], "on, archiver running": []}
            archiver_rates: list[tuple[float, float, int]] = []
            for r in range(rounds):
                for case in rates:
                    ns = f"arch-{r}-{case.replace(' ', '').replace(',', '')}"
                    keys = await init_ns(redis, ns, n_samples_per_prompt=n, batch_size=BATCH, max_backlog=10_000,
                                         archive_bytes=0 if case == "off" else 8 * 2**30)
                    await _publish(redis, keys, fields, groups)
                    child = None
                    if case == "on, archiver running":
                        child = spawn(["-m", "rollstream.cli", "archive", "--redis", url, "--ns", ns, "--out",
                                       str(work / ns), "--log-level", "WARNING"], log=OUT / "archive-archiver.log")
                    try:
                        rates[case].append(await _take_commit(url, ns, groups))
                    finally:
                        if child is not None:
                            stop_all([child])
                    if case == "on, no archiver":
                        archiver_rates.append(
                            await _archive_until_empty(url, redis, keys, work / ns, OUT / "archive-archiver.log")
                        )
                    await redis.delete(*keys.all_keys())
            minute = await _paced_minute(redis, url, "arch-minute", n, fields, stopped, 2**30)
            small_budget = max(group_bytes * 8, int(minute["archive_mb"] * 2**20 / 4))
            bounded = await _paced_minute(redis, url, "arch-bounded", n, fields, stopped, small_budget)
            evals = await _eval_beside_training(url, redis, quick)
        finally:
            await redis.aclose()

    off = statistics.median(rates["off"])
    take = Table(
        "archive-take", f"take + commit with and without the archive ({n} x {tokens}-token groups, "
        f"{group_bytes / 1024:.0f} KiB each, batches of {BATCH}, {groups} groups, median of {rounds} rounds)",
        ["case", "groups/s", "vs off", "rounds"],
        [[case, round(statistics.median(v), 1), round(statistics.median(v) / off, 3), ", ".join(f"{x:.0f}" for x in v)]
         for case, v in rates.items()],
        ["the archive's copy is made inside the commit script (XRANGE + XADD of the entry); the archiver reads "
         "and deletes on its own connection"],
    )
    per_s = statistics.median(a[0] for a in archiver_rates)
    cpu_per_record_ms = statistics.median(a[1] / a[2] * 1000 for a in archiver_rates if a[2])
    archiver = Table(
        "archive-archiver", "one `rollstream archive` process writing zstd Parquet (no --keep-arrays)",
        ["records/s", "CPU ms / record", "cores at the trainer's rate", "trainer's take+commit groups/s",
         "archiver / trainer rate"],
        [[round(per_s, 1), round(cpu_per_record_ms, 2), round(cpu_per_record_ms / 1000 * off, 2), round(off, 1),
          round(per_s / off, 2)]],
        [f"records/s from the moment it was running to its last confirmation; CPU is the process's whole life "
         f"(Python start-up included) over {sum(a[2] for a in archiver_rates)} records"],
    )
    memory = Table(
        "archive-memory", f"Redis memory with the archiver stopped for {stopped:.0f} s, the trainer committing "
        f"{PACE_GROUPS_S:.0f} groups/s ({group_bytes / 1024:.0f} KiB each)",
        ["budget MiB", "groups committed", "records held", "archive MiB (ledger)", "used_memory growth MiB",
         "archive_dropped"],
        [[round(b / 2**20, 1), int(m["groups"]), int(m["records"]), round(m["archive_mb"], 1), round(m["used_mb"], 1),
          int(m["dropped"])] for b, m in ((2**30, minute), (small_budget, bounded))],
        ["used_memory growth is Redis' whole growth over the minute (the archive stream and its entries' overhead); "
         "under the small budget the oldest records are dropped and counted, and memory stays near the budget"],
    )
    before, during = statistics.mean(evals["before"]), statistics.mean(evals["during"])
    beside, fixed = evals["beside"], evals["fixed"]
    evaluation = Table(
        "archive-eval", f"step time with and without an eval running (a trainer step of 8 groups x 4, {TRAIN_S} s "
        f"of training; an eval of {beside.prompts} prompts x 4 samples, max 128 new tokens; one producer, "
        "the simulator)",
        ["case", "steps", "mean step s", "vs no eval", "eval wall s", "eval reward_mean", "versions (samples)",
         "lag steps"],
        [
            ["no eval", len(evals["before"]), round(before, 3), 1.0, "", "", "", ""],
            ["eval running (evaluate, training goes on)", len(evals["during"]), round(during, 3),
             round(during / before, 3), round(evals["eval_s"], 1), round(beside.metrics["reward_mean"], 3),
             json.dumps(beside.versions), beside.lag_steps],
            ["blocking eval (trainer waits, version fixed)", 0, "", "", round(evals["blocking_s"], 1),
             round(fixed.metrics["reward_mean"], 3), json.dumps(fixed.versions), fixed.lag_steps],
        ],
        ["'vs no eval': mean step time while the eval ran over the mean before it (target at most 1.2x); the "
         "blocking row is the time a trainer that waits for the same eval would lose, and its mean reward on "
         "one fixed version"],
    )
    return [take, archiver, memory, evaluation]


def run(quick: bool = False) -> list[Table]:
    return asyncio.run(_run(quick))
