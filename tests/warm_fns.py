"""A generate function with warm-pool hooks (``warm_fns:generate``) for tests/test_warm_pools.py:
``prepare`` and ``release`` append a line to ``$TOOL_LOG``; member 0 takes its prepared
resource, member 1 does not; every episode waits for the file ``$RELEASE`` (at most 60 s)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from rollstream.common.models import Sample
from rollstream.producer.episode import Episode, EpisodeInfo


def _note(line: str) -> None:
    with Path(os.environ["TOOL_LOG"]).open("a") as out:
        out.write(f"{line}\n")


async def generate(episode: Episode) -> Sample:
    box = await episode.prepared() if episode.member == 0 else None
    _note(f"episode {episode.info.index} {episode.member}")
    release = Path(os.environ["RELEASE"])
    for _ in range(1200):
        if await asyncio.to_thread(release.exists):
            break
        await asyncio.sleep(0.05)
    await episode.generate(max_new_tokens=8)
    sample = episode.sample
    sample.metadata = {**sample.metadata, "box": box}
    return sample


async def prepare(info: EpisodeInfo) -> str:
    _note(f"prepare {info.index} {info.member}")
    return f"box-{info.index}-{info.member}"


async def release(box: str) -> None:
    _note(f"release {box}")


generate.prepare = prepare  # type: ignore[attr-defined]
generate.release = release  # type: ignore[attr-defined]
