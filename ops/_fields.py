"""Reading raw Redis replies (bytes or str, possibly missing) as text and integers, leniently:
operator views must show a damaged entry, not crash on it. The parsers are the protocol
layer's (:mod:`rollstream.common.redis_values`)."""

from __future__ import annotations

from typing import Any

from rollstream.common.redis_values import int_or, text

__all__ = ["as_int", "text"]


def as_int(value: Any) -> int:
    """The integer in ``value``; 0 when it is missing or not an integer."""
    return int_or(value)
