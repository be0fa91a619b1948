"""Weight versions as engines report them: the one parser every reader uses.

SGLang sends ``weight_version`` as a string (``"7"``), vLLM as a string or ``"default"`` before
the first ``/update_weight_version``, rollstream's own endpoints as an int. A version is an
integer >= 0; anything else (a bool, a float, a negative number, words) is no version.
"""

from __future__ import annotations

from typing import Any


def parse_version(value: Any) -> int | None:
    """An integer weight version from an int or an integer string; None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, str):
        text = value.strip()
        return int(text) if text.isascii() and text.isdigit() else None
    return None


def version_of(payload: Any) -> int | None:
    """The ``weight_version`` of an engine's JSON reply (``/model_info``, ``/weight_info``, ...);
    None when the reply is not an object or holds no integer version."""
    return parse_version(payload.get("weight_version")) if isinstance(payload, dict) else None
