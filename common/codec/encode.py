"""Groups and prompts to msgpack payloads: token arrays as packed little-endian ``bin`` fields, the
version-3 keys written only when their field is set (an entry without any is version 2)."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from operator import attrgetter
from typing import Any

import msgpack

from ..arrays import Packed
from ..models import SAMPLE_FIELDS, Adapter, Group, Prompt, Sample
from ..payload.refs import Buffer, GroupPayload, ObjectRef, Offloaded, checksum, object_keys
from ..sample_fields import BIN_CODES, SET_WHEN_TRUE, Kind, SampleField
from .wire import OFFLOAD_VERSION, V3_SAMPLE_KEYS, le_bytes

_V3_KEYS = frozenset(V3_SAMPLE_KEYS)


def _packed_to_wire(packed: Packed) -> list[Any]:
    return [packed.typecode, list(packed.shape), le_bytes(packed.data)]


def _mm_train_to_wire(inputs: Mapping[str, Any]) -> list[Any]:
    """Processed media: ``[plain values, {name: packed triple}]`` (tensors travel packed)."""
    plain = {k: v for k, v in inputs.items() if not isinstance(v, Packed)}
    packed = {k: _packed_to_wire(v) for k, v in inputs.items() if isinstance(v, Packed)}
    return [plain, packed]


def _spans_to_wire(spans: list[tuple[int, int, int]]) -> list[int]:
    return [x for span in spans for x in span]  # flat: start, end, version, ...


def _adapter_to_wire(adapter: Adapter) -> list[Any]:
    return [adapter.name, adapter.slot]


def _same(value: object) -> object:
    return value


_TO_WIRE: dict[Kind, Callable[[Any], Any]] = {
    Kind.IDS: le_bytes, Kind.FLOATS: le_bytes, Kind.MASK: le_bytes, Kind.PACKED: _packed_to_wire,
    Kind.STATUS: attrgetter("value"), Kind.SECONDS: float, Kind.ADAPTER: _adapter_to_wire,
    Kind.MEDIA: _mm_train_to_wire, Kind.SPANS: _spans_to_wire,
}
"""A set value of each kind as it travels (kinds not listed travel as they are)."""
for _kind in Kind:
    _TO_WIRE.setdefault(_kind, _same)


def _write_to_wire() -> Callable[[Sample], dict[str, Any]]:
    """``_sample_to_wire``, written out from :data:`SAMPLE_FIELDS` once at import (as
    :mod:`dataclasses` writes ``__init__``): a dict display of the fields older than version 3
    (None where unset), then, only when some optional field is set (one tuple comparison for the
    samples that carry none), one test per optional field, in wire order. As fast as the
    hand-written function it replaced, and no field is spelled twice."""
    env: dict[str, Any] = {}
    always, optional = [], []
    for i, f in enumerate(SAMPLE_FIELDS):
        to_wire = _TO_WIRE[f.kind]
        value = f"sample.{f.name}"
        if f.optional:
            env[f"_w{i}"] = to_wire
            test = value if f.kind in SET_WHEN_TRUE else f"{value} is not None"  # SampleField.is_set
            optional.append(f"        if {test}:\n            wire[{f.key!r}] = _w{i}({value})")
        elif to_wire is _same:
            always.append(f"        {f.key!r}: {value},")
        else:
            env[f"_w{i}"] = to_wire
            converted = f"_w{i}({value})" if f.required else f"None if {value} is None else _w{i}({value})"
            always.append(f"        {f.key!r}: {converted},")
    fields = [f for f in SAMPLE_FIELDS if f.optional]
    env["_optional"] = attrgetter(*(f.name for f in fields))
    env["_unset"] = tuple(f.unset for f in fields)
    source = "\n".join([
        "def _sample_to_wire(sample):", "    wire = {", *always, "    }",
        "    if _optional(sample) != _unset:  # rare: most samples carry none (the entry stays version 2)",
        *optional, "    return wire",
    ])
    exec(compile(source, "<rollstream.common.codec.encode: SAMPLE_FIELDS>", "exec"), env)
    function: Callable[[Sample], dict[str, Any]] = env["_sample_to_wire"]
    function.__doc__ = "The wire map of ``sample`` (written out from SAMPLE_FIELDS)."
    return function


_sample_to_wire = _write_to_wire()


def _version_of(samples: list[dict[str, Any]], multimodal: Any) -> int:
    """3 when a version-3 field is used, else 2 (readable by the previous build)."""
    if multimodal is not None or any(not _V3_KEYS.isdisjoint(s) for s in samples):  # a C loop per sample
        return 3
    return 2


def _packb(obj: Any) -> bytes:
    try:
        packed: bytes = msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"cannot encode as msgpack (labels and metadata must be plain data): {exc}") from exc
    return packed


def encode_group(group: Group) -> bytes:
    return _packb(_group_to_wire(group, [_sample_to_wire(s) for s in group.samples]))


OFFLOADABLE = tuple(f for f in SAMPLE_FIELDS if f.kind in (Kind.PACKED, Kind.FLOATS, Kind.IDS, Kind.MASK))
"""The sample fields whose array may leave the entry for the payload store: every per-token
array, the token ids, log-probs and loss mask as well as the version-3 ones (routing, indexer
and top-p replay, teacher log-probs, reverse KL). The entry keeps ``rlen``, ``pl`` and the control
fields, so every length relation is checked from the entry alone (an offloaded array's length is
in its ``ofl`` spec); the staleness rule reads versions and spans only."""
TEXT = next(f for f in SAMPLE_FIELDS if f.name == "response")
"""The response text: it leaves the entry with its sample's arrays (UTF-8 bytes, typecode ``B``,
its ``ofl`` spec ``[offset, bytes, "B", [bytes], characters]``); it counts toward the bar as those bytes."""
TEXT_KEY = TEXT.key
_ALIGN = 8


@dataclass(slots=True)
class StoreObject:
    """An object to put before the group is published: its ref (what the entry records) and its
    bytes as parts (views on the samples' arrays: no copy until the store writes them)."""

    ref: ObjectRef
    parts: list[Buffer]


def encode_group_offloaded(
    group: Group, min_bytes: int, new_key: Callable[[], str]
) -> tuple[bytes, list[StoreObject]]:
    """The group's payload with the :data:`OFFLOADABLE` arrays left out, and the objects they go
    to. The threshold decides per sample: once a sample's offloadable arrays and its response
    text's UTF-8 bytes together reach ``min_bytes``, all of them go to its object (the text last;
    one per such sample, the arrays back to back,
    each at an offset aligned to 8 bytes: a small one costs no extra round trip there); a sample
    under the bar keeps them all. A group's objects are named from one ``new_key()``
    (:func:`~..payload.refs.object_keys`). A sample keeps where each
    went (``ofl``: ``[object, {key: [offset, bytes, typecode, shape]}]``, the text's with its
    characters fifth), the group the objects'
    refs (``objs``), and the entry is version 4 (an older build refuses it instead of reading a
    sample without its arrays). No array large enough: the bytes :func:`encode_group` writes."""
    samples = [_sample_to_wire(s) for s in group.samples]
    found: list[tuple[int, list[Buffer]]] = []
    for wire in samples:
        moved: dict[str, list[Any]] = {}
        parts: list[Buffer] = []
        offset = 0
        present = []
        for f in OFFLOADABLE:
            value = wire.get(f.key)
            if value is None:
                continue
            if f.kind is Kind.PACKED:
                typecode, shape, raw = value
            else:
                typecode, raw = BIN_CODES[f.kind], value
                shape = [len(raw) // array(typecode).itemsize]
            present.append((f, typecode, shape, raw))
        arrays = sum(len(raw) for *_, raw in present)
        text = wire.get(TEXT_KEY)
        text = text if isinstance(text, str) else ""
        if arrays + 4 * len(text) < min_bytes:  # under the bar even at 4 bytes of UTF-8 a character
            continue  # the sample's arrays and text together stay under the bar: all stay in the entry
        raw_text = text.encode()
        if arrays + len(raw_text) < min_bytes:
            continue
        for f, typecode, shape, raw in present:
            size = len(raw)
            if pad := -offset % _ALIGN:
                parts.append(bytes(pad))
                offset += pad
            parts.append(raw)
            moved[f.key] = [offset, size, typecode, list(shape)]
            offset += size
            del wire[f.key]
        if raw_text:  # its UTF-8 bytes last, its length in characters in the spec (len() before the fetch)
            parts.append(raw_text)
            moved[TEXT_KEY] = [offset, len(raw_text), "B", [len(raw_text)], len(text)]
            offset += len(raw_text)
            del wire[TEXT_KEY]
        if moved:
            wire["ofl"] = [len(found), moved]
            found.append((offset, parts))
    objects: list[StoreObject] = []
    if found:
        keys = object_keys(new_key(), len(found))
        objects = [
            StoreObject(ObjectRef(key, size, checksum(parts)), parts)
            for key, (size, parts) in zip(keys, found, strict=True)
        ]
    obj = _group_to_wire(group, samples)
    if objects:
        obj["v"] = OFFLOAD_VERSION
        obj["objs"] = [o.ref.to_wire() for o in objects]
    return _packb(obj), objects


def _group_to_wire(group: Group, samples: list[dict[str, Any]]) -> dict[str, Any]:
    obj = {
            "v": _version_of(samples, group.multimodal_inputs),
            "kind": "group",
            "index": group.index,
            "epoch": group.epoch,
            "attempt": group.attempt,
            "prompt": group.prompt,
            "label": group.label,
            "metadata": group.metadata,
            "producer": group.producer,
            "history": group.history,
            "samples": samples,
        }
    if group.multimodal_inputs is not None:
        obj["mmi"] = group.multimodal_inputs
    if group.source:
        obj["src"] = group.source
    if group.admitted_ms:
        obj["adm"] = group.admitted_ms
    if group.generated_ms:
        obj["gen"] = group.generated_ms
    return obj


def encode_prompt(prompt: Prompt) -> bytes:
    """The prompt's payload. Partial samples whose arrays are in the payload store
    (``prompt.payload``: a group recycled with partial rollout) refer to the group's objects as the
    group's entry did (``ofl`` per sample, ``objs``; version 4: an older build refuses the prompt
    rather than continue samples without their arrays); their values are never read here."""
    payload = prompt.payload if prompt.partial is not None else None
    if prompt.partial is None:
        partial = None
    elif payload is None:
        partial = [_sample_to_wire(s) for s in prompt.partial]
    else:
        partial = _partial_with_refs(prompt.partial, payload)
    obj = {
            "v": _version_of(partial or [], prompt.multimodal_inputs),
            "kind": "prompt",
            "index": prompt.index,
            "epoch": prompt.epoch,
            "attempt": prompt.attempt,
            "prompt": prompt.prompt,
            "label": prompt.label,
            "metadata": prompt.metadata,
            "input_ids": None if prompt.input_ids is None else le_bytes(prompt.input_ids),
            "partial": partial,
            "history": prompt.history,
        }
    if prompt.multimodal_inputs is not None:
        obj["mmi"] = prompt.multimodal_inputs
    if prompt.source:
        obj["src"] = prompt.source
    if prompt.admitted_ms:
        obj["adm"] = prompt.admitted_ms
    if payload is not None:
        obj["v"] = OFFLOAD_VERSION
        obj["objs"] = [ref.to_wire() for ref in payload.objects]
    return _packb(obj)


_FIELDS = {f.name: f for f in SAMPLE_FIELDS}


def _blank(f: SampleField) -> Any:
    """What stands in for an offloaded field while the rest of its sample is written."""
    if f.optional:
        return None
    return "" if f.kind is Kind.TEXT else array(BIN_CODES[f.kind])


def _partial_with_refs(samples: list[Sample], payload: GroupPayload) -> list[dict[str, Any]]:
    """The wire maps of ``samples`` with the arrays ``payload`` lists referred to (``ofl``, exactly
    as :func:`encode_group_offloaded` wrote them), not carried: whether fetched or not, their
    values are left out (a placeholder stands in while the rest of the sample is written)."""
    moved: dict[int, list[Offloaded]] = {}
    for array_ in payload.arrays:
        moved.setdefault(array_.sample, []).append(array_)
    wires = []
    for position, sample in enumerate(samples):
        away = moved.get(position)
        if not away:
            wires.append(_sample_to_wire(sample))
            continue
        blank: dict[str, Any] = {a.name: _blank(_FIELDS[a.name]) for a in away}
        wire = _sample_to_wire(replace(sample, **blank))
        for a in away:
            wire.pop(_FIELDS[a.name].key, None)
        wire["ofl"] = [away[0].obj, {
            _FIELDS[a.name].key: a.spec() for a in away
        }]
        wires.append(wire)
    return wires
