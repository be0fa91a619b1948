"""Ready-made dynamic-sampling filters for ``take(..., keep=...)``."""

from __future__ import annotations

import math

from rollstream.common.models import Group


def reward_variance(group: Group) -> bool | str:
    """DAPO-style: reject groups whose rewards are all equal (no learning signal)."""
    rewards = [s.scalar_reward for s in group.samples]
    if any(math.isnan(r) for r in rewards):
        return True
    return True if max(rewards) - min(rewards) > 1e-9 else "zero_variance"
