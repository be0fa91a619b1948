"""Payloads back to groups and prompts, every field checked: any malformed input becomes
:class:`~..errors.DecodeError`, never anything else."""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Mapping
from typing import Any

from ..arrays import PACKED_CODES, Packed, Unfetched, UnfetchedText
from ..checked import is_int, is_number
from ..errors import DecodeError
from ..models import SAMPLE_FIELDS, Adapter, Group, Prompt, Sample, Status
from ..payload.refs import GroupPayload, ObjectRef, Offloaded
from ..sample_fields import BIN_CODES, SET_WHEN_TRUE, Kind, SampleField
from .encode import OFFLOADABLE, TEXT
from .wire import (
    DEFAULT_LIMITS,
    LITTLE,
    OFFLOAD_VERSION,
    READABLE_VERSIONS,
    SCHEMA_VERSION,
    CodecLimits,
    check_payload,
    check_version,
    from_le_bytes,
    unpack,
)
from .zero_copy import unpack_group_views


def _unpack_array(typecode: str, raw: object, what: str, limit: int) -> Any:
    """The packed array in ``raw``: a copy (``array``) from ``bytes``, a cast view from the
    ``memoryview`` of the zero-copy path."""
    if not isinstance(raw, bytes | memoryview):
        raise DecodeError("bad_field", f"{what} must be bin, got {type(raw).__name__}")
    values = array(typecode)
    if len(raw) % values.itemsize:
        raise DecodeError("bad_field", f"{what}: {len(raw)} bytes is not a multiple of {values.itemsize}")
    if len(raw) // values.itemsize > limit:
        raise DecodeError("too_large", f"{what}: more than {limit} items")
    if isinstance(raw, memoryview):  # only on little-endian hosts (see decode_group)
        return raw.cast(typecode)  # type: ignore[call-overload]
    return from_le_bytes(typecode, raw)


def _get(obj: Mapping[str, Any], key: str, kinds: type | tuple[type, ...], what: str) -> Any:
    if key not in obj:
        raise DecodeError("missing_field", f"{what}.{key}")
    value = obj[key]
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _as_tuple(kinds)):
        raise DecodeError("bad_field", f"{what}.{key} has type {type(value).__name__}")
    return value


def _as_tuple(kinds: type | tuple[type, ...]) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _prompt_content(value: object, what: str) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return value
    raise DecodeError("bad_field", f"{what}.prompt must be a string or a list of messages")


def _reward(value: object, what: str) -> Any:
    if value is None or is_number(value):
        return value
    if isinstance(value, dict) and all(
        is_number(v) for v in value.values()
    ):
        return value
    raise DecodeError("bad_field", f"{what}.rew must be a number, a map of numbers or nil")


def _int(value: object, what: str, f: SampleField, limits: CodecLimits) -> int:
    if not is_int(value):
        raise DecodeError("bad_field", f"{what}.{f.key} must be an int")
    return value


def _text(value: object, what: str, f: SampleField, limits: CodecLimits) -> str:
    if not isinstance(value, str):
        raise DecodeError("bad_field", f"{what}.{f.key} must be a string")
    return value


_STATUSES = {status.value: status for status in Status}


def _status(value: object, what: str, f: SampleField, limits: CodecLimits) -> Status:
    status = _STATUSES.get(_text(value, what, f, limits))
    if status is None:
        raise DecodeError("bad_field", f"{what}.{f.key} is not a status")
    return status


def _versions(value: object, what: str, f: SampleField, limits: CodecLimits) -> list[int]:
    if not isinstance(value, list) or not all(is_int(v) for v in value):
        raise DecodeError("bad_field", f"{what}.{f.key} must be a list of ints")
    return value


def _bin(value: object, what: str, f: SampleField, limits: CodecLimits) -> Any:
    return _unpack_array(BIN_CODES[f.kind], value, f"{what}.{f.key}", limits.max_tokens)


def _packed(value: object, what: str, f: SampleField, limits: CodecLimits) -> Packed:
    return _packed_from_wire(value, f"{what}.{f.key}", limits, f.ndim)


