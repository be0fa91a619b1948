"""Durable episodes: a producer killed midway through 6-turn episodes, with and without the
journal, against an uninterrupted run; and what the journal costs per step.

``python -m bench episodes --kill`` (or ``python -m bench durable``). Everything real but the
engine: an embedded Redis, ``bench.worker produce`` processes (a rollstream Producer) running
``bench.episode_fns:six_turns`` (six engine calls, a 100 ms tool between two, a sandbox behind
``episode.once``), and the simulator in this process in its *deterministic* mode (a reply is a
function of its input only), so two runs that send the same requests get the same tokens.

Scenarios, each on a fresh namespace (lease 3 s):

* the kill runs, one wave of 8 prompts x n=2 (every episode in flight at once) on a slow engine
  (8 ms a token): ``no kill``, one producer runs them all; ``kill, durable``: producer A is
  SIGKILLed once half of the run's engine calls were made, producer B starts at once, takes A's
  prompts over after the lease and resumes each episode from its journal; ``kill, start over``:
  the same kill without the journal, B starts A's episodes from scratch;
* the cost runs, 32 prompts on a fast engine (2 ms a token), with and without the journal;
* the limit run: 4 producers whose episodes hold a unit of a namespace limit of 3.

Counted: engine calls (the simulator's requests) and tool calls (lines the tool wrote) against
the uninterrupted run; wall time from A's start to the last group taken; the engine calls in
flight at the kill; the trained samples (tokens, loss mask, log-probs) compared with the
uninterrupted run's, sample for sample. The cost rows: producer CPU per episode step (an engine
call, an observe or a once), Redis CPU per journaled step (``INFO cpu`` over the run, with minus
without the journal), and Redis memory per step held (``MEMORY USAGE`` of the journals A left).

The orphan-journal sweep's cost (:func:`sweep_table`, alone: ``python -m bench.durable --sweep``):
journals that name their prompt's entry against journals of an older version (the prompt streams
read whole), at 1k to 200k prompts queued.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import statistics
import sys
import tempfile
import time
from array import array
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from rollstream.common.codec import prompt_fields
from rollstream.common.connection import connect
from rollstream.common.keys import Keys, StateField
from rollstream.common.models import Prompt
from rollstream.common.protocol import EpisodeJournals, NamespaceLimits
from rollstream.consumer import GroupConsumer
from rollstream.producer.reclaim import JOURNAL_SWEEP_COUNT
from rollstream.runtime.redis_server import EmbeddedRedis
from rollstream.testing.sim import SimConfig, SimEngine
from rollstream.testing.sim.simulator import tokenize

from bench.common import OUT, Table, children, cpu_seconds, init_ns, spawn

N = 2
TURNS = 6
STEPS_PER_EPISODE = 1 + TURNS + (TURNS - 1)
"""once + six engine calls + five observes."""
BATCH = 4
CONCURRENCY = 16
LEASE = 3.0


def _prompts(count: int) -> list[Prompt]:
    prompts = []
    for i in range(count):
        text = f"Problem {i}: what is {i % 97} + {(i * 7) % 89}? Use the tool."
        prompts.append(Prompt(index=i, prompt=text, label=str(i % 97 + (i * 7) % 89),
                              input_ids=array("i", tokenize(text))))
    return prompts


async def _state_int(redis: Redis, keys: Keys, field: str) -> int:
    return int(await redis.hget(keys.state, field) or 0)  # type: ignore[misc]


async def _at_least(value: int, target: int) -> bool:
    return value >= target


async def _until(check: Callable[[], Awaitable[Any]], what: str, timeout: float = 120.0) -> None:
    """Poll ``check`` every 5 ms until it is truthy; RuntimeError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


async def _redis_cpu(redis: Redis) -> float:
    info = await redis.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def _journal_memory(redis: Redis, keys: Keys) -> tuple[int, int]:
    """(bytes Redis reports for every journal of the namespace, steps they hold)."""
    used = steps = 0
    async for key in redis.scan_iter(match=keys.episode_pattern):
        used += int(await redis.memory_usage(key, samples=0) or 0)
        steps += sum(1 for f in await redis.hkeys(key) if b":" in f and not f.startswith(b"n:"))  # type: ignore[misc]
    return used, steps


