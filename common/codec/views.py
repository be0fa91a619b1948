"""The zero-copy path of ``decode_group(..., views=True)``: msgspec locates every sample's ``bin``
fields without copying them (memoryviews on the payload), everything else is decoded by msgpack
under the same limits; a payload it cannot read goes to the copying decoder."""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, Raw, UnsetType

from .wire import CodecLimits, unpackb


class _SampleView(msgspec.Struct, gc=False, forbid_unknown_fields=True):
    """A wire sample as the zero-copy path reads it: ``bin`` arrays as views, the rest raw.
    Unknown keys (a newer writer, or corruption msgspec would skip unchecked) leave the group
    to the copying decoder."""

    tok: memoryview | UnsetType = UNSET
    lp: memoryview | UnsetType | None = UNSET
    lm: memoryview | UnsetType | None = UNSET
    i: Raw | UnsetType = UNSET
    resp: Raw | UnsetType = UNSET
    rlen: Raw | UnsetType = UNSET
    pl: Raw | UnsetType = UNSET
    rew: Raw | UnsetType = UNSET
    st: Raw | UnsetType = UNSET
    fr: Raw | UnsetType = UNSET
    wv: Raw | UnsetType = UNSET
    err: Raw | UnsetType = UNSET
    md: Raw | UnsetType = UNSET
    re: tuple[str, list[int], memoryview] | UnsetType = UNSET
    ix: tuple[str, list[int], memoryview] | UnsetType = UNSET
    tpi: tuple[str, list[int], memoryview] | UnsetType = UNSET
    tpo: tuple[str, list[int], memoryview] | UnsetType = UNSET
    tlp: memoryview | UnsetType = UNSET
    kl: memoryview | UnsetType = UNSET
    rm: Raw | UnsetType = UNSET
    tm: Raw | UnsetType = UNSET
    rid: Raw | UnsetType = UNSET
    spec: Raw | UnsetType = UNSET
    pc: Raw | UnsetType = UNSET
    ngt: Raw | UnsetType = UNSET
    ad: Raw | UnsetType = UNSET
    mti: Raw | UnsetType = UNSET
    wvs: Raw | UnsetType = UNSET


class _GroupView(msgspec.Struct, gc=False, forbid_unknown_fields=True):
    samples: list[_SampleView] | UnsetType = UNSET
    v: Raw | UnsetType = UNSET
    kind: Raw | UnsetType = UNSET
    index: Raw | UnsetType = UNSET
    epoch: Raw | UnsetType = UNSET
    attempt: Raw | UnsetType = UNSET
    prompt: Raw | UnsetType = UNSET
    label: Raw | UnsetType = UNSET
    metadata: Raw | UnsetType = UNSET
    producer: Raw | UnsetType = UNSET
    history: Raw | UnsetType = UNSET
    mmi: Raw | UnsetType = UNSET


_GROUP_VIEW_DECODER = msgspec.msgpack.Decoder(_GroupView)
_SAMPLE_VIEW_FIELDS = _SampleView.__struct_fields__
_GROUP_VIEW_FIELDS = tuple(f for f in _GroupView.__struct_fields__ if f != "samples")


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
        wire = _GROUP_VIEW_DECODER.decode(payload)
        obj = _fields_of(wire, _GROUP_VIEW_FIELDS, limits)
        if wire.samples is not UNSET:
            if len(wire.samples) > limits.max_container_len:
                return None
            obj["samples"] = [_fields_of(s, _SAMPLE_VIEW_FIELDS, limits) for s in wire.samples]
    except Exception:  # malformed: the copying decoder says why
        return None
    return obj
