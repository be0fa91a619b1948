"""Datasets in: the feeder's memory and start on 10M rows, and a mix of a fast and a slow source.

Feeder: ``rollstream feed`` (a child process) on a 10-million-row JSONL file and a 10-million-row
Parquet file (row groups of 100k rows), in order and shuffled (the buffered shuffle, 65536 rows),
window 1000, while this process deletes what it feeds (XTRIM: nobody generates). Measured: the
time from the process start to the first prompt in Redis, the peak RSS (``VmHWM``) after feeding
for a while, and the same start after a resume 5M rows into the epoch (the cursor set in Redis).

Mix: the engine simulator, one producer, a trainer taking batches of 16 groups (n = 4) and
training 0.05 s each (generation sets the pace). Two sources: ``fast`` prompts are a few bytes, ``slow`` prompts are long
enough that their prefill makes a group take ~5x as long. Unmixed: both files fed as one
shuffled dataset; mixed: ``init --mix fast=1,slow=1``, ``feed fast=... slow=...``. Measured per
batch: the slow share (target 0.5), whether it is exact, and take()'s wait.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

from rollstream.common.connection import connect
from rollstream.common.keys import Keys, SourceField, StateField
from rollstream.consumer import GroupConsumer
from rollstream.runtime.redis_server import EmbeddedRedis
from rollstream.testing.sim import SimConfig, SimEngine

from bench.common import OUT, Table, children, init_ns, percentile, spawn, stop_all

ROWS = 10_000_000
CACHE = Path(os.environ.get("ROLLSTREAM_BENCH_DATA", "/tmp/rollstream-bench-data"))


def _line(i: int) -> str:
    return json.dumps({"prompt": f"What is {i % 9973} + {i % 8191}?", "label": str(i % 9973 + i % 8191), "row": i})


def jsonl_file(rows: int) -> Path:
    path = CACHE / f"rows-{rows}.jsonl"
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as handle:
            for start in range(0, rows, 100_000):
                handle.write("\n".join(_line(i) for i in range(start, min(rows, start + 100_000))) + "\n")
        tmp.rename(path)
    return path


def parquet_file(rows: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = CACHE / f"rows-{rows}.parquet"
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        schema = pa.schema([("prompt", pa.string()), ("label", pa.string()), ("row", pa.int64())])
        with pq.ParquetWriter(tmp, schema) as writer:
            for start in range(0, rows, 100_000):
                ids = range(start, min(rows, start + 100_000))
                writer.write_table(pa.table({
                    "prompt": [f"What is {i % 9973} + {i % 8191}?" for i in ids],
                    "label": [str(i % 9973 + i % 8191) for i in ids],
                    "row": list(ids),
                }, schema=schema), row_group_size=100_000)
        tmp.rename(path)
    return path


def peak_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


async def _feed_once(server: EmbeddedRedis, path: Path, shuffle: bool, seconds: float,
                     resume_at: int | None = None, ns: str | None = None) -> tuple[float, float, int, str]:
    """(seconds to the first prompt, peak RSS MB, prompts fed, namespace) of one feeder process."""
    redis = connect(server.url)
    if ns is None:
        ns = f"data-{time.monotonic_ns()}"
        await init_ns(redis, ns, n_samples_per_prompt=1, batch_size=1)
    keys = Keys(ns)
    if resume_at is not None:
        await redis.hset(keys.state, StateField.FEED_POSITION, resume_at)
    fed_before = int(await redis.hget(keys.state, StateField.FED) or 0)
    args = ["-m", "rollstream.cli", "feed", str(path), "--redis", server.url, "--ns", ns, "--forever",
            "--window", "1000", "--log-level", "WARNING"] + (["--shuffle", "--seed", "1"] if shuffle else [])
    with children() as procs:
        started = time.monotonic()
        feeder = spawn(args, OUT / "data-feed.log")
        procs.append(feeder)
        first = float("nan")
        while time.monotonic() - started < 300:
            if await redis.xlen(keys.prompts) > 0:
                first = time.monotonic() - started
                break
            if feeder.poll() is not None:
                raise RuntimeError(f"the feeder exited {feeder.returncode}: see {OUT / 'data-feed.log'}")
            await asyncio.sleep(0.005)
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            await redis.xtrim(keys.prompts, maxlen=0)  # the bench only: nobody generates
            await asyncio.sleep(0.01)
        rss = peak_rss_mb(feeder.pid)
        stop_all([feeder])
    fed = int(await redis.hget(keys.state, StateField.FED) or 0) - fed_before
    await redis.xtrim(keys.prompts, maxlen=0)
    await redis.aclose()
    return first, rss, fed, ns


async def feeder_rows(quick: bool) -> list[list[Any]]:
    rows = 200_000 if quick else ROWS
    seconds = 3.0 if quick else 20.0
    files = {"JSONL": jsonl_file(rows), "Parquet": parquet_file(rows)}
    out: list[list[Any]] = []
    with EmbeddedRedis() as server:
        for kind, path in files.items():
            for shuffle in (False, True):
                first, rss, fed, ns = await _feed_once(server, path, shuffle, seconds)
                resumed, rss2, _, _ = await _feed_once(server, path, shuffle, 1.0, resume_at=rows // 2, ns=ns)
                out.append([
                    kind, f"{rows:,}", f"{path.stat().st_size / 2**20:,.0f}", "buffered" if shuffle else "in order",
                    first, rss, fed / seconds, resumed, max(rss, rss2),
                ])
    return out


# -- the mix ------------------------------------------------------------------------------------

BATCH = 16
N = 4
CONCURRENCY = 16
"""Samples in flight: 4 groups, so generation, not training, sets the pace."""
TRAIN_S = 0.05
SLOW_PROMPT_BYTES = 700


def _mix_files(directory: Path, rows: int) -> tuple[Path, Path, Path]:
    fast = directory / "fast.jsonl"
    slow = directory / "slow.jsonl"
    both = directory / "both.jsonl"
    fast_rows = [json.dumps({"prompt": f"f{i}", "label": "1"}) for i in range(rows)]
    slow_rows = [json.dumps({"prompt": f"s{i} " + "x" * SLOW_PROMPT_BYTES, "label": "1"}) for i in range(rows)]
    fast.write_text("\n".join(fast_rows) + "\n")
    slow.write_text("\n".join(slow_rows) + "\n")
    mixed = fast_rows + slow_rows
    random.Random(0).shuffle(mixed)
    both.write_text("\n".join(mixed) + "\n")
    return fast, slow, both


async def _mix_run(server: EmbeddedRedis, engine: str, files: tuple[Path, Path, Path], mixed: bool,
                   batches: int) -> dict[str, Any]:
    ns = f"mix-{'on' if mixed else 'off'}-{time.monotonic_ns()}"
    redis = connect(server.url)
    keys = await init_ns(redis, ns, n_samples_per_prompt=N, batch_size=BATCH, max_backlog=4 * BATCH,
                         mix="fast=1,slow=1" if mixed else "")
    fast, slow, both = files
    datasets = [f"fast={fast}", f"slow={slow}"] if mixed else [str(both)]
    waits: list[float] = []
    shares: list[float] = []
    exact = 0
    fast_held = 0
    with children() as procs:
        procs.append(spawn(["-m", "rollstream.cli", "feed", *datasets, "--redis", server.url, "--ns", ns,
                            "--forever", "--shuffle", "--window", "64", "--log-level", "WARNING"],
                           OUT / "data-mix-feed.log"))
        procs.append(spawn(["-m", "rollstream.cli", "produce", "--redis", server.url, "--ns", ns, "--engine", engine,
                            "--concurrency", str(CONCURRENCY), "--reward", "math", "--max-new-tokens", "64",
                            "--log-level", "WARNING"], OUT / "data-mix-produce.log"))
        async with await GroupConsumer.connect(server.url, ns, "trainer", stall_timeout=120) as consumer:
            for step in range(batches + 3):
                batch = await consumer.take(BATCH)
                counts = Counter("slow" if str(g.prompt).startswith("s") else "fast" for g in batch.groups)
                await asyncio.sleep(TRAIN_S)  # the training step
                await consumer.commit(batch)
                if step < 3:  # warm-up: process start, first groups
                    continue
                waits.append(batch.metrics["wait_time_s"])
                shares.append(counts["slow"] / BATCH)
                exact += counts["slow"] == BATCH // 2
                if mixed:
                    state = {k.decode(): int(v) for k, v in (await redis.hgetall(keys.sources)).items()
                             if k.decode().startswith("fast:") and v.isdigit()}
                    fast_held = max(fast_held, state.get(SourceField.of("fast", "published"), 0)
                                    - state.get(SourceField.of("fast", "committed"), 0))
    await redis.aclose()
    return {
        "wait_mean": statistics.mean(waits), "wait_p90": percentile(waits, 90),
        "share_mean": statistics.mean(shares), "share_min": min(shares), "share_max": max(shares),
        "exact": exact, "batches": len(waits), "fast_held": fast_held,
    }


async def mix_rows(quick: bool) -> list[list[Any]]:
    batches = 4 if quick else 40
    directory = OUT / "data-mix"
    directory.mkdir(parents=True, exist_ok=True)
    files = _mix_files(directory, 20_000)
    config = SimConfig(seed=1, mean_tokens=32, length_sigma=0.3, latency_per_token=0.001, prefill_per_token=0.0002,
                       max_running=256)
    out: list[list[Any]] = []
    with EmbeddedRedis() as server:
        async with SimEngine(config) as sim:
            results = {mixed: await _mix_run(server, sim.url, files, mixed, batches) for mixed in (False, True)}
    base = results[False]["wait_mean"]
    for mixed, r in results.items():
        out.append([
            "mix fast=1,slow=1" if mixed else "unmixed (one shuffled file)", r["batches"],
            r["share_mean"], f"{r['share_min']:.3f}-{r['share_max']:.3f}", f"{r['exact']}/{r['batches']}",
            r["wait_mean"], r["wait_p90"], r["wait_mean"] / base, r["fast_held"] if mixed else "-",
        ])
    return out


# -- the curriculum ------------------------------------------------------------------------------

CURRICULUM_ROWS = 200
CURRICULUM_EPOCHS = 8


def easy_or_coin(sample: Any, prompt: Any, label: Any) -> float:
    """The curriculum run's reward: rows labelled ``easy`` are always solved, the others a coin."""
    return 1.0 if label == "easy" else float(random.random() < 0.5)


