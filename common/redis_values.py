"""Parsing values read back from Redis, defensively: the protocol layer's parsers.

Anyone with write access to Redis can put anything in a namespace's hashes and streams
(``HSET …:state weight_version abc``, a heartbeat ``[1,2]``, a field name that is not UTF-8).
Every value rollstream reads back goes through these functions, which never raise on such
input: a missing or damaged value reads as a default, and :func:`damaged_fields` names what is
damaged so that ``rollstream inspect`` reports it as a problem.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, TypeAlias

RawFields: TypeAlias = "Mapping[bytes, object] | Mapping[str, object] | Mapping[bytes | str, object]"
"""A hash or stream entry as read (bytes from a plain client, str from a decoding one, or mixed)."""
RawHash: TypeAlias = "Mapping[bytes, bytes] | Mapping[str, str] | Mapping[bytes | str, bytes | str]"
"""A hash of text values as read (bytes or str)."""

_INT_RE = re.compile(r"-?\d{1,19}")


def text(raw: object) -> str:
    """A raw Redis value (bytes, str, number, None) as text; invalid UTF-8 is replaced, never raised."""
    if raw is None:
        return ""
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes | bytearray) else str(raw)


def utf8(raw: bytes | str) -> str | None:
    """``raw`` decoded as UTF-8, or None when it is not valid UTF-8."""
    if isinstance(raw, str):
        return raw
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return None


def parse_int(raw: object) -> int | None:
    """The integer a raw Redis value holds; None when it is missing, empty or not an integer."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return raw
    value = text(raw).strip()
    return int(value) if _INT_RE.fullmatch(value) else None


def int_or(raw: object, default: int = 0) -> int:
    """The integer a raw Redis value holds, else ``default`` (missing or damaged)."""
    value = parse_int(raw)
    return default if value is None else value


def damaged_fields(
    key: str, raw: Mapping[Any, Any], integer_fields: Iterable[str], integer_prefixes: Iterable[str] = ()
) -> list[str]:
    """One line per damaged field of the hash ``key``: a field name that is not UTF-8, or a field
    that must hold an integer and does not (missing fields are not damaged)."""
    integers = set(integer_fields)
    prefixes = tuple(integer_prefixes)
    out = []
    for name_raw, value in raw.items():
        name = utf8(name_raw)
        if name is None:
            out.append(f"{key}: field name {name_raw!r} is not UTF-8")
        elif (name in integers or name.startswith(prefixes)) and parse_int(value) is None:
            out.append(f"{key} field {name!r} = {text(value)[:60]!r} is not an integer")
    return out
