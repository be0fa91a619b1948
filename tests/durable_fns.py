"""Generate functions for the durable-episode tests (``durable_fns:NAME``), steered by env vars
set per producer process: ``TOOL_LOG`` (a file each tool call and ``once`` call appends a line
to), ``BLOCK_AT`` (the tool of that turn never returns: the producer is killed or drained there),
``TOOL_SALT`` (appended to tool output: a different value makes a nondeterministic tool),
``ONCE_SHAPE`` (``int_keys``: the sandbox ``once`` returns a map with int keys)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from rollstream.common.models import Sample
from rollstream.producer.episode import Episode

TURNS = 6


async def _released(release: Path) -> None:
    """Until the file ``release`` exists (at most 60 s: then the episode goes on anyway)."""
    for _ in range(1200):
        if await asyncio.to_thread(release.exists):
            return
        await asyncio.sleep(0.05)


def _note(line: str) -> None:
    with Path(os.environ["TOOL_LOG"]).open("a") as out:
        out.write(f"{os.getpid()} {line}\n")


async def six_turns(episode: Episode) -> Sample:
    """Six engine calls with a tool call between each two, behind one ``once`` (a sandbox)."""
    block_at = int(os.environ.get("BLOCK_AT", "0"))
    salt = os.environ.get("TOOL_SALT", "")

    def sandbox() -> str | dict[int, str]:
        _note("once sandbox")
        if os.environ.get("ONCE_SHAPE") == "int_keys":
            return {1: f"sandbox-{os.getpid()}", 2: "spare"}
        return f"sandbox-{os.getpid()}"

    made = await episode.once("sandbox", sandbox)
    box = made[1] if isinstance(made, dict) else made
    for turn in range(1, TURNS + 1):
        await episode.generate(max_new_tokens=8)
        if turn == TURNS:
            break
        _note(f"tool {turn} {box}")
        if turn == block_at:
            await asyncio.Event().wait()  # the producer is killed or drained here
        await episode.observe(f"<result>{turn}{salt}</result>")
    return episode.sample


async def fails_after_steps(episode: Episode) -> Sample:
    """Journals two steps, then raises: the group fails, is recycled, then dead-lettered."""
    await episode.generate(max_new_tokens=8)
    await episode.observe("<result>1</result>")
    raise RuntimeError("the tool broke after two steps")


async def limited(episode: Episode) -> Sample:
    """One engine call inside the namespace limit ``sandbox``; with ``BLOCK_AT`` set, the episode
    holding the unit never lets it go (the producer is killed there)."""
    async with episode.limit("sandbox"):
        _note(f"sandbox {episode.member}")
        if os.environ.get("BLOCK_AT"):
            await asyncio.Event().wait()
        await episode.generate(max_new_tokens=8)
    return episode.sample


async def rated(episode: Episode) -> Sample:
    """One token of the namespace rate ``judge``, then (holding its producer's only slot) a wait
    for the file ``$RELEASE`` (at most 60 s), then its engine call."""
    await episode.rate("judge")
    await _released(Path(os.environ.get("RELEASE", "/nonexistent")))
    await episode.generate(max_new_tokens=8)
    return episode.sample


async def turns_then_tool(episode: Episode) -> Sample:
    """Three engine calls with observations between them, then a last tool call before the
    sample is returned; ``BLOCK_AT=end`` blocks there, so a resumed episode replays every call."""
    for turn in range(1, 4):
        await episode.generate(max_new_tokens=8)
        if turn < 3:
            await episode.observe(f"<result>{turn}</result>")
    _note("final tool")
    if os.environ.get("BLOCK_AT") == "end":
        await asyncio.Event().wait()
    return episode.sample


async def parallel_calls(episode: Episode) -> Sample:
    """Two engine calls at once (``asyncio.gather``) whose finishing order ``ORDER`` sets (``ba``:
    the call for ``b`` goes first, the other waits for it), both replies observed into the sample,
    then a tool (``BLOCK_AT=tool`` blocks there) and a last call."""
    first = os.environ.get("ORDER", "ab")[0]
    done = asyncio.Event()
    prompt = list(episode.sample.tokens)

    async def call(name: str) -> list[int]:
        if name != first:
            await done.wait()
        turn = await episode.complete([*prompt, ord(name)], max_new_tokens=4)
        done.set()
        return list(turn.token_ids)

    replies = await asyncio.gather(call("a"), call("b"))
    for ids in replies:
        await episode.observe(ids)
    _note("tool")
    if os.environ.get("BLOCK_AT") == "tool":
        await asyncio.Event().wait()
    await episode.generate(max_new_tokens=4)
    return episode.sample


async def held_until_release(episode: Episode) -> Sample:
    """Inside the limit ``sandbox`` (a line ``sandbox MEMBER`` once in), wait for the file
    ``$RELEASE`` (at most 60 s), then one engine call."""
    async with episode.limit("sandbox"):
        _note(f"sandbox {episode.member}")
        await _released(Path(os.environ["RELEASE"]))
        await episode.generate(max_new_tokens=8)
    return episode.sample
