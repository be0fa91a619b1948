"""Generate functions for ``bench.episodes``: fixed turn counts, a tool that may sleep."""

from __future__ import annotations

import asyncio
import os
import time

from rollstream.common.models import Sample
from rollstream.producer.episode import Episode

TURNS = int(os.environ.get("BENCH_TURNS", "3"))
TOOL_SLEEP = float(os.environ.get("BENCH_TOOL_SLEEP", "0"))
OBSERVATION = list(range(1000, 1016))
"""16 tool tokens appended after each turn but the last."""


async def turns(episode: Episode) -> Sample:
    """``BENCH_TURNS`` engine calls, a tool (sleeping ``BENCH_TOOL_SLEEP`` s) between two."""
    for turn in range(TURNS):
        await episode.generate()
        if turn < TURNS - 1:
            if TOOL_SLEEP > 0:
                await asyncio.sleep(TOOL_SLEEP)
            await episode.observe(OBSERVATION)
    return episode.sample


BLOCK_SECONDS = float(os.environ.get("BENCH_BLOCK_SECONDS", "8"))
BLOCK_EVERY = int(os.environ.get("BENCH_BLOCK_EVERY", "6"))


async def blocking(episode: Episode) -> Sample:
    """The single-turn rollout, but member 0 of every ``BENCH_BLOCK_EVERY``-th prompt first calls a
    synchronous ``time.sleep(BENCH_BLOCK_SECONDS)`` on the event loop (issue 32: a blocking tool)."""
    if episode.info.index % BLOCK_EVERY == 0 and episode.member == 0:
        time.sleep(BLOCK_SECONDS)  # noqa: ASYNC251 -- the mistake this function reproduces
    await episode.generate()
    return episode.sample


KILL_TURNS = 6
KILL_TOOL_SLEEP = float(os.environ.get("BENCH_TOOL_SLEEP", "0.05"))


async def six_turns(episode: Episode) -> Sample:
    """``bench.durable``'s episode: six engine calls, a tool between two (it sleeps
    ``BENCH_TOOL_SLEEP`` s, appends a line to ``$BENCH_TOOL_LOG`` and returns 16 tokens that
    depend on the turn and the member), the sandbox behind ``episode.once``."""
    log = os.environ.get("BENCH_TOOL_LOG", "")

    def note(what: str) -> None:
        if log:
            with open(log, "a") as out:
                out.write(f"{what}\n")

    await episode.once("sandbox", lambda: note("once"))
    for turn in range(KILL_TURNS):
        await episode.generate()
        if turn < KILL_TURNS - 1:
            await asyncio.sleep(KILL_TOOL_SLEEP)
            note("tool")
            await episode.observe([1000 + 100 * episode.member + turn * 16 + k for k in range(16)])
    return episode.sample


async def limited(episode: Episode) -> Sample:
    """``bench.durable``'s limit run: a 50 ms tool inside the namespace limit ``sandbox``, then one
    engine call outside it."""
    async with episode.limit("sandbox"):
        await asyncio.sleep(0.05)
    await episode.generate()
    return episode.sample
