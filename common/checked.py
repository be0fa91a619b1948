"""Values checked by type where Python's own check says too much: ``True`` is an ``int`` (and a
number), so "an int" in a setting, a wire field or a reward is always "an int that is not a bool".
Written once here; ``tests/test_layers.py`` fails on the hand-written pair elsewhere."""

from __future__ import annotations

from typing import TypeGuard


def is_int(value: object) -> TypeGuard[int]:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """An ``int`` or a ``float`` that is not a ``bool`` (not checked finite)."""
    return isinstance(value, int | float) and not isinstance(value, bool)
