"""Stream entries: a few plain fields beside ``data`` so that ``redis-cli XRANGE`` is readable
without msgpack."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import DecodeError
from ..models import Group, Prompt
from ..payload.refs import group_member
from ..redis_values import RawFields, utf8
from .decode import decode_group, decode_prompt
from .encode import StoreObject, encode_group, encode_group_offloaded, encode_prompt
from .wire import DEFAULT_LIMITS, CodecLimits

Fields = dict[str, str | bytes | int | float]


def prompt_fields(prompt: Prompt) -> Fields:
    """Fields of a prompt-stream entry: plain ``index``/``epoch``/``attempt`` (and ``source``
    for a named source) plus ``data``. A prompt whose partial samples' arrays are in the payload
    store (``prompt.payload``) also names their object set, ``refs`` (one ledger member, as its
    group's entry did: the fate scripts keep or release it, in Lua), and ``store_bytes``."""
    fields: Fields = {"index": prompt.index, "epoch": prompt.epoch, "attempt": prompt.attempt}
    if prompt.source:
        fields["source"] = prompt.source
    payload = prompt.payload if prompt.partial is not None else None
    if payload is not None:
        fields["objects"] = len(payload.objects)
        fields["store_bytes"] = payload.nbytes
        fields["refs"] = group_member([ref.key for ref in payload.objects])
    fields["data"] = encode_prompt(prompt)
    return fields


def group_fields(group: Group, data: bytes | None = None) -> Fields:
    """Fields of a group-stream entry; everything but ``data`` is readable in redis-cli
    (``bytes`` is the size of ``data``; ``data``: the group's payload when already encoded)."""
    min_version = group.min_version
    reward = group.reward_mean
    if data is None:
        data = encode_group(group)
    return {
        "index": group.index,
        "epoch": group.epoch,
        "attempt": group.attempt,
        "status": group.status.value,
        "min_version": "" if min_version is None else min_version,
        "producer": group.producer,
        "reward_mean": "nan" if math.isnan(reward) else f"{reward:.4f}",
        "n": len(group.samples),
        "bytes": len(data),
        **({"source": group.source} if group.source else {}),
        "data": data,
    }


def group_fields_offloaded(
    group: Group, min_bytes: int, new_key: Callable[[], str]
) -> tuple[Fields, list[StoreObject]]:
    """:func:`group_fields` with the arrays of at least ``min_bytes`` left out
    (:func:`~.encode.encode_group_offloaded`), and the objects to put before publishing. Beside
    ``bytes`` (the entry's own data), plain fields say where the rest is: ``objects`` (how many),
    ``store_bytes`` (their bytes) and ``refs`` (the group's object set as one ledger member,
    :func:`~..payload.refs.group_member`: what the fate scripts free, in Lua, without msgpack).
    No array large enough: exactly :func:`group_fields`."""
    data, objects = encode_group_offloaded(group, min_bytes, new_key)
    fields = group_fields(group, data)
    if objects:
        fields = {k: v for k, v in fields.items() if k != "data"}
        fields.update({
            "objects": len(objects), "store_bytes": sum(o.ref.size for o in objects),
            "refs": group_member([o.ref.key for o in objects]), "data": data,
        })
    return fields, objects


def group_too_large(fields: Mapping[str, Any], limit: int) -> str | None:
    """The dead-letter reason of a group entry whose data exceeds ``limit`` bytes, else None."""
    size = len(fields.get("data", b""))
    if size <= limit:
        return None
    return f"group_too_large: {size} bytes of group data exceeds max_group_bytes {limit} (rollstream init)"


def entry_data(fields: RawFields) -> bytes:
    """The ``data`` field of a raw stream entry, or DecodeError when it is missing (or a field name
    is not UTF-8: such an entry was not written by rollstream)."""
    data: object = None
    for name, value in fields.items():
        if isinstance(name, bytes) and utf8(name) is None:
            raise DecodeError("bad_field", f"field name {name[:40]!r} is not UTF-8")
        if name == b"data" or (name == "data" and data is None):
            data = value
    if data is None:
        raise DecodeError("missing_field", "entry has no data field")
    if isinstance(data, str):
        data = data.encode()
    if not isinstance(data, bytes):
        raise DecodeError("bad_field", "entry data is not bytes")
    return data


def decode_group_entry(
    fields: RawFields, limits: CodecLimits = DEFAULT_LIMITS, *, views: bool = False
) -> Group:
    return decode_group(entry_data(fields), limits, views=views)


def decode_prompt_entry(fields: RawFields, limits: CodecLimits = DEFAULT_LIMITS) -> Prompt:
    return decode_prompt(entry_data(fields), limits)
