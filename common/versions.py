"""Weight versions as engines report them: the one parser every reader uses.

SGLang sends ``weight_version`` as a string (``"7"``), vLLM as a string or ``"default"`` before
the first ``/update_weight_version``, rollstream's own endpoints as an int. A version is an
integer in 0..2^63-1; anything else (a bool, a float, a negative number, words) is no version.
"""

from __future__ import annotations

MAX_VERSION = 2**63 - 1
"""The largest weight version: what a signed 64-bit field (msgpack, Redis, a trainer's int64) holds."""


def out_of_range(value: object) -> bool:
    """Whether ``value`` is an integer (or an integer string) above :data:`MAX_VERSION`: an
    engine reply holding one is unusable, never a version. Long strings are never converted
    (a 5,000-digit one would trip Python's int-conversion limit)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value > MAX_VERSION
    if isinstance(value, str):
        text = value.strip()
        return text.isascii() and text.isdigit() and (len(text) > 19 or int(text) > MAX_VERSION)
    return False


def parse_version(value: object) -> int | None:
    """An integer weight version (0..:data:`MAX_VERSION`) from an int or an integer string; None otherwise."""
    if isinstance(value, bool) or out_of_range(value):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, str):
        text = value.strip()
        return int(text) if text.isascii() and text.isdigit() else None
    return None


def version_of(payload: object) -> int | None:
    """The ``weight_version`` of an engine's JSON reply (``/model_info``, ``/weight_info``, ...);
    None when the reply is not an object or holds no integer version."""
    return parse_version(payload.get("weight_version")) if isinstance(payload, dict) else None