async def _curriculum_run(server: EmbeddedRedis, engine: str, dataset: Path, curriculum: list[str], k: int,
                          epochs: int) -> dict[str, Any]:
    from rollstream.consumer.filters import reward_variance

    ns = f"curr-{time.monotonic_ns()}"
    redis = connect(server.url)
    await init_ns(redis, ns, n_samples_per_prompt=N, batch_size=4, max_backlog=64, row_stats=k)
    judged: Counter[int] = Counter()
    kept: Counter[int] = Counter()

    def keep(group: Any) -> Any:
        verdict = reward_variance(group)
        judged[group.epoch] += 1
        if verdict is True:
            kept[group.epoch] += 1
        return verdict

    with children() as procs:
        feeder = spawn(["-m", "rollstream.cli", "feed", str(dataset), "--redis", server.url, "--ns", ns,
                        "--epochs", str(epochs), "--shuffle", "--window", "32", "--log-level", "INFO", *curriculum],
                       OUT / "data-curriculum-feed.log")
        procs.append(feeder)
        procs.append(spawn(["-m", "rollstream.cli", "produce", "--redis", server.url, "--ns", ns, "--engine", engine,
                            "--concurrency", "64", "--reward", "bench.data:easy_or_coin", "--max-new-tokens", "32",
                            "--log-level", "WARNING"], OUT / "data-curriculum-produce.log"))
        async with await GroupConsumer.connect(server.url, ns, "trainer", keep=keep, stall_timeout=120) as consumer:
            while True:
                try:
                    batch = await asyncio.wait_for(consumer.take(4), 5)
                except TimeoutError:
                    if feeder.poll() is not None:  # fed to the end and nothing more arrives
                        break
                    continue
                await consumer.commit(batch)
    await redis.aclose()
    later = range(1, epochs)
    generated, trained = sum(judged[e] for e in later), sum(kept[e] for e in later)
    return {"generated": generated, "trained": trained, "ratio": generated / max(1, trained),
            "first": judged[0]}