def _map(value: object, what: str, f: SampleField, limits: CodecLimits) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DecodeError("bad_field", f"{what}.{f.key} must be a map")
    return value


def _counters(value: object, what: str, f: SampleField, limits: CodecLimits) -> dict[str, Any]:
    return _plain_map(value, f"{what}.{f.key}", int)


def _flag(value: object, what: str, f: SampleField, limits: CodecLimits) -> bool:
    if not isinstance(value, bool):
        raise DecodeError("bad_field", f"{what}.{f.key} must be a bool")
    return value


def _seconds(value: object, what: str, f: SampleField, limits: CodecLimits) -> float:
    if not is_number(value) or not math.isfinite(value):
        raise DecodeError("bad_field", f"{what}.{f.key} must be a finite number")
    return float(value)


def _adapter(value: object, what: str, f: SampleField, limits: CodecLimits) -> Adapter:
    if (
        not isinstance(value, list | tuple) or len(value) != 2 or not isinstance(value[0], str)
        or not is_int(value[1])
    ):
        raise DecodeError("bad_field", f"{what}.{f.key} must be [name, slot]")
    return Adapter(value[0], value[1])


def _media(value: object, what: str, f: SampleField, limits: CodecLimits) -> dict[str, Any]:
    name = f"{what}.{f.key}"
    if not isinstance(value, list | tuple) or len(value) != 2 or not isinstance(value[1], dict):
        raise DecodeError("bad_field", f"{name} must be [plain map, packed map]")
    inputs = dict(_plain_map(value[0], name))
    for key, packed in value[1].items():
        if not isinstance(packed, list | tuple) or len(packed) != 3 or not isinstance(packed[1], list | tuple):
            raise DecodeError("bad_field", f"{name}.{key} must be [typecode, shape, bin]")
        inputs[key] = _packed_from_wire(packed, f"{name}.{key}", limits, len(packed[1]))
    return inputs


def _spans(value: object, what: str, f: SampleField, limits: CodecLimits) -> list[tuple[int, int, int]]:
    """Flat ``start, end, version`` triples (their order and range are checked with the sample's)."""
    if not isinstance(value, list) or len(value) % 3 or not all(type(x) is int for x in value):
        raise DecodeError("bad_field", f"{what}.{f.key} must be a flat list of int triples")
    return [(value[i], value[i + 1], value[i + 2]) for i in range(0, len(value), 3)]


def _reward_of(value: object, what: str, f: SampleField, limits: CodecLimits) -> Any:
    return _reward(value, what)


def _optional_text(value: object, what: str, f: SampleField, limits: CodecLimits) -> str | None:
    if value is not None and not isinstance(value, str):
        raise DecodeError("bad_field", f"{what}.{f.key} must be a string or nil")
    return value


FromWire = Callable[[Any, str, SampleField, CodecLimits], Any]
_FROM_WIRE: dict[Kind, FromWire] = {
    Kind.INT: _int, Kind.TEXT: _text, Kind.OPT_TEXT: _optional_text, Kind.REWARD: _reward_of,
    Kind.STATUS: _status, Kind.VERSIONS: _versions, Kind.IDS: _bin, Kind.FLOATS: _bin, Kind.MASK: _bin,
    Kind.PACKED: _packed, Kind.MAP: _map, Kind.COUNTERS: _counters, Kind.FLAG: _flag, Kind.GROUP_ID: _int,
    Kind.SECONDS: _seconds, Kind.ADAPTER: _adapter, Kind.MEDIA: _media, Kind.SPANS: _spans,
}
"""How a field of each kind is read and checked on its own (lengths are checked with the sample)."""
_BY_NAME = {f.name: f for f in SAMPLE_FIELDS}
_MEDIA = tuple(f.name for f in SAMPLE_FIELDS if f.kind is Kind.MEDIA)
_SPANS = tuple(f for f in SAMPLE_FIELDS if f.kind is Kind.SPANS)


