"""Dynamic-sampling filters for ``take(..., keep=...)``: the verdict rule and ready-made filters.

A keep filter is called with each usable group and returns its verdict:

* a non-empty ``str`` rejects the group, the string being the reason (counted as ``filtered/<reason>``);
* otherwise the verdict's truth value decides: truthy keeps (``True``, ``numpy.bool_(True)``, 1),
  falsy rejects with the reason ``"rejected"`` (``False``, ``None``, ``0``, ``""``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from rollstream.common.models import Group

KeepFilter = Callable[[Group], object]
"""Dynamic-sampling filter: a truthy verdict keeps a group; a falsy one or a reason string rejects it."""

REJECTED = "rejected"
"""The reason recorded for a falsy verdict."""


def rejection_reason(verdict: object) -> str | None:
    """None when ``verdict`` keeps the group, else why it was rejected (see the module docstring)."""
    if isinstance(verdict, str):
        return verdict or REJECTED
    return None if verdict else REJECTED


def reward_variance(group: Group) -> bool | str:
    """DAPO-style: reject groups whose rewards are all equal (no learning signal)."""
    rewards = [s.scalar_reward for s in group.samples]
    if any(math.isnan(r) for r in rewards):
        return True
    return True if max(rewards) - min(rewards) > 1e-9 else "zero_variance"