async def curriculum_rows(quick: bool) -> list[list[Any]]:
    epochs = 3 if quick else CURRICULUM_EPOCHS
    dataset = OUT / "data-curriculum.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"q{i}", "label": "easy" if i % 2 else "hard"}) + "\n"
                               for i in range(CURRICULUM_ROWS)))
    runs = [
        ("zero-variance filter alone", [], 1),
        ("+ curriculum k=1, offer 0.1, max gap 4 (the defaults)", ["--curriculum", "zero-variance"], 1),
        ("+ curriculum k=1, offer 0.2, max gap 4",
         ["--curriculum", "zero-variance", "--curriculum-offer", "0.2"], 1),
        ("+ curriculum k=2, offer 0.1, max gap 4",
         ["--curriculum", "zero-variance", "--curriculum-k", "2"], 2),
        ("+ curriculum k=1, offer 0.1, max gap 8",
         ["--curriculum", "zero-variance", "--curriculum-max-gap", "8"], 1),
    ]
    config = SimConfig(seed=1, mean_tokens=16, latency_per_token=0.001, max_running=256)
    results = []
    with EmbeddedRedis() as server:
        async with SimEngine(config) as sim:
            for name, flags, k in runs:
                results.append((name, await _curriculum_run(server, sim.url, dataset, flags, k, epochs)))
    base = results[0][1]["ratio"]
    trained = results[0][1]["trained"]
    return [[name, r["generated"], r["trained"], r["trained"] / trained, r["ratio"], base / r["ratio"]]
            for name, r in results]