def _missing(what: str, key: str) -> DecodeError:
    return DecodeError("missing_field", f"{what}.{key}")


_PLAIN_TYPES = {Kind.INT: int, Kind.TEXT: str, Kind.OPT_TEXT: str, Kind.MAP: dict, Kind.GROUP_ID: int}
"""Kinds whose value of exactly this type (what msgpack gives) is valid as it is."""


def _write_reader(version: int) -> Callable[[dict[str, Any], str, CodecLimits], dict[str, Any]]:
    """The values of the fields a version-``version`` sample has, read and checked each on its
    own, written out from :data:`SAMPLE_FIELDS` once at import (as ``encode._sample_to_wire``):
    a required key missing is ``missing_field``; nil is None for the fields before version 3 that
    may be unset; an absent optional field keeps its default."""
    env: dict[str, Any] = {"_missing": _missing}
    lines = [f"def _read_v{version}(obj, what, limits):", "    values = {}"]
    for i, f in enumerate(SAMPLE_FIELDS):
        if f.since > version:
            continue
        env[f"_r{i}"], env[f"_f{i}"] = _FROM_WIRE[f.kind], f
        read = f"_r{i}(raw, what, _f{i}, limits)"
        if f.kind in _PLAIN_TYPES:  # the common case inline; anything else goes to the reader
            env[f"_t{i}"] = _PLAIN_TYPES[f.kind]
            read = f"raw if type(raw) is _t{i} else {read}"
        if f.required:
            lines += [f"    raw = obj.get({f.key!r}, _missing)", "    if raw is _missing:",
                      f"        raise _missing(what, {f.key!r})", f"    values[{f.name!r}] = {read}"]
        elif f.since < 3:
            lines += [f"    raw = obj.get({f.key!r}, _missing)", "    if raw is not _missing:",
                      f"        values[{f.name!r}] = None if raw is None else {read}"]
        else:
            lines += [f"    if {f.key!r} in obj:", f"        raw = obj[{f.key!r}]",
                      f"        values[{f.name!r}] = {read}"]
    lines.append("    return values")
    source = "\n".join(lines)
    exec(compile(source, f"<rollstream.common.codec.decode: SAMPLE_FIELDS v{version}>", "exec"), env)
    reader: Callable[[dict[str, Any], str, CodecLimits], dict[str, Any]] = env[f"_read_v{version}"]
    return reader


_READERS = {version: _write_reader(version) for version in READABLE_VERSIONS}


def _relations(version: int, named: bool = False) -> tuple[tuple[Any, ...], ...]:
    fields = [f for f in SAMPLE_FIELDS if f.since <= version]

    def key(f: SampleField) -> str:
        return f.name if named else f.key

    return (
        tuple((f.name, key(f)) for f in fields if f.length == "response"),
        tuple((f.name, key(f), f.length == "rows_or_media") for f in fields if f.length in ("rows", "rows_or_media")),
        tuple((f.name, str(f.pair), key(f)) for f in fields if f.length == "offsets"),
        tuple((f.name, str(f.pair), key(f), key(_BY_NAME[str(f.pair)])) for f in fields if f.pair is not None),
    )


_RELATIONS = {version: _relations(version) for version in READABLE_VERSIONS}
"""Per schema version, the fields whose length another implies (``response_length`` entries, a row
per token, top-p offsets) and the fields that travel in pairs."""
_NAMED_RELATIONS = _relations(SCHEMA_VERSION, named=True)
"""The same for a :class:`Sample` object, its fields named by attribute (:func:`check_lengths`)."""
_RELATED = frozenset(
    f.name for f in SAMPLE_FIELDS if f.pair is not None or f.length in ("rows", "rows_or_media", "offsets")
)


_OFFLOADABLE = {f.key: f for f in (*OFFLOADABLE, TEXT)}
_REQUIRED_OFFLOADABLE = {f.key: "" if f is TEXT else b"" for f in (*OFFLOADABLE, TEXT) if f.required}
"""Offloadable fields an entry must otherwise hold (the token ids, the response text): absent when
``ofl`` names them (read as this blank, replaced by a placeholder below)."""


