"""``python -m bench joining``: engines join routing only after their first answered probe (issue 43).

A fleet of four simulated SGLang engines, one wedged from the start (accepts connections, never
answers, ``/health`` hangs too) and one refusing connections (a dead host), against its two
healthy engines alone, on 64 and 256 prompts (4 samples each, 32 in flight), with the producer's
default health settings (``--health-interval 2``, ``--health-timeout 5``). Beside it, the same
fleet with every engine routed from the start (the rule before: the wedged engine's requests
waited for a probe to find it out, then went elsewhere; the monitor's probes run apart in both,
so one hanging probe delays no other, as they do now).

In-process (the rollout over the engine client, no Redis): what is measured is the routing.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from rollstream.common.models import Prompt
from rollstream.producer.engine import EngineClient, EngineSettings, EngineState
from rollstream.testing.sim import SimConfig, SimEngine

from bench.common import Table
from bench.fleet import REFUSING, _roll


async def _fleet(urls: tuple[str, ...], prompts: list[Prompt], *, joining: bool) -> tuple[float, int, str]:
    settings = EngineSettings(urls=urls, max_new_tokens=256)
    async with EngineClient(settings) as client:
        if not joining:  # the rule before: every engine routed from the start
            for engine in client.fleet.engines.values():
                engine.state, engine.reason = EngineState.HEALTHY, ""
        await client.prepare()
        seconds, groups = await _roll(client, prompts, n=4, concurrency=32)
        states = {e["url"]: e["state"] for e in client.fleet_status()}
    done = sum(all(s.status.value in ("completed", "truncated") for s in g.samples) for g in groups)
    return seconds, done, ", ".join(states[u] for u in urls[2:]) or "-"


async def _main(quick: bool) -> list[list[Any]]:
    config = SimConfig(mean_tokens=48, latency_per_token=0.002 if quick else 0.005, max_running=64)
    rows: list[list[Any]] = []
    async with SimEngine(config) as a, SimEngine(config) as b, SimEngine(config) as wedged:
        async with httpx.AsyncClient() as http:
            await http.post(f"{wedged.url}/sim/faults", json={"wedge": True})
        pair = (a.url, b.url)
        sick = (a.url, b.url, REFUSING, wedged.url)
        warm = [Prompt(index=i, prompt=f"What is {i} + 2?") for i in range(16)]
        await _fleet(pair, warm, joining=True)  # imports, first connections: not in the first figure
        for count in (16,) if quick else (64, 256):
            prompts = [Prompt(index=i, prompt=f"What is {i} + 1?") for i in range(count)]
            base, done, _ = await _fleet(pair, prompts, joining=True)
            rows.append(["2 healthy engines alone", count, done, base, "-", 1.0])
            for label, joining in (("+ 1 wedged + 1 refusing, joining (now)", True),
                                   ("+ 1 wedged + 1 refusing, all routed at start (before)", False)):
                seconds, done, states = await _fleet(sick, prompts, joining=joining)
                rows.append([label, count, done, seconds, states, seconds / base])
    return rows


def run(quick: bool = False) -> list[Table]:
    rows = asyncio.run(_main(quick))
    return [
        Table("joining", "A fleet with a wedged and a refusing engine from the start, against its healthy pair",
              ["fleet", "prompts", "groups completed", "wall s", "sick engines end", "x healthy pair"], rows,
              ["4 samples per prompt, 32 in flight; --health-interval 2 --health-timeout 5 (the defaults)",
               "target (issue 43): the four-engine fleet within 1.2x of the healthy pair, on 64 prompts as on 256"],
              "python -m bench joining" + (" --quick" if quick else "")),
    ]
