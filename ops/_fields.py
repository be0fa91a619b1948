"""Reading raw Redis replies (bytes or str, possibly missing) as text and integers, leniently:
operator views must show a damaged entry, not crash on it."""

from __future__ import annotations

from typing import Any


def text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def as_int(value: Any) -> int:
    """The integer in ``value``; 0 when it is missing or not an integer."""
    try:
        return int(text(value)) if value not in (None, b"", "") else 0
    except ValueError:
        return 0