def _offloaded(
    obj: dict[str, Any], what: str, limits: CodecLimits, position: int, objects: tuple[ObjectRef, ...]
) -> list[Offloaded]:
    """The arrays of a version-4 sample that left the entry (its ``ofl``), each checked against the
    object it names: a known field not also in the entry, a typecode and shape of that field, and
    bytes that fit inside the object."""
    raw = obj["ofl"]
    if (
        not isinstance(raw, list) or len(raw) != 2 or type(raw[0]) is not int or not isinstance(raw[1], dict)
        or not 0 <= raw[0] < len(objects)
    ):
        raise DecodeError("bad_field", f"{what}.ofl must be [object index, map] naming one of {len(objects)} objects")
    ref = objects[raw[0]]
    found = []
    for key, spec in raw[1].items():
        f = _OFFLOADABLE.get(key)
        name = f"{what}.ofl.{key}"
        if f is None or key in obj:
            raise DecodeError("bad_field", f"{name}: not an offloadable field, or also in the entry")
        if f is TEXT:
            found.append(_offloaded_text(spec, name, limits, ref, position, raw[0]))
            continue
        if not isinstance(spec, list) or len(spec) != 4:
            raise DecodeError("bad_field", f"{name} must be [offset, bytes, typecode, shape]")
        offset, nbytes, code, shape = spec
        ndim = f.ndim if f.kind is Kind.PACKED else 1
        codes = PACKED_CODES if f.kind is Kind.PACKED else (BIN_CODES[f.kind],)
        if (
            type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0
            or offset + nbytes > ref.size or code not in codes or not isinstance(shape, list) or len(shape) != ndim
            or not all(type(d) is int and d >= 0 for d in shape)
        ):
            raise DecodeError("bad_field", f"{name}: {spec!r} does not describe an array inside {ref.size} bytes")
        items = math.prod(shape)
        if items > (limits.max_array_items if f.kind is Kind.PACKED else limits.max_tokens):
            raise DecodeError("too_large", f"{name}: {items} items")
        if items * array(code).itemsize != nbytes:
            raise DecodeError("bad_field", f"{name}: {nbytes} bytes for {items} items of {code!r}")
        found.append(Offloaded(position, f.name, raw[0], offset, nbytes, code, tuple(shape), f.kind is Kind.PACKED))
    if not found:
        raise DecodeError("bad_field", f"{what}.ofl names no array")
    return found


def _offloaded_text(
    spec: object, name: str, limits: CodecLimits, ref: ObjectRef, position: int, obj: int
) -> Offloaded:
    """The response text's ``ofl`` spec, ``[offset, bytes, "B", [bytes], characters]``: inside its
    object, within ``max_string_bytes``, and as many characters as UTF-8 allows for those bytes
    (1 to 4 a character; the decoded text is checked against it once fetched)."""
    if not isinstance(spec, list) or len(spec) != 5:
        raise DecodeError("bad_field", f"{name} must be [offset, bytes, 'B', [bytes], characters]")
    offset, nbytes, code, shape, chars = spec
    if (
        not all(type(v) is int for v in (offset, nbytes, chars)) or offset < 0 or nbytes < 0
        or offset + nbytes > ref.size or code != "B" or shape != [nbytes] or not chars <= nbytes <= 4 * chars
    ):
        raise DecodeError("bad_field", f"{name}: {spec!r} does not describe UTF-8 text inside {ref.size} bytes")
    if nbytes > limits.max_string_bytes:
        raise DecodeError("too_large", f"{name}: {nbytes} bytes of text exceeds {limits.max_string_bytes}")
    return Offloaded(position, TEXT.name, obj, offset, nbytes, "B", (nbytes,), False, chars)


