"""The zero-copy path of ``decode_group(..., views=True)``: msgspec locates every sample's ``bin``
fields without copying them (memoryviews on the payload), everything else is decoded by msgpack
under the same limits; a payload it cannot read goes to the copying decoder."""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, Raw, UnsetType

from ..models import SAMPLE_FIELDS
from ..sample_fields import Kind
from .wire import CodecLimits, unpackb

_VIEW_TYPES: dict[Kind, Any] = {
    Kind.IDS: memoryview | UnsetType | None, Kind.FLOATS: memoryview | UnsetType | None,
    Kind.MASK: memoryview | UnsetType | None, Kind.PACKED: tuple[str, list[int], memoryview] | UnsetType,
}
"""How the zero-copy path reads a field of each kind: ``bin`` arrays as views on the payload,
any other kind raw (decoded by msgpack)."""

_SampleView = msgspec.defstruct(
    "_SampleView",
    [(f.key, _VIEW_TYPES.get(f.kind, Raw | UnsetType), UNSET) for f in SAMPLE_FIELDS]
    + [("ofl", Raw | UnsetType, UNSET)],  # where its offloaded arrays are (version 4)
    gc=False,
    forbid_unknown_fields=True,
)
"""A wire sample as the zero-copy path reads it, one attribute per wire key of
:data:`SAMPLE_FIELDS`. Unknown keys (a newer writer, or corruption msgspec would skip unchecked)
leave the group to the copying decoder."""


_GROUP_KEYS = (
    "v", "kind", "index", "epoch", "attempt", "prompt", "label", "metadata", "producer", "history", "mmi", "src",
    "adm", "gen", "objs",
)
_GroupView = msgspec.defstruct(
    "_GroupView",
    [("samples", list[_SampleView] | UnsetType, UNSET)]  # type: ignore[valid-type]
    + [(key, Raw | UnsetType, UNSET) for key in _GROUP_KEYS],
    gc=False,
    forbid_unknown_fields=True,
)


_GROUP_VIEW_DECODER = msgspec.msgpack.Decoder(_GroupView)
_SAMPLE_VIEW_FIELDS = _SampleView.__struct_fields__
_GROUP_VIEW_FIELDS = _GROUP_KEYS


def _fields_of(wire: Any, names: tuple[str, ...], limits: CodecLimits) -> dict[str, Any]:
    """The fields present in ``wire``: views as they are, raw msgpack decoded by msgpack."""
    obj: dict[str, Any] = {}
    for name in names:
        value = getattr(wire, name)
        if value is UNSET:
            continue
        obj[name] = unpackb(value, limits) if isinstance(value, Raw) else value
    return obj


def unpack_group_views(payload: bytes, limits: CodecLimits) -> dict[str, Any] | None:
    """The group map of ``payload`` with its samples' arrays as views on it; None when this path
    cannot read it (the copying decoder then reports exactly why)."""
    try:
        wire: Any = _GROUP_VIEW_DECODER.decode(payload)
        obj = _fields_of(wire, _GROUP_VIEW_FIELDS, limits)
        if wire.samples is not UNSET:
            if len(wire.samples) > limits.max_container_len:
                return None
            obj["samples"] = [_fields_of(s, _SAMPLE_VIEW_FIELDS, limits) for s in wire.samples]
    except Exception:  # malformed: the copying decoder says why
        return None
    return obj
