"""Generate functions (rollout plug-ins) for the tests, loaded by producers as ``episode_fns:NAME``
(or in-process). Behaviour is chosen by the prompt text, so one function serves a whole run:

* ``HANG``: the tool never returns (only the episode deadline ends it);
* ``RAISE``: the tool raises;
* ``SLOWTOOL``: the tool sleeps until the file named by ``$EPISODE_RELEASE`` exists (or 60 s);
* otherwise the calculator loop of examples/calculator.py.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import time
from array import array
from pathlib import Path

from rollstream.common.models import Sample
from rollstream.producer.episode import Episode

TOOL_CALL = re.compile(r"<tool>(\w+): ([^<]*)</tool>")


class ToolFailed(RuntimeError):
    pass


def _calc(expression: str) -> str:
    from rollstream.testing.sim.simulator import evaluate_last_expression

    value = evaluate_last_expression(expression)
    return "?" if value is None else str(value)


async def tool(name: str, argument: str, prompt: str) -> str:
    if "HANG" in prompt:
        await asyncio.Event().wait()
    if "RAISE" in prompt:
        raise ToolFailed(f"the {name} tool exploded on {argument!r}")
    if "SLOWTOOL" in prompt:
        release = Path(os.environ.get("EPISODE_RELEASE", "/nonexistent"))
        for _ in range(1200):
            if await asyncio.to_thread(release.exists):
                break
            await asyncio.sleep(0.05)
    return _calc(argument)


async def calculator(episode: Episode) -> Sample:
    prompt = str(episode.prompt)
    for _ in range(8):
        turn = await episode.generate()
        calls = TOOL_CALL.findall(turn.text)
        if not calls or turn.truncated:
            break
        name, argument = calls[-1]
        await episode.observe(f"<result>{await tool(name, argument, prompt)}</result>")
    return episode.sample


async def nested(episode: Episode) -> list[list[Sample]]:
    await episode.generate()
    return [[episode.sample]]


async def not_a_sample(episode: Episode) -> str:
    await episode.generate()
    return "a string"


async def short_mask(episode: Episode) -> Sample:
    await episode.generate()
    sample = episode.sample
    sample.loss_mask = array("B", b"\x01" * (sample.response_length - 1))
    return sample


async def nan_log_prob(episode: Episode) -> Sample:
    await episode.generate()
    sample = episode.sample
    assert sample.rollout_log_probs is not None
    log_probs = array("f", sample.rollout_log_probs)
    log_probs[0] = math.nan
    sample.rollout_log_probs = log_probs
    return sample


async def tokens_mismatch(episode: Episode) -> Sample:
    await episode.generate()
    sample = episode.sample
    sample.response_length += 1
    return sample


async def two_agents(episode: Episode) -> list[Sample]:
    """A solver and a checker: two segments of one episode."""
    await episode.generate()
    checker = await episode.segment(f"Check: {episode.sample.response}")
    await checker.generate(max_new_tokens=8)
    return [episode.sample, checker.sample]


async def always_raises(episode: Episode) -> Sample:
    raise ToolFailed("broken function")


async def object_metadata(episode: Episode) -> Sample:
    """The calculator, except that prompts saying OBJECT get metadata the wire format cannot carry."""
    sample = await calculator(episode)
    if "OBJECT" in str(episode.prompt):
        sample.metadata = {**sample.metadata, "tool_state": object()}
    return sample


BLOCK = re.compile(r"BLOCK=(\d+(?:\.\d+)?)")


async def blocking(episode: Episode) -> Sample:
    """The single-turn rollout, except that member 0 of a prompt holding ``BLOCK=S`` first calls
    a synchronous ``time.sleep(S)`` on the event loop (issue 32: a blocking tool)."""
    found = BLOCK.search(str(episode.prompt))
    if found and episode.member == 0:
        time.sleep(float(found.group(1)))  # noqa: ASYNC251 -- the mistake under test
    await episode.generate()
    return episode.sample