def _sample_from_wire(
    obj: object, what: str, limits: CodecLimits, version: int, position: int = 0,
    objects: tuple[ObjectRef, ...] = (), away: list[Offloaded] | None = None,
) -> Sample:
    if not isinstance(obj, dict):
        raise DecodeError("bad_field", f"{what} must be a map")
    moved: list[Offloaded] = []
    if "ofl" in obj:
        if away is None or version < OFFLOAD_VERSION:
            raise DecodeError("bad_field", f"{what}.ofl outside a version-{OFFLOAD_VERSION} group")
        moved = _offloaded(obj, what, limits, position, objects)
        if not _REQUIRED_OFFLOADABLE.keys().isdisjoint(names := _moved_keys(obj)):  # ids or text in the object
            obj = {**obj, **{k: v for k, v in _REQUIRED_OFFLOADABLE.items() if k in names}}  # replaced below
    values = _READERS[version](obj, what, limits)
    for offloaded in moved:  # its length, shape and typecode, until fetched (GroupPayload.attach)
        key = objects[offloaded.obj].key
        values[offloaded.name] = Unfetched(
            offloaded.name, key, offloaded.typecode, offloaded.shape
        ) if offloaded.chars is None else UnfetchedText(offloaded.name, key, offloaded.nbytes, offloaded.chars)
    tokens, rlen = values["tokens"], values["response_length"]
    if not 0 <= rlen <= len(tokens):
        raise DecodeError("bad_field", f"{what}.rlen {rlen} outside 0..{len(tokens)}")
    if version == 1:  # flags travelled in the metadata, and the prompt length was implied
        metadata = values["metadata"]
        values["prompt_length"] = len(tokens) - rlen
        if metadata.get("prompt_ids") == "unknown":
            metadata = {k: v for k, v in metadata.items() if k != "prompt_ids"}
        error = metadata.get("error")
        if isinstance(error, str):
            metadata = {k: v for k, v in metadata.items() if k != "error"}
        else:
            error = None
        values["metadata"], values["error"] = metadata, error
        if values.get("loss_mask") is None:
            values["loss_mask"] = array("B", b"\x01" * rlen)
    elif values["prompt_length"] + rlen != len(tokens):
        raise DecodeError("bad_field", f"{what}: pl {values['prompt_length']} + rlen {rlen} != {len(tokens)} tokens")
    _check_relations(values, what, _RELATIONS[version])
    if moved:
        away.extend(moved)  # type: ignore[union-attr]  # moved is only set when away is a list
    return Sample(**values)


def _moved_keys(obj: Mapping[str, Any]) -> set[str]:
    """The wire keys a sample's ``ofl`` (already checked) names."""
    return set(obj["ofl"][1])


def check_lengths(sample: Sample, what: str = "sample") -> None:
    """DecodeError when a field of ``sample`` has a length another implies it cannot (a loss mask,
    teacher log-probs, ... of ``response_length`` entries, a replay row per token, the top-p
    offsets, the pairs, the spans): what the decoder would refuse, checked before publish so one
    sample fails rather than its whole group on the trainer's side. Fields are named by attribute."""
    values = {}
    for name, optional, set_when_true in _LENGTH_FIELDS:
        value = getattr(sample, name)
        if not optional or (bool(value) if set_when_true else value is not None):  # SampleField.is_set
            values[name] = value
    _check_relations(values, what, _NAMED_RELATIONS)


_LENGTH_FIELDS = tuple(
    (f.name, f.optional, f.kind in SET_WHEN_TRUE) for f in SAMPLE_FIELDS
    if f.name in ("tokens", "response_length") or f.length is not None or f.pair is not None
    or f.kind in (Kind.MEDIA, Kind.SPANS)
)
"""The fields :func:`check_lengths` reads (name, optional, set when true): the ones a length
relation names. It runs on every sample before publish, so it reads no other."""


