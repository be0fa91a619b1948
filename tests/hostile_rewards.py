"""Reward functions for tests/test_hostile_producer.py, run by real producer processes
(``--reward hostile_rewards:<name>``, with ``tests/`` on ``PYTHONPATH``). The prompt text says
how to misbehave: ``BADREWARD:<kind> ...``; any other prompt scores 1.0 per sample."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rollstream.common.models import Sample

HANG_SECONDS = 6.0
"""A "hang" lasts this long (far past the tests' 1 s reward timeout, but the threads do end)."""


def _kind(prompt: Any) -> str:
    text = prompt if isinstance(prompt, str) else ""
    return text.split()[0].partition(":")[2] if text.startswith("BADREWARD:") else ""


def _misbehave(kind: str, n: int) -> list[Any]:
    if kind == "raise":
        raise ValueError("poison prompt")
    if kind == "exit":
        raise SystemExit(3)
    if kind == "interrupt":
        raise KeyboardInterrupt
    if kind == "nan":
        return [float("nan")] * n
    if kind == "inf":
        return [float("inf")] * n
    if kind == "string":
        return ["1.0"] * n
    if kind == "short":
        return [1.0] * (n - 1)
    return [1.0] * n


def poison_group(samples: list[Sample], prompt: Any, label: Any) -> list[Any]:
    """Sync, per group."""
    kind = _kind(prompt)
    if kind == "hang":
        time.sleep(HANG_SECONDS)
    return _misbehave(kind, len(samples))


async def poison_group_async(samples: list[Sample], prompt: Any, label: Any) -> list[Any]:
    """Async, per group."""
    kind = _kind(prompt)
    if kind == "hang":
        await asyncio.sleep(3600)
    return _misbehave(kind, len(samples))


def always_raises(samples: list[Sample], prompt: Any, label: Any) -> list[float]:
    """A reward broken for every prompt."""
    raise RuntimeError("this reward is broken")


BLOCK_REWARD_SECONDS = 7.0
"""A blocking async reward holds the loop this long: past a 5 s lease (issue 43, finding 9)."""


async def blocking_async(samples: list[Sample], prompt: Any, label: Any) -> list[Any]:
    """Async, per group, and wrong: a ``BLOCKREWARD`` prompt calls a synchronous ``time.sleep``
    on the producer's event loop; the others score 1.0 per sample."""
    if isinstance(prompt, str) and "BLOCKREWARD" in prompt:
        time.sleep(BLOCK_REWARD_SECONDS)  # noqa: ASYNC251 -- the mistake under test
    return [1.0] * len(samples)


async def blocking_async_per_sample(sample: Sample, prompt: Any, label: Any) -> float:
    """:func:`blocking_async`, per sample: each sample of a ``BLOCKREWARD`` prompt holds the loop."""
    if isinstance(prompt, str) and "BLOCKREWARD" in prompt:
        time.sleep(BLOCK_REWARD_SECONDS)  # noqa: ASYNC251 -- the mistake under test
    return 1.0