def run(quick: bool = False) -> list[Table]:
    feeder = asyncio.run(feeder_rows(quick))
    mix = asyncio.run(mix_rows(quick))
    curriculum = asyncio.run(curriculum_rows(quick))
    return [
        Table(
            "data-feeder",
            "The feeder on 10 million rows: time to the first prompt and memory (streamed, never loaded whole)",
            ["format", "rows", "file MiB", "order", "first prompt s", "peak RSS MiB", "prompts/s fed",
             "first prompt after resume at 5M s", "peak RSS with resume MiB"],
            feeder,
            [
                "`rollstream feed FILE --forever --window 1000 [--shuffle --seed 1]` as a child process on an "
                "embedded redis-server; this process deletes the prompts as they come (XTRIM), so the feeder "
                "feeds as fast as it can for 20 s. First prompt: from the process start (Python start-up and "
                "the JSONL scan of the file's units included). Peak RSS: the feeder's VmHWM.",
                "Resume: a new feeder on the same namespace with the cursor set to position 5,000,000 of epoch "
                "0; the shuffled walk replays the ids of the first 5M positions (no I/O) and reads only the "
                "units still holding buffered rows.",
                "Buffered shuffle: units (1 MiB of JSONL lines, a 100k-row Parquet row group) in a seeded "
                "order, rows through a 65,536-row seeded buffer.",
            ],
            "python -m bench data",
        ),
        Table(
            "data-mix",
            "Two sources whose groups take ~5x longer to generate for one: mix accuracy and take() wait",
            ["run", "batches", "slow share (mean)", "slow share (min-max)", "batches exactly 8/8", "take wait s",
             "take wait p90 s", "wait vs unmixed", "max fast groups held"],
            mix,
            [
                f"Simulator: 32 tokens per sample at 1 ms/token, prefill 0.2 ms per prompt byte; fast prompts "
                f"are ~6 bytes, slow ones ~{SLOW_PROMPT_BYTES} bytes (~0.14 s of prefill: a slow group takes "
                "~5x a fast one). One producer (concurrency 16 samples: 4 groups in flight, so "
                "generation sets the pace), n=4, batches of 16, a 0.05 s training step, 40 batches after 3 "
                "warm-up ones; feeder window 64.",
                "Unmixed: both files in one shuffled file (half of each): the fast source's groups arrive "
                "first, so a batch's slow share drifts with the generation times. Mixed: every batch holds "
                "exactly 8 of each (take() holds the fast surplus for the next batches; the feeder steers new "
                "prompts to the source behind, counting what is in flight and in the backlog).",
                "Max fast groups held: fast groups published but not committed (the backlog plus the surplus "
                "take() holds), the largest seen after a commit.",
            ],
            "python -m bench data",
        ),
        Table(
            "data-curriculum",
            "Generated groups per trained group from epoch 2 on: the zero-variance filter alone vs a curriculum",
            ["run", "groups generated (epochs 2+)", "groups trained (epochs 2+)", "trained vs the filter alone",
             "generated / trained", "fewer than the filter alone"],
            curriculum,
            [
                f"{CURRICULUM_ROWS} rows, half always solved (reward 1 for every sample: zero variance), half a "
                "coin per sample (zero variance 1 time in 8 with n=4); "
                f"{CURRICULUM_EPOCHS} shuffled epochs, n=4, the trainer taking batches of 4 with "
                "keep=reward_variance (the dynamic-sampling filter), init --row-stats k.",
                "Generated: groups judged by the filter (every finished group); trained: the ones it kept "
                "(all from the coin rows). Epoch 1 is the same in every run (no row has a history yet). "
                "With k=1 a coin row whose one group had zero variance is deferred too, so fewer groups are "
                "trained in the same epochs; k=2 keeps them but defers the solved rows an epoch later.",
            ],
            "python -m bench data",
        ),
    ]