def _check_relations(values: dict[str, Any], what: str, relations: tuple[tuple[Any, ...], ...]) -> None:
    """The lengths one field implies for another (``length``, ``pair``, the spans' range)."""
    tokens, rlen = values["tokens"], values["response_length"]
    response, rows, offsets, pairs = relations
    for name, key in response:
        value = values.get(name)
        if value is not None and len(value) != rlen:
            raise DecodeError("bad_field", f"{what}.{key} has {len(value)} entries for {rlen} response tokens")
    if not _RELATED.isdisjoint(values):
        for name, pair, key, pair_key in pairs:
            if (name in values) != (pair in values):
                raise DecodeError("bad_field", f"{what}: {key} needs both {key} and {pair_key}")
        for name, key, media_ok in rows:
            value = values.get(name)
            count = max(0, len(tokens) - 1)
            # media-expanded rows (miles counts vision patches) only with processed media present
            if value is not None and len(value) != count and not (
                media_ok and len(value) > count and any(values.get(m) for m in _MEDIA)
            ):
                raise DecodeError("bad_field", f"{what}.{key} has {len(value)} rows for {len(tokens)} tokens")
        for name, pair, key in offsets:
            value = values.get(name)
            if value is None or isinstance(value, Unfetched):  # an offloaded array's values are not here
                continue
            ids = values[pair]
            if len(value) != rlen + 1 or value.data[0] != 0 or value.data[-1] != len(ids):
                raise DecodeError(
                    "bad_field",
                    f"{what}.{key}: {len(value)} offsets for {rlen} response tokens, must run from 0 to {len(ids)}",
                )
    for f in _SPANS:
        previous = 0
        for start, end, _ in values.get(f.name) or ():
            if not previous <= start <= end <= rlen:
                raise DecodeError(
                    "bad_field", f"{what}.{f.key} span {start}..{end} is out of order or past {rlen} tokens"
                )
            previous = end


def _packed_from_wire(raw: object, what: str, limits: CodecLimits, ndim: int) -> Packed:
    if not isinstance(raw, list | tuple) or len(raw) != 3:
        raise DecodeError("bad_field", f"{what} must be [typecode, shape, bin]")
    code, shape, data = raw
    if not isinstance(code, str) or code not in PACKED_CODES:
        raise DecodeError("bad_field", f"{what}: typecode {code!r} is not one of {', '.join(PACKED_CODES)}")
    if (
        not isinstance(shape, list | tuple)
        or len(shape) != ndim
        or not all(is_int(d) and d >= 0 for d in shape)
    ):
        raise DecodeError("bad_field", f"{what}: shape {shape!r} is not {ndim} non-negative ints")
    values = _unpack_array(code, data, what, limits.max_array_items)
    if len(values) != math.prod(shape):
        raise DecodeError("bad_field", f"{what}: {len(values)} values for shape {tuple(shape)}")
    return Packed(values, tuple(shape))


def _plain_map(value: object, what: str, kinds: type | tuple[type, ...] = object) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(
        isinstance(v, kinds) and not isinstance(v, bool) for v in value.values()
    ):
        raise DecodeError("bad_field", f"{what} must be a map" + ("" if kinds is object else " of ints"))
    return value


def _multimodal(obj: Mapping[str, Any], what: str) -> dict[str, Any] | None:
    value = obj.get("mmi")
    if value is not None and not isinstance(value, dict):
        raise DecodeError("bad_field", f"{what}.mmi must be a map or nil")
    return value


def _samples(
    raw: object, what: str, limits: CodecLimits, version: int,
    objects: tuple[ObjectRef, ...] = (), away: list[Offloaded] | None = None,
) -> list[Sample]:
    if not isinstance(raw, list):
        raise DecodeError("bad_field", f"{what} must be a list")
    if len(raw) > limits.max_samples:
        raise DecodeError("too_large", f"{len(raw)} samples exceeds {limits.max_samples}")
    return [_sample_from_wire(s, f"{what}[{i}]", limits, version, i, objects, away) for i, s in enumerate(raw)]


