"""Generate functions for ``bench.episodes``: fixed turn counts, a tool that may sleep."""

from __future__ import annotations

import asyncio
import os

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
