"""``python -m bench fleet``: the engine fleet (producer/engine/fleet.py), in one run, side by side.

* **A sick fleet**: the same prompts on two healthy simulated engines alone, and on those two
  plus one refusing connections (a dead host) and one wedged (accepts, never answers); wall time
  of the rollout and whether it finished.
* **An engine on old weights**: three engines, the trainer at version 5, one engine restarted at
  version 0 (``/sim/restart``): groups with a sample from it (stale, recycled), with the fleet's
  version gate and without (the routing before: any engine).
* **Prefix cache**: groups of 4 samples of one long prompt, and 3-turn episodes, on one engine
  and on two (SGLang's ``cached_tokens``), with cache-aware routing and without (least-loaded, the
  routing before); hit rate and the split of requests between the two.

* **Adaptive concurrency**: one engine with a KV capacity (vLLM-style preemption, recompute at
  ``prefill_per_token``), a backlog that never empties: steady-state tokens/s at fixed
  concurrencies (a sweep) and with ``--adaptive-concurrency`` at 256 (no tuning), the default fixed
  256 beside it.

In-process (the rollout over the engine client, no Redis): what is measured is the routing, not
the pipeline's cost.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from typing import Any

import httpx
from rollstream.common.models import Prompt
from rollstream.producer.engine import EngineClient, EngineSettings
from rollstream.producer.rewards import PythonReward
from rollstream.producer.rollout import Rollout
from rollstream.producer.settings import EpisodeSettings
from rollstream.testing.sim import SimConfig, SimEngine

from bench import episode_fns
from bench.common import Table

REFUSING = "http://127.0.0.1:9"


def _reward() -> PythonReward:
    return PythonReward(lambda s, p, lab: 1.0, name="one")


def _without_affinity(client: EngineClient) -> None:
    """The routing before the fleet: least samples in flight, the group's key ignored."""
    pick = client.fleet.pick
    client.fleet.pick = lambda key=None, weight=1: pick(None, weight)  # type: ignore[method-assign]


