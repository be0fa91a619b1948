"""Reward functions used by tests/test_rewards.py through ``"reward_fns:<name>"`` specs."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from rollstream.common.models import Sample

NOT_CALLABLE = 42


def length_reward(sample: Sample, prompt: Any, label: Any) -> float:
    """Per sample, sync: the response length."""
    return len(sample.response)


def dict_reward(sample: Sample, prompt: Any, label: Any) -> dict[str, float]:
    return {"score": float(sample.response == label), "length": len(sample.response)}


async def exact_group(samples: list[Sample], prompt: Any, label: Any) -> list[float]:
    """Per group (first parameter named ``samples``), async: 1.0 for responses equal to the label."""
    await asyncio.sleep(0)
    return [1.0 if s.response == label else 0.0 for s in samples]


def rank_group(samples: list[Sample], prompt: Any, label: Any) -> list[float]:
    """Per group, sync: the rank of each sample's response in sorted order."""
    order = sorted(range(len(samples)), key=lambda i: samples[i].response)
    ranks = [0.0] * len(samples)
    for rank, i in enumerate(order):
        ranks[i] = float(rank)
    return ranks


def flagged_group(batch: list[Sample], prompt: Any, label: Any) -> list[float]:
    """Per group through the ``per_group`` attribute (the parameter is not named ``samples``)."""
    return [float(len(batch))] * len(batch)


flagged_group.per_group = True  # type: ignore[attr-defined]


def samples_but_per_sample(samples: Sample, prompt: Any, label: Any) -> float:
    """Named ``samples`` but forced per sample by ``per_group = False``."""
    return float(samples.index)


samples_but_per_sample.per_group = False  # type: ignore[attr-defined]


async def concurrent_reward(sample: Sample, prompt: Any, label: Any) -> float:
    """Per sample, async: every sample waits for all of the group to have started."""
    state = prompt  # the tests pass a dict {"started": int, "event": asyncio.Event, "n": int}
    state["started"] += 1
    if state["started"] == state["n"]:
        state["event"].set()
    await asyncio.wait_for(state["event"].wait(), timeout=5)
    return float(sample.index)


async def slow_reward(sample: Sample, prompt: Any, label: Any) -> float:
    await asyncio.sleep(10)
    return 0.0


def string_reward(sample: Sample, prompt: Any, label: Any) -> Any:
    return "1.0"


def bool_reward(sample: Sample, prompt: Any, label: Any) -> Any:
    return True


def nan_reward(sample: Sample, prompt: Any, label: Any) -> Any:
    return float("nan")


def none_reward(sample: Sample, prompt: Any, label: Any) -> Any:
    return None


def bad_dict_reward(sample: Sample, prompt: Any, label: Any) -> Any:
    return {"score": "high"}


def short_group(samples: list[Sample], prompt: Any, label: Any) -> list[float]:
    return [0.0] * (len(samples) - 1)


def not_a_list_group(samples: list[Sample], prompt: Any, label: Any) -> Any:
    return 1.0


def raising_reward(sample: Sample, prompt: Any, label: Any) -> float:
    raise KeyError("boom")


async def raising_async_reward(sample: Sample, prompt: Any, label: Any) -> float:
    await asyncio.sleep(0)
    if sample.index == 1:
        raise ZeroDivisionError("sample one is broken")
    return 0.0


def exiting_reward(sample: Sample, prompt: Any, label: Any) -> float:
    raise SystemExit(3)


async def exiting_async_reward(sample: Sample, prompt: Any, label: Any) -> float:
    raise SystemExit(3)


async def interrupting_group(samples: list[Sample], prompt: Any, label: Any) -> list[float]:
    raise KeyboardInterrupt


def sleepy_sync_reward(sample: Sample, prompt: Any, label: Any) -> float:
    time.sleep(0.2)
    return 1.0


HANG = threading.Event()
"""``hanging_sync_reward`` blocks until this is set (the tests set it when done)."""


def hanging_sync_reward(sample: Sample, prompt: Any, label: Any) -> float:
    HANG.wait(30)
    return 0.0


async def cancelled_reward(sample: Sample, prompt: Any, label: Any) -> float:
    raise asyncio.CancelledError


def one_argument(sample: Sample) -> float:
    return 0.0


class Scorer:
    """A dotted attribute path target: ``reward_fns:Scorer.score``."""

    @staticmethod
    def score(sample: Sample, prompt: Any, label: Any) -> float:
        return 0.5


def easy_or_alternating(sample: Sample, prompt: Any, label: Any) -> float:
    """Label ``easy``: always solved (1.0, a zero-variance group); else 0/1 by sample index."""
    return 1.0 if label == "easy" else float(sample.index % 2)