async def scenario(
    server: EmbeddedRedis, sim: SimEngine, prompts: int, *, kill: bool, durable: bool, workdir: Path,
) -> dict[str, Any]:
    ns = f"dur-{time.monotonic_ns()}"
    redis = connect(server.url)
    keys = await init_ns(redis, ns, n_samples_per_prompt=N, batch_size=BATCH, max_backlog=4 * prompts,
                         lease_seconds=LEASE, durable_episodes=durable)
    for prompt in _prompts(prompts):
        await redis.xadd(keys.prompts, prompt_fields(prompt))
    tool_log = workdir / f"{ns}.tools"
    env = {"BENCH_TOOL_LOG": str(tool_log), "BENCH_TOOL_SLEEP": "0.1"}

    def producer(name: str) -> Any:
        return spawn(["-m", "bench.worker", "produce", "--redis", server.url, "--ns", ns, "--engine", sim.url,
                      "--concurrency", str(CONCURRENCY), "--max-new-tokens", "512", "--name", name,
                      "--generate", "bench.episode_fns:six_turns"], OUT / f"worker-{ns}-{name}.log", env)

    requests0 = sim.state.requests
    redis_cpu0 = await _redis_cpu(redis)
    out: dict[str, Any] = {"in_flight_at_kill": 0, "journal_bytes_per_step": float("nan"),
                           "memory_per_step": float("nan")}
    samples: dict[tuple[int, int], tuple[bytes, bytes, bytes]] = {}
    with children() as procs:
        started = killed = time.perf_counter()
        procs.append(producer("a"))
        await _until(lambda: _state_int(redis, keys, StateField.ADMITTED), "A admits")
        cpu0 = cpu_seconds([procs[0].pid])
        if kill:
            half = prompts * N * TURNS // 2
            await _until(lambda: _at_least(sim.state.requests - requests0, half), "half the engine calls")
            procs[0].send_signal(signal.SIGKILL)
            killed = time.perf_counter()
            out["in_flight_at_kill"] = len(sim.state.jobs)
            await asyncio.to_thread(procs[0].wait, 30)
            if durable:
                used, held = await _journal_memory(redis, keys)
                out["memory_per_step"] = used / held if held else float("nan")
                out["journal_bytes_per_step"] = await _state_int(redis, keys, StateField.JOURNAL_BYTES) / max(1, held)
            procs.append(producer("b"))
        async with await GroupConsumer.connect(server.url, ns, "trainer", stall_timeout=120) as consumer:
            taken = 0
            while taken < prompts:
                batch = await consumer.take(min(BATCH, prompts - taken))
                for group in batch.groups:
                    for sample in group.samples:
                        samples[(group.index, sample.index)] = (
                            bytes(memoryview(sample.tokens)), bytes(memoryview(sample.loss_mask or b"")),
                            bytes(memoryview(sample.rollout_log_probs or b"")),
                        )
                taken += len(batch)
                await consumer.commit(batch)
        out["wall_s"] = time.perf_counter() - started
        out["after_kill_s"] = time.perf_counter() - killed if kill else float("nan")
        out["producer_cpu_s"] = cpu_seconds([procs[-1].pid]) - (0.0 if kill else cpu0)
    out["engine_calls"] = sim.state.requests - requests0
    out["tool_calls"] = sum(1 for line in tool_log.read_text().splitlines() if line == "tool")
    out["once_calls"] = sum(1 for line in tool_log.read_text().splitlines() if line == "once")
    out["journal_steps"] = await _state_int(redis, keys, StateField.JOURNAL_STEPS)
    out["journals_left"] = len([k async for k in redis.scan_iter(match=keys.episode_pattern)])
    out["redis_cpu_s"] = await _redis_cpu(redis) - redis_cpu0
    out["samples"] = samples
    await redis.aclose()
    return out