async def _roll(client: EngineClient, prompts: Sequence[Prompt], *, n: int, concurrency: int,
                generate: Any = None) -> tuple[float, list[Any]]:
    rollout = Rollout(client, _reward(), n, EpisodeSettings(generate=generate))
    gate = asyncio.Semaphore(max(1, concurrency // n))

    async def one(prompt: Prompt) -> Any:
        async with gate:
            return await rollout.run(prompt, admitted_version=5)

    started = time.monotonic()
    groups = await asyncio.gather(*(one(p) for p in prompts))
    return time.monotonic() - started, groups


async def _stats(engine: SimEngine) -> dict[str, Any]:
    async with httpx.AsyncClient() as http:
        stats: dict[str, Any] = (await http.get(f"{engine.url}/sim/stats")).json()
        return stats


async def _sick(quick: bool) -> list[list[Any]]:
    prompts = [Prompt(index=i, prompt=f"What is {i} + 1?") for i in range(16 if quick else 192)]
    config = SimConfig(mean_tokens=48, latency_per_token=0.002 if quick else 0.01, max_running=64)
    rows = []
    async with SimEngine(config) as a, SimEngine(config) as b, SimEngine(config) as wedged:
        async with httpx.AsyncClient() as http:
            await http.post(f"{wedged.url}/sim/faults", json={"wedge": True})
        for label, urls in (("2 healthy engines alone", (a.url, b.url)),
                            ("+ 1 refusing + 1 wedged", (a.url, b.url, REFUSING, wedged.url))):
            settings = EngineSettings(urls=urls, max_new_tokens=256, health_interval=1.0, health_timeout=2.0)
            async with EngineClient(settings) as client:
                seconds, groups = await _roll(client, prompts, n=4, concurrency=32)
                states = {e["url"]: e["state"] for e in client.fleet_status()}
            done = sum(all(s.status.value in ("completed", "truncated") for s in g.samples) for g in groups)
            sick = ", ".join(f"{states[u]}" for u in urls[2:]) or "-"
            rows.append([label, len(prompts), done, seconds, sick])
    base = rows[0][3]
    for row in rows:
        row.append(row[3] / base)
    return rows


async def _behind(quick: bool) -> list[list[Any]]:
    prompts = [Prompt(index=i, prompt=f"What is {i} + 2?") for i in range(24 if quick else 96)]
    config = SimConfig(mean_tokens=32, latency_per_token=0.002, weight_version=5)
    rows = []
    for label, gate in (("any engine (before)", False), ("version gate (fleet)", True)):
        async with SimEngine(config) as a, SimEngine(config) as b, SimEngine(config) as old:
            async with httpx.AsyncClient() as http:
                await http.post(f"{old.url}/sim/restart", json={"version": 0})
            settings = EngineSettings(urls=(a.url, b.url, old.url), max_new_tokens=128)
            async with EngineClient(settings) as client:
                if gate:
                    client.set_trainer_version(5, 1)
                _, groups = await _roll(client, prompts, n=4, concurrency=32)
            stale = sum(any(min(s.weight_versions or [5]) < 4 for s in g.samples) for g in groups)
            rows.append([label, len(prompts), stale, (await _stats(old))["requests"]])
    return rows


async def _cache(quick: bool) -> list[list[Any]]:
    groups = 12 if quick else 64
    long_prompt = "padding " * 64  # 512 tokens: the shared prefix of a group's samples
    long = [Prompt(index=i, prompt=f"{i} {long_prompt} What is {i} + 3?") for i in range(groups)]
    short = [Prompt(index=i, prompt=f"{i}: What is {i} + 3? Think.") for i in range(groups)]
    config = SimConfig(mean_tokens=128, latency_per_token=0.0005, prefix_cache_tokens=1 << 22)
    rows = []
    for work, n, generate, prompts in (("groups of 4 samples, 512-token prompt", 4, None, long),
                                       ("3-turn episodes, 2 per group", 2, episode_fns.turns, short)):
        for label, engines, affinity in (("one engine", 1, True), ("two, least-loaded (before)", 2, False),
                                         ("two, cache-aware (fleet)", 2, True)):
            sims = [SimEngine(config) for _ in range(engines)]
            for sim in sims:
                await sim.start()
            try:
                settings = EngineSettings(urls=tuple(s.url for s in sims), max_new_tokens=64)
                async with EngineClient(settings) as client:
                    if not affinity:
                        _without_affinity(client)
                    await _roll(client, prompts, n=n, concurrency=32, generate=generate)
                stats = [await _stats(s) for s in sims]
            finally:
                for sim in sims:
                    await sim.aclose()
            hit = sum(s["cached_tokens"] for s in stats) / max(1, sum(s["prompt_tokens"] for s in stats))
            requests = [s["requests"] for s in stats]
            rows.append([work, label, hit, max(requests) / max(1, min(requests))])
    for i in range(0, len(rows), 3):
        for row in rows[i:i + 3]:
            row.insert(3, row[2] / rows[i][2] if rows[i][2] else float("nan"))
    return rows


async def _steady(client: EngineClient, sim: SimEngine, concurrency: int, warm: float, window: float) -> float:
    """Tokens/s the engine generates over ``window`` s after ``warm`` s, under a backlog that
    never empties (``concurrency`` samples in flight, groups of 4)."""
    rollout = Rollout(client, _reward(), 4)
    indexes = itertools.count()

    async def worker() -> None:
        while True:
            i = next(indexes)
            await rollout.run(Prompt(index=i, prompt=f"{i}: What is {i} + 1? Think it through."), admitted_version=0)

    workers = [asyncio.create_task(worker()) for _ in range(max(1, concurrency // 4))]
    try:
        await asyncio.sleep(warm)
        before, started = (await _stats(sim))["generated_tokens"], time.monotonic()
        await asyncio.sleep(window)
        after, ended = (await _stats(sim))["generated_tokens"], time.monotonic()
    finally:
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return float((after - before) / (ended - started))


async def _adaptive(quick: bool) -> list[list[Any]]:
    # ~25 requests' tokens fit in 4,096; a request lasts ~1.5 s (0.3 s quick), read every 0.25 s
    config = SimConfig(mean_tokens=128, length_sigma=0.6, latency_per_token=0.002 if quick else 0.01,
                       max_running=256, kv_capacity_tokens=4096, prefill_per_token=0.0005, seed=3)
    warm, window = (3.0, 3.0) if quick else (10.0, 16.0)
    sweep = (16, 48) if quick else (16, 24, 32, 40, 48, 64, 96)
    rows = []
    for label, concurrency, adaptive in [*((f"fixed {c}", c, False) for c in sweep),
                                         ("fixed 256 (the default: no limit)", 256, False),
                                         ("adaptive, --concurrency 256", 256, True)]:
        async with SimEngine(config) as sim:
            settings = EngineSettings(urls=(sim.url,), max_new_tokens=2048, adaptive_concurrency=adaptive,
                                      load_interval=0.25)
            async with EngineClient(settings) as client:
                rate = await _steady(client, sim, concurrency, warm, window)
                limit = client.fleet_status()[0].get("limit", "-")
            preemptions = (await _stats(sim))["preemptions"]
        rows.append([label, rate, preemptions, limit])
    best = max(rows[: len(sweep)], key=lambda r: r[1])
    for row in rows:
        row.append(row[1] / best[1])
    return rows


def run(quick: bool = False) -> list[Table]:
    async def main() -> tuple[list[list[Any]], ...]:
        return await _sick(quick), await _behind(quick), await _cache(quick), await _adaptive(quick)

    sick, behind, cache, adaptive = asyncio.run(main())
    command = "python -m bench fleet" + (" --quick" if quick else "")
    return [
        Table("fleet_sick", "A sick fleet against its healthy engines alone (4 samples per prompt, 32 in flight)",
              ["fleet", "prompts", "groups completed", "wall s", "sick engines end", "x healthy alone"], sick,
              ["--health-interval 1 --health-timeout 2; neither sick engine ever answers a probe, so neither joins "
               "routing (issue 43; before: the refusing one was ejected at its first request, the wedged one "
               "after a probe with requests waiting on it, their requests sent elsewhere)"],
              command),
        Table("fleet_behind", "An engine restarted on version 0, the trainer at 5 (max_staleness 1)",
              ["routing", "groups", "groups with a stale sample", "requests to the old engine"], behind,
              ["a group with any sample from the old engine is recycled as stale"], command),
        Table("fleet_cache", "Prefix-cache hit rate on two engines against one (simulated SGLang cache)",
              ["work", "engines", "hit rate", "x one engine", "requests max/min"], cache,
              ["target: two engines >= 0.95x one engine's hit rate, requests within 1.5x"], command),
        Table("fleet_adaptive", "Adaptive concurrency against fixed ones, one engine with a KV capacity (steady state)",
              ["concurrency", "tokens/s", "preemptions", "limit at the end", "x best fixed"], adaptive,
              ["simulated vLLM scheduling: 4,096 KV tokens, a preempted request recomputed at 0.5 ms per token "
               "(the batch waits)",
               "load read every 0.25 s: a simulated request lasts ~1.5 s (on a real engine: every 1 s, requests "
               "of 10-60 s)", "target: adaptive >= 0.95x the best fixed"], command),
    ]