def _objects(obj: Mapping[str, Any], kind: str = "group") -> tuple[ObjectRef, ...]:
    """The refs of a version-4 group's (or partial prompt's) objects (``objs``), each checked, keys distinct."""
    raw = obj.get("objs")
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw or len(raw) > 4096:
        raise DecodeError("bad_field", f"{kind}.objs must be a non-empty list of object refs")
    try:
        refs = tuple(ObjectRef.from_wire(r) for r in raw)
    except ValueError as exc:
        raise DecodeError("bad_field", f"{kind}.objs: {exc}") from None
    if len({r.key for r in refs}) != len(refs):
        raise DecodeError("bad_field", f"{kind}.objs names one key twice")
    return refs


def _history(obj: Mapping[str, Any], what: str) -> list[str]:
    history = obj.get("history") or []
    if not isinstance(history, list) or not all(isinstance(h, str) for h in history):
        raise DecodeError("bad_field", f"{what}.history must be a list of strings")
    return history


def _check_kind(obj: Mapping[str, Any], kind: str) -> None:
    if obj.get("kind") != kind:
        raise DecodeError("wrong_kind", f"expected a {kind} payload, got {obj.get('kind')!r}")


def decode_group(payload: object, limits: CodecLimits = DEFAULT_LIMITS, *, views: bool = False) -> Group:
    """The group in ``payload``; with ``views``, its samples' arrays are memoryviews on
    ``payload`` (zero-copy, see :mod:`rollstream.common.codec`), else arrays of their own."""
    if views and LITTLE and isinstance(payload, bytes):
        check_payload(payload, limits)
        obj = unpack_group_views(payload, limits)
        if obj is not None:
            try:
                check_version(obj)
                return _group_from_wire(obj, limits)
            except DecodeError:
                pass  # malformed: the copying decoder below gives the reason
    return _group_from_wire(unpack(payload, limits), limits)


def _shared(obj: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """The fields a group and a prompt share, checked."""
    _check_kind(obj, kind)
    return {
        "index": _get(obj, "index", int, kind),
        "epoch": _get(obj, "epoch", int, kind),
        "attempt": _get(obj, "attempt", int, kind),
        "prompt": _prompt_content(obj.get("prompt"), kind),
        "label": obj.get("label"),
        "metadata": _get(obj, "metadata", dict, kind),
        "history": _history(obj, kind),
        "multimodal_inputs": _multimodal(obj, kind),
        "source": _get(obj, "src", str, kind) if "src" in obj else "",
        "admitted_ms": _get(obj, "adm", int, kind) if "adm" in obj else 0,
    }


def _group_from_wire(obj: dict[str, Any], limits: CodecLimits) -> Group:
    shared = _shared(obj, "group")
    objects = _objects(obj)
    away: list[Offloaded] = []
    group = Group(
        **shared,
        producer=_get(obj, "producer", str, "group"),
        generated_ms=_get(obj, "gen", int, "group") if "gen" in obj else 0,
        samples=_samples(_get(obj, "samples", list, "group"), "group.samples", limits, obj["v"], objects, away),
    )
    if objects:
        used = {a.obj for a in away}
        if used != set(range(len(objects))):
            raise DecodeError("bad_field", "group.objs: an object no sample's array is in")
        group.payload = GroupPayload(objects, tuple(away))
    return group


def decode_prompt(payload: object, limits: CodecLimits = DEFAULT_LIMITS) -> Prompt:
    obj = unpack(payload, limits)
    shared = _shared(obj, "prompt")
    ids_raw = obj.get("input_ids")
    partial_raw = obj.get("partial")
    objects = _objects(obj, "prompt")
    if objects and partial_raw is None:
        raise DecodeError("bad_field", "prompt.objs without partial samples")
    away: list[Offloaded] = []
    prompt = Prompt(
        **shared,
        input_ids=None if ids_raw is None else _unpack_array("i", ids_raw, "prompt.input_ids", limits.max_tokens),
        partial=None if partial_raw is None else _samples(
            partial_raw, "prompt.partial", limits, obj["v"], objects, away if objects else None
        ),
    )
    if objects:
        if {a.obj for a in away} != set(range(len(objects))):
            raise DecodeError("bad_field", "prompt.objs: an object no partial sample's array is in")
        prompt.payload = GroupPayload(objects, tuple(away))
    return prompt