async def limit_scenario(server: EmbeddedRedis, sim: SimEngine, prompts: int, producers: int, size: int) -> dict[str, Any]:
    """``producers`` producers whose episodes each hold a unit of the namespace limit ``sandbox``
    (``size`` units) for a 50 ms tool: the most holders seen at once, the waits."""
    ns = f"lim-{time.monotonic_ns()}"
    redis = connect(server.url)
    keys = await init_ns(redis, ns, n_samples_per_prompt=N, batch_size=BATCH, max_backlog=4 * prompts)
    limits = NamespaceLimits(redis, keys)
    await limits.set({"sandbox": size}, {})
    for prompt in _prompts(prompts):
        await redis.xadd(keys.prompts, prompt_fields(prompt))
    with children() as procs:
        for i in range(producers):
            procs.append(spawn(["-m", "bench.worker", "produce", "--redis", server.url, "--ns", ns, "--engine",
                                sim.url, "--concurrency", str(CONCURRENCY), "--max-new-tokens", "64", "--name",
                                f"p{i}", "--generate", "bench.episode_fns:limited"], OUT / f"worker-{ns}-{i}.log"))
        started = time.perf_counter()
        async with await GroupConsumer.connect(server.url, ns, "trainer", stall_timeout=120) as consumer:
            taken = 0
            while taken < prompts:
                batch = await consumer.take(min(BATCH, prompts - taken))
                taken += len(batch)
                await consumer.commit(batch)
        seconds = time.perf_counter() - started
    (view,) = [v.as_dict() for v in await limits.views()]
    await redis.aclose()
    return {"peak": view["peak"], "granted": view["acquired"], "mean_wait_s": view["mean_wait_s"],
            "seconds": seconds}


async def _script_usec(redis: Redis) -> int:
    """Microseconds Redis spent in EVALSHA so far (INFO commandstats): the time a script blocks it."""
    stats = await redis.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("usec", 0))


