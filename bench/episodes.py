"""Episodes (user-written rollouts): producer CPU per engine request and per episode turn, and
episodes per producer core with a tool that sleeps.

One producer process (``bench.worker produce``) on a *stub engine* over real HTTP: a child
process of its own (its CPU is not counted) answering every ``/generate`` with a precomputed
1k-token SGLang reply after ``DELAY`` seconds (bench.http_client's stub), so the producer's
figure holds its HTTP client (producer/engine/http11.py), the reply parsing, the rollout and
Redis; a trainer takes batches of 16 groups of n=4. Modes, measured side by side in one run:

* ``single-turn``: the default plug-in (one request per episode), 256 episodes in flight;
* ``3 turns``: ``bench.episode_fns:turns`` (generate, observe 16 tool tokens, x3: each request
  sends the whole trajectory so far, up to ~3k ids), 256 episodes in flight;
* ``3 turns, tool sleeps``: the same with a 0.2 s tool between turns, 1024 episodes in flight
  on 256 engine slots (``--engine-concurrency``): tool time holds no slot;
* ``single-turn, Python's default GC``: the first mode with the collector as Python sets it
  (``--gc-threshold 0``: thresholds 700/10/10, nothing frozen), side by side with the tuned
  default (producer/gcpolicy.py);
* ``single-turn, aiohttp transport``: the first mode on ``aiohttp.ClientSession`` (bench.http_client's
  ``AiohttpTransport``, the engine client's transport before ``http11``), side by side;
* ``single-turn, in-process engine``: the first mode on bench.common's in-process
  ``httpx.MockTransport`` double instead (no socket; the engine client then runs that httpx
  transport), the figure this table quoted before the client called aiohttp directly;
* ``single-turn, no engine``: the first mode on ``bench.common.NoEngine`` (a prebuilt reply, no
  request at all): what the pipeline itself costs per episode (rollout, session, reward, checks,
  the codec, Redis), the part of the first row that is not the engine request.

Producer CPU is the producer process's CPU-seconds over the measured window (after one warm-up
batch) divided by the engine requests, turns and episodes completed in it; "episodes per
producer core" is episodes per CPU-second of the producer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import statistics
import time
from collections.abc import Iterator
from typing import Any

from rollstream.common.connection import connect
from rollstream.common.keys import Keys
from rollstream.consumer import GroupConsumer
from rollstream.producer.engine import EngineSettings
from rollstream.producer.rollout import Rollout
from rollstream.producer.settings import EpisodeSettings
from rollstream.runtime.redis_server import EmbeddedRedis

from bench import episode_fns
from bench.common import (
    OUT,
    ConstReward,
    NoEngine,
    Table,
    add_prompts,
    bench_prompt,
    children,
    consume,
    cpu_seconds,
    init_ns,
    sglang_reply,
    spawn,
)
from bench.http_client import _free_port, _serve

N = 4
BATCH = 16
TOKENS = 1024
DELAY = 0.05
MODES: tuple[tuple[str, str, int, float, int, int | None, str, int | None], ...] = (
    # name, generate, turns, tool sleep, episodes in flight, engine slots, transport, gc threshold
    ("single-turn (default plug-in)", "", 1, 0.0, 256, None, "http11", None),
    ("3 turns, tool instant", "bench.episode_fns:turns", 3, 0.0, 256, None, "http11", None),
    ("3 turns, tool sleeps 0.2 s", "bench.episode_fns:turns", 3, 0.2, 1024, 256, "http11", None),
    ("single-turn, Python's default GC (--gc-threshold 0)", "", 1, 0.0, 256, None, "http11", 0),
    ("single-turn, aiohttp transport (the default before http11)", "", 1, 0.0, 256, None, "aiohttp", None),
    ("single-turn, in-process engine (httpx.MockTransport)", "", 1, 0.0, 256, None, "mock", None),
    ("single-turn, no engine (a prebuilt reply: the pipeline's own cost)", "", 1, 0.0, 256, None, "none", None),
)
ROUNDS = 3
"""Rounds of every mode, interleaved (a shared machine's speed drifts): the table gives the median
and the range of each mode's figure."""


@contextlib.contextmanager
def stub_engine() -> Iterator[str]:
    """The stub engine in a child process: its URL."""
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    ready = ctx.Event()
    server = ctx.Process(target=_serve, args=(port, sglang_reply(TOKENS), DELAY, ready), daemon=True)
    server.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("the stub engine did not start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.kill()
        server.join(5)


async def one_mode(
    server: EmbeddedRedis, name: str, generate: str, turns: int, sleep: float, concurrency: int,
    engine_slots: int | None, transport: str, gc_threshold: int | None, *, engine_url: str, batches: int,
) -> dict[str, Any]:
    ns = f"ep-{time.monotonic_ns()}"
    redis = connect(server.url)
    keys = await init_ns(redis, ns, n_samples_per_prompt=N, batch_size=BATCH, max_backlog=4 * BATCH)
    await add_prompts(redis, keys, 0, (batches + 2) * BATCH + concurrency // N + 8 * BATCH)
    args = ["-m", "bench.worker", "produce", "--redis", server.url, "--ns", ns, "--tokens", str(TOKENS),
            "--delay", str(DELAY), "--concurrency", str(concurrency), "--name", "p0"]
    if transport == "none":
        args += ["--engine", "none"]
    elif transport != "mock":
        args += ["--engine", engine_url, "--transport", transport]
    if generate:
        args += ["--generate", generate]
    if engine_slots is not None:
        args += ["--engine-concurrency", str(engine_slots)]
    if gc_threshold is not None:
        args += ["--gc-threshold", str(gc_threshold)]
    env = {"BENCH_TURNS": str(turns), "BENCH_TOOL_SLEEP": str(sleep)}
    with children() as procs:
        procs.append(spawn(args, OUT / f"worker-{ns}.log", env))
        async with await GroupConsumer.connect(server.url, ns, "trainer", stall_timeout=120) as consumer:
            await consume(consumer, 1, BATCH)  # warm-up: imports, connections, the first batch
            pid = procs[0].pid
            cpu0 = cpu_seconds([pid])
            seconds = await consume(consumer, batches, BATCH)
            cpu1 = cpu_seconds([pid])
            beat = json.loads(await redis.hget(Keys(ns).producers, "p0") or "{}")  # type: ignore[misc]
    await redis.aclose()
    episodes = batches * BATCH * N
    cpu = cpu1 - cpu0
    return {
        "mode": name, "episodes_s": episodes / seconds, "requests_s": episodes * turns / seconds,
        "ms_request": 1000 * cpu / (episodes * turns), "ms_episode": 1000 * cpu / episodes,
        "per_core": episodes / cpu if cpu > 0 else float("nan"), "cores": cpu / seconds,
        "peaks": f"{beat.get('episodes_peak', '?')} / {beat.get('engine_requests_peak', '?')}",
    }


async def session_only(generate: Any, turns: int, prompts: int) -> float:
    """µs of CPU per engine call in-process on ``NoEngine`` (a prebuilt reply, no HTTP, no JSON):
    what the rollout and the session cost per turn without the engine client and Redis."""
    engine = NoEngine(TOKENS, EngineSettings(urls=("http://none",), max_new_tokens=TOKENS))
    rollout = Rollout(engine, ConstReward(), N, EpisodeSettings(generate=generate))
    episode_fns.TURNS, episode_fns.TOOL_SLEEP = turns, 0.0
    started = time.process_time()
    for start in range(0, prompts, 64):
        await asyncio.gather(*(rollout.run(bench_prompt(i), 0) for i in range(start, min(prompts, start + 64))))
    cpu = time.process_time() - started
    await engine.aclose()
    return 1e6 * cpu / (prompts * N * turns)


def run(quick: bool = False) -> list[Table]:
    batches = 4 if quick else 100
    prompts = 64 if quick else 1000

    async def in_process() -> list[float]:
        return [await session_only(None, 1, prompts), await session_only(episode_fns.turns, 3, prompts)]

    single_us, multi_us = asyncio.run(in_process())

    async def measure() -> dict[str, list[dict[str, Any]]]:
        # The comparison rows only where CPU figures mean something (not --quick).
        modes = MODES if not quick else MODES[:3]
        runs: dict[str, list[dict[str, Any]]] = {mode[0]: [] for mode in modes}
        with EmbeddedRedis() as server, stub_engine() as url:
            for _ in range(1 if quick else ROUNDS):
                for mode in modes:
                    runs[mode[0]].append(await one_mode(server, *mode, engine_url=url, batches=batches))
        return runs

    def median(results: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in results)

    rows = []
    for name, results in asyncio.run(measure()).items():
        spread = sorted(r["ms_request"] for r in results)
        rows.append([
            name, median(results, "episodes_s"), median(results, "requests_s"),
            f"**{median(results, 'ms_request'):.3f}** ({spread[0]:.3f}-{spread[-1]:.3f})",
            median(results, "ms_episode"), median(results, "per_core"), median(results, "cores"), results[-1]["peaks"],
        ])
    return [Table(
        name="episodes",
        title=f"Episodes: producer CPU per engine request / turn / episode ({TOKENS}-token replies, stub engine)",
        headers=["mode", "episodes/s", "requests/s", "producer CPU ms/request (= ms/turn): median (range)",
                 "ms/episode", "episodes per producer core (per CPU-s)", "producer cores used",
                 "peak episodes / engine requests"],
        rows=rows,
        notes=[
            f"{batches} batches of {BATCH} groups x n={N} measured after one warm-up batch; replies after "
            f"{DELAY} s, 1 producer process; the stub engine is another process over loopback HTTP; "
            f"{1 if quick else ROUNDS} rounds of every mode, interleaved: medians, the range in brackets.",
            "a turn is one engine call here (ms/turn = ms/request); multi-turn requests carry the whole "
            "trajectory so far (prompt + earlier replies + tool tokens) as input ids.",
        ],
        command="python -m bench episodes",
    ), Table(
        name="episodes-session",
        title="Episodes: the rollout + session's own CPU per engine call (in-process, no engine client, no Redis)",
        headers=["mode", "µs of CPU per engine call"],
        rows=[["single-turn (default plug-in)", single_us], ["3 turns (generate + observe)", multi_us]],
        notes=[f"{prompts} prompts x n={N} on bench.common.NoEngine (a prebuilt {TOKENS}-token reply), 64 prompts at a "
               "time, reward constant; includes validation (check_sample) and the reward call."],
        command="python -m bench episodes",
    )]