async def sweep_cost(server: EmbeddedRedis, queued: int, journals: int, pointers: bool) -> dict[str, float]:
    """One full round of the orphan-journal sweep (100-key SCAN steps, SWEEP_JOURNALS each) with
    ``queued`` prompts in the prompt stream and ``journals`` journals, half of them orphans (their
    entry XDELed). ``pointers``: each journal names its prompt's entry, as JOURNAL_APPEND writes
    it (checked with one XRANGE); without, as an older version wrote them (the streams read whole)."""
    ns = f"sweep{queued}{'p' if pointers else ''}"
    keys = Keys(ns)
    redis = await connect(server.url)
    try:
        await init_ns(redis, ns, n_samples_per_prompt=N, batch_size=BATCH, durable_episodes=True)
        ids: list[bytes] = []
        prompts = _prompts(queued + journals // 2)  # the last ones are the orphans' prompts, deleted below
        for chunk in range(0, len(prompts), 10_000):
            pipe = redis.pipeline(transaction=False)
            for prompt in prompts[chunk:chunk + 10_000]:
                pipe.xadd(keys.prompts, prompt_fields(prompt))
            ids += await pipe.execute()
        pipe = redis.pipeline(transaction=False)
        for i in range(journals):
            index = i // 2 if i % 2 == 0 else queued + i // 2  # odd ones: their prompt's entry is gone
            journal = {"0:0": b"s" * 400, "n:0": 1, "bytes": 400}
            if pointers:
                journal |= {"stream": keys.prompts, "entry_id": ids[index]}
            pipe.hset(keys.episode(index, 0), mapping=journal)
        pipe.xdel(keys.prompts, *ids[queued:])
        await pipe.execute()
        journaled = EpisodeJournals(redis, keys, "bench")
        times: list[float] = []
        busy: list[float] = []
        swept = 0
        while True:
            before = await _script_usec(redis)
            started = time.perf_counter()
            swept += await journaled.sweep(JOURNAL_SWEEP_COUNT)
            times.append(time.perf_counter() - started)
            busy.append((await _script_usec(redis) - before) / 1000)
            if not int(await redis.hget(keys.state, StateField.JOURNAL_SWEEP_CURSOR) or 0):
                break
        await redis.flushdb()  # the next run SCANs a keyspace of its own size only
        return {"steps": len(times), "swept": swept, "mean_ms": 1000 * statistics.mean(times),
                "script_ms": statistics.mean(busy), "script_max_ms": max(busy)}
    finally:
        await redis.aclose()


def sweep_table(quick: bool = False, sizes: tuple[int, ...] = ()) -> Table:
    sizes = sizes or ((1_000, 10_000) if quick else (1_000, 10_000, 50_000, 200_000))
    rounds = 1 if quick else 3

    async def measure() -> list[list[Any]]:
        rows = []
        with EmbeddedRedis() as server:
            for queued in sizes:
                runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
                for _ in range(rounds):  # side by side, so a busy machine weighs on both alike
                    for pointers in (False, True):
                        runs[pointers].append(await sweep_cost(server, queued, 200, pointers=pointers))
                read, named = ({key: statistics.median(r[key] for r in runs[pointers]) for key in runs[pointers][0]}
                               for pointers in (False, True))
                swept = "/".join(sorted({str(int(r["swept"])) for r in runs[False] + runs[True]}))
                rows.append([queued, 200, swept, int(named["steps"]), read["script_ms"], read["script_max_ms"],
                             read["mean_ms"], named["script_ms"], named["script_max_ms"], named["mean_ms"]])
        return rows

    return Table(
        name="durable-sweep",
        title="The orphan-journal sweep's cost per reclaim turn",
        headers=["prompts queued", "journals (half orphans)", "swept (every run)", "sweep steps (SCAN COUNT 100)",
                 "streams read: script ms", "slowest", "step ms", "entry named: script ms", "slowest", "step ms"],
        rows=asyncio.run(measure()),
        notes=["one step per reclaim turn of the fleet; script ms: Redis' own time in SWEEP_JOURNALS per step "
               "(INFO commandstats; it serves nothing else meanwhile), step ms: the step's wall time (SCAN, "
               "script, cursor); medians of the runs (each a full round of the sweep). 'streams read': "
               "journals without the entry of their prompt (an older version's), the prompt streams read "
               "whole; 'entry named': one XRANGE per journal."],
        command="python -m bench episodes --kill",
    )


def run(quick: bool = False) -> list[Table]:
    prompts = 8 if quick else 32
    """Prompts of the cost and limit runs (several waves of episodes, fast engine)."""
    wave = 4 if quick else CONCURRENCY // N
    """Prompts of the kill runs: one wave, every episode in flight when A is killed."""
    slow_token = 0.002 if quick else 0.008
    rounds = 1 if quick else 2

    async def measure() -> dict[str, list[dict[str, Any]]]:
        runs: dict[str, list[dict[str, Any]]] = {
            k: [] for k in ("ref", "kill", "kill_off", "base", "base_off", "limit")
        }
        fast = SimConfig(seed=5, mean_tokens=96, length_sigma=0.3, latency_per_token=0.002, deterministic=True,
                         max_running=256)
        slow = dataclasses.replace(fast, latency_per_token=slow_token)
        with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as tmp:
            async with SimEngine(fast) as fast_sim, SimEngine(slow) as slow_sim:
                for _ in range(rounds):
                    for name, kill, durable in (("ref", False, True), ("kill", True, True), ("kill_off", True, False)):
                        runs[name].append(await scenario(server, slow_sim, wave, kill=kill, durable=durable,
                                                         workdir=Path(tmp)))
                    for name, durable in (("base", True), ("base_off", False)):
                        runs[name].append(await scenario(server, fast_sim, prompts, kill=False, durable=durable,
                                                         workdir=Path(tmp)))
                    runs["limit"].append(await limit_scenario(server, fast_sim, prompts, 4, 3))
        return runs

    runs = asyncio.run(measure())
    reference = runs["ref"][0]["samples"]

    def equal(result: dict[str, Any]) -> str:
        got = result["samples"]
        same = sum(1 for key, value in reference.items() if got.get(key) == value)
        return f"{same}/{len(reference)}"

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    calls, tools = med("ref", "engine_calls"), med("ref", "tool_calls")
    rows = []
    for name, label in (("ref", "no kill"), ("kill", "kill A at half, durable (resume)"),
                        ("kill_off", "kill A at half, start over")):
        rs = runs[name]
        rows.append([
            label, med(name, "wall_s"), med(name, "after_kill_s") if name != "ref" else "-",
            med(name, "engine_calls"), med(name, "engine_calls") - calls,
            med(name, "in_flight_at_kill") if name.startswith("kill") else "-",
            med(name, "tool_calls") - tools, med(name, "once_calls"),
            " ".join(equal(r) for r in rs), max(r["journals_left"] for r in rs),
        ])
    steps = prompts * N * STEPS_PER_EPISODE
    journaled = med("base", "journal_steps")
    cost_rows = [
        ["producer CPU per episode step, journal off", 1e6 * med("base_off", "producer_cpu_s") / steps, "µs"],
        ["producer CPU per episode step, journal on", 1e6 * med("base", "producer_cpu_s") / steps, "µs"],
        ["Redis CPU per journaled step (on minus off)",
         1e6 * (med("base", "redis_cpu_s") - med("base_off", "redis_cpu_s")) / max(1.0, journaled), "µs"],
        ["Redis memory per step held (MEMORY USAGE of A's journals)", med("kill", "memory_per_step"), "bytes"],
        ["of which step data (journal_bytes / steps held)", med("kill", "journal_bytes_per_step"), "bytes"],
    ]
    note_engine = (f"{prompts} prompts x n={N} episodes of {TURNS} engine calls (mean 96 tokens, 2 ms a token, "
                   f"deterministic simulator), a 100 ms tool between two calls, {CONCURRENCY} episodes in flight, "
                   f"lease {LEASE:g} s; {rounds} rounds: medians.")
    note_kill = (f"one wave: {wave} prompts x n={N} episodes (all in flight at once) of {TURNS} engine calls "
                 f"(mean 96 tokens, {slow_token * 1000:g} ms a token, deterministic simulator), a 100 ms tool "
                 f"between two calls, lease {LEASE:g} s; {rounds} rounds: medians, equality: every round, against "
                 "the first uninterrupted run.")
    return [Table(
        name="durable-kill",
        title="Durable episodes: a producer killed midway through 6-turn episodes",
        headers=["run", "wall s (A start to last take)", "s from the kill to the last take", "engine calls",
                 "made again vs no kill",
                 "in flight at the kill", "tool calls made again", "once calls",
                 "samples equal to the uninterrupted run (tokens, mask, log-probs)", "journals left"],
        rows=rows,
        notes=[
            note_kill,
            "made again = this run's engine calls minus the uninterrupted run's; target with the journal: no "
            "finished call made again, only the calls in flight at the kill. Tool calls are made again by "
            "design (the user's code between steps runs again to rebuild the tool's state); `once` results "
            "are replayed.",
        ],
        command="python -m bench episodes --kill",
    ), Table(
        name="durable-limit",
        title="A namespace-wide limit of 3 held by 4 producers",
        headers=["producers", "limit", "episodes (units granted)", "most holders seen at once", "mean wait s",
                 "wall s"],
        rows=[[4, 3, int(med("limit", "granted")), max(r["peak"] for r in runs["limit"]),
               med("limit", "mean_wait_s"), med("limit", "seconds")]],
        notes=[f"{prompts} prompts x n={N}, each episode holds a unit of `sandbox` for a 50 ms tool, then makes one "
               f"engine call outside it; {CONCURRENCY} episodes in flight per producer (64 wanting a unit at once); "
               "most holders: the `peak` LIMIT_ACQUIRE records (the maximum over the rounds; target 3)."],
        command="python -m bench episodes --kill",
    ), Table(
        name="durable-cost",
        title="Durable episodes: what the journal costs per step",
        headers=["figure", "value", "unit"],
        rows=cost_rows,
        notes=[
            note_engine,
            "a step is a once, an engine call or an observe (12 per episode); producer CPU over the run "
            "after its first admission, engine reply parsing included; Redis CPU is the server's INFO cpu "
            "over the whole run (every script and read), the difference between the runs with and without "
            "the journal divided by the steps journaled.",
        ],
        command="python -m bench episodes --kill",
    ), sweep_table(quick)]


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    for table in [sweep_table()] if "--sweep" in sys.argv[1:] else run():
        print(table.markdown())
