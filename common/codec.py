"""The wire format: msgpack maps with a schema version, token arrays as packed bytes.

Token ids travel as little-endian int32, log-probs as little-endian float32 and loss masks as
uint8, each in a msgpack ``bin`` field: a group of 8 x 8k tokens is a handful of memcpys, not
131k msgpack integers. Decoding is bounded (payload size, array and string lengths) and turns
every malformed input into :class:`~rollstream.common.errors.DecodeError`, never anything else.

Stream entries carry a few plain fields beside ``data`` so that ``redis-cli XRANGE`` is readable
without msgpack.

Version 3 adds what slime and miles train on (see ``docs/architecture.md`` for the table): the
routing, indexer and top-p replays as ``[typecode, shape, bin]`` triples in their smallest exact
dtype (``B`` uint8, ``H`` uint16, ``i`` int32), teacher log-probs and the OPD reverse KL as
float32 ``bin``, and small plain fields; each key is written only when its field is set.

**Zero-copy groups.** ``decode_group(..., views=True)`` (what ``take()`` uses) returns samples
whose ``tokens``, ``rollout_log_probs``, ``loss_mask`` and version-3 arrays (routing, indexer
and top-p replay, teacher log-probs, reverse KL) are memoryviews cast to their typecodes on the
payload bytes themselves, not copies: msgspec locates the ``bin`` fields of every sample
without copying them, and every other field is decoded by msgpack exactly
as the copying decoder does (same options, same limits). A payload the view path cannot read is
decoded again by the copying decoder, so malformed input gets exactly the same
:class:`DecodeError`. Views keep the payload bytes alive; big-endian hosts always copy.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import msgspec
from msgspec import UNSET, Raw, UnsetType

from .errors import ConfigError, DecodeError
from .models import PACKED_CODES, Adapter, FloatArray, Group, IntArray, Packed, Prompt, Sample, Status
from .parse import utf8

SCHEMA_VERSION = 3
"""The newest version this build writes, for groups and prompts that use a version-3 field
(routing replay, teacher log-probs, ... see ``_V3_SAMPLE_KEYS``); an entry without any is written
as version 2, byte for byte what the previous build wrote, so a trainer still on that build reads
it until a run turns the new fields on. Version 1 entries (before ``pl``, ``err`` and the filled
``lm``) are still read, so producers can be upgraded while a pipeline runs."""
READABLE_VERSIONS = (1, 2, 3)
_V3_SAMPLE_KEYS = ("re", "ix", "tpi", "tpo", "tlp", "kl", "rm", "tm", "rid", "spec", "pc", "ngt", "ad", "mti")
"""Version-3 sample keys, each present only when its field is set: absent fields cost nothing."""
_LITTLE = sys.byteorder == "little"

if array("i").itemsize != 4 or array("f").itemsize != 4:  # pragma: no cover - exotic platforms
    raise ImportError("rollstream needs 4-byte C int and float for its packed arrays")


@dataclass(frozen=True, slots=True)
class CodecLimits:
    """Upper bounds the decoder enforces, so a bad entry cannot exhaust memory."""

    max_payload_bytes: int = 512 * 1024 * 1024
    """Redis' own ``proto-max-bulk-len`` default: a group of 8 x 32k samples with a 48-layer
    top-8 routing replay is ~100 MiB."""
    max_samples: int = 4096
    max_tokens: int = 1 << 22
    max_string_bytes: int = 16 * 1024 * 1024
    max_container_len: int = 1 << 20
    max_array_items: int = 1 << 29
    """Items of one packed version-3 array (routing replay: tokens x layers x topk)."""

    def __post_init__(self) -> None:
        for name in ("max_payload_bytes", "max_samples", "max_tokens", "max_string_bytes", "max_array_items"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"CodecLimits.{name} must be positive")


DEFAULT_LIMITS = CodecLimits()


def _pack_array(values: array[Any] | memoryview[Any]) -> bytes | memoryview:
    if _LITTLE:  # msgpack packs the buffer as bin: one copy, into the payload
        return memoryview(values).cast("B")
    swapped = array(values.typecode, values)  # type: ignore[union-attr]  # pragma: no cover - big-endian: no views
    swapped.byteswap()  # pragma: no cover
    return swapped.tobytes()  # pragma: no cover


def _unpack_array(typecode: str, raw: Any, what: str, limit: int) -> Any:
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
    values.frombytes(raw)
    if not _LITTLE:  # pragma: no cover
        values.byteswap()
    return values


def _packed_to_wire(packed: Packed) -> list[Any]:
    return [packed.typecode, list(packed.shape), _pack_array(packed.data)]


def _mm_train_to_wire(inputs: Mapping[str, Any]) -> list[Any]:
    """Processed media: ``[plain values, {name: packed triple}]`` (tensors travel packed)."""
    plain = {k: v for k, v in inputs.items() if not isinstance(v, Packed)}
    packed = {k: _packed_to_wire(v) for k, v in inputs.items() if isinstance(v, Packed)}
    return [plain, packed]


def _v3_sample_fields(sample: Sample) -> dict[str, Any]:
    """The version-3 keys of ``sample``: only the fields that are set."""
    out: dict[str, Any] = {}
    for key, packed in (
        ("re", sample.routed_experts), ("ix", sample.indexer_topk),
        ("tpi", sample.top_p_token_ids), ("tpo", sample.top_p_token_offsets),
    ):
        if packed is not None:
            out[key] = _packed_to_wire(packed)
    if sample.teacher_log_probs is not None:
        out["tlp"] = _pack_array(sample.teacher_log_probs)
    if sample.opd_reverse_kl is not None:
        out["kl"] = _pack_array(sample.opd_reverse_kl)
    if sample.remove_sample:
        out["rm"] = True
    if sample.train_metadata is not None:
        out["tm"] = sample.train_metadata
    if sample.rollout_id is not None:
        out["rid"] = sample.rollout_id
    if sample.spec_info is not None:
        out["spec"] = sample.spec_info
    if sample.prefix_cache_info is not None:
        out["pc"] = sample.prefix_cache_info
    if sample.non_generation_time:
        out["ngt"] = float(sample.non_generation_time)
    if sample.adapter is not None:
        out["ad"] = [sample.adapter.name, sample.adapter.slot]
    if sample.multimodal_train_inputs is not None:
        out["mti"] = _mm_train_to_wire(sample.multimodal_train_inputs)
    return out


def _sample_to_wire(sample: Sample) -> dict[str, Any]:
    return {
        "i": sample.index,
        "tok": _pack_array(sample.tokens),
        "resp": sample.response,
        "rlen": sample.response_length,
        "pl": sample.prompt_length,
        "rew": sample.reward,
        "st": sample.status.value,
        "fr": sample.finish_reason,
        "wv": sample.weight_versions,
        "lp": None if sample.rollout_log_probs is None else _pack_array(sample.rollout_log_probs),
        "lm": None if sample.loss_mask is None else _pack_array(sample.loss_mask),
        "err": sample.error,
        "md": sample.metadata,
        **_v3_sample_fields(sample),
    }


def _version_of(samples: list[dict[str, Any]], multimodal: Any) -> int:
    """3 when a version-3 field is used, else 2 (readable by the previous build)."""
    if multimodal is not None or any(key in s for s in samples for key in _V3_SAMPLE_KEYS):
        return 3
    return 2


def _packb(obj: Any) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"cannot encode as msgpack (labels and metadata must be plain data): {exc}") from exc


def encode_group(group: Group) -> bytes:
    samples = [_sample_to_wire(s) for s in group.samples]
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
    return _packb(obj)


def encode_prompt(prompt: Prompt) -> bytes:
    partial = None if prompt.partial is None else [_sample_to_wire(s) for s in prompt.partial]
    obj = {
            "v": _version_of(partial or [], prompt.multimodal_inputs),
            "kind": "prompt",
            "index": prompt.index,
            "epoch": prompt.epoch,
            "attempt": prompt.attempt,
            "prompt": prompt.prompt,
            "label": prompt.label,
            "metadata": prompt.metadata,
            "input_ids": None if prompt.input_ids is None else _pack_array(prompt.input_ids),
            "partial": partial,
            "history": prompt.history,
        }
    if prompt.multimodal_inputs is not None:
        obj["mmi"] = prompt.multimodal_inputs
    return _packb(obj)


def _check_payload(payload: Any, limits: CodecLimits) -> None:
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise DecodeError("bad_field", f"payload must be bytes, got {type(payload).__name__}")
    if len(payload) > limits.max_payload_bytes:
        raise DecodeError("too_large", f"payload of {len(payload)} bytes exceeds {limits.max_payload_bytes}")


def _unpackb(payload: Any, limits: CodecLimits) -> Any:
    return msgpack.unpackb(
        payload,
        raw=False,
        max_str_len=limits.max_string_bytes,
        max_bin_len=limits.max_payload_bytes,
        max_array_len=limits.max_container_len,
        max_map_len=limits.max_container_len,
        max_ext_len=0,
        strict_map_key=True,
    )


def _unpack(payload: Any, limits: CodecLimits) -> dict[str, Any]:
    _check_payload(payload, limits)
    try:
        obj = _unpackb(payload, limits)
    except Exception as exc:  # msgpack raises a zoo of types for malformed input
        raise DecodeError("not_msgpack", f"{type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict):
        raise DecodeError("bad_field", f"payload must be a map, got {type(obj).__name__}")
    _check_version(obj)
    return obj


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
        obj[name] = _unpackb(value, limits) if isinstance(value, Raw) else value
    return obj


def _unpack_group_views(payload: bytes, limits: CodecLimits) -> dict[str, Any] | None:
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


def _check_version(obj: Mapping[str, Any]) -> None:
    version = obj.get("v")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise DecodeError(
            "unknown_schema", f"schema version {version!r}, this build reads {', '.join(map(str, READABLE_VERSIONS))}"
        )


def _get(obj: Mapping[str, Any], key: str, kinds: type | tuple[type, ...], what: str) -> Any:
    if key not in obj:
        raise DecodeError("missing_field", f"{what}.{key}")
    value = obj[key]
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _as_tuple(kinds)):
        raise DecodeError("bad_field", f"{what}.{key} has type {type(value).__name__}")
    return value


def _as_tuple(kinds: type | tuple[type, ...]) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _prompt_content(value: Any, what: str) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return value
    raise DecodeError("bad_field", f"{what}.prompt must be a string or a list of messages")


def _reward(value: Any, what: str) -> Any:
    if value is None or (isinstance(value, int | float) and not isinstance(value, bool)):
        return value
    if isinstance(value, dict) and all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in value.values()
    ):
        return value
    raise DecodeError("bad_field", f"{what}.rew must be a number, a map of numbers or nil")


def _sample_from_wire(obj: Any, what: str, limits: CodecLimits, version: int) -> Sample:
    if not isinstance(obj, dict):
        raise DecodeError("bad_field", f"{what} must be a map")
    tokens: IntArray = _unpack_array("i", _get(obj, "tok", (bytes, memoryview), what), f"{what}.tok", limits.max_tokens)
    rlen = _get(obj, "rlen", int, what)
    if not 0 <= rlen <= len(tokens):
        raise DecodeError("bad_field", f"{what}.rlen {rlen} outside 0..{len(tokens)}")
    metadata = _get(obj, "md", dict, what)
    if version == 1:  # flags travelled in the metadata, and the prompt length was implied
        plen = len(tokens) - rlen
        if metadata.get("prompt_ids") == "unknown":
            metadata = {k: v for k, v in metadata.items() if k != "prompt_ids"}
        error = metadata.get("error")
        if isinstance(error, str):
            metadata = {k: v for k, v in metadata.items() if k != "error"}
        else:
            error = None
    else:
        plen = _get(obj, "pl", int, what)
        if plen + rlen != len(tokens):
            raise DecodeError("bad_field", f"{what}: pl {plen} + rlen {rlen} != {len(tokens)} tokens")
        error = obj.get("err")
        if error is not None and not isinstance(error, str):
            raise DecodeError("bad_field", f"{what}.err must be a string or nil")
    try:
        status = Status(_get(obj, "st", str, what))
    except ValueError:
        raise DecodeError("bad_field", f"{what}.st is not a status") from None
    versions = _get(obj, "wv", list, what)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in versions):
        raise DecodeError("bad_field", f"{what}.wv must be a list of ints")
    lp_raw = obj.get("lp")
    lm_raw = obj.get("lm")
    log_probs: FloatArray | None = None
    if lp_raw is not None:
        log_probs = _unpack_array("f", lp_raw, f"{what}.lp", limits.max_tokens)
    mask: IntArray | None = None if lm_raw is None else _unpack_array("B", lm_raw, f"{what}.lm", limits.max_tokens)
    if mask is not None and len(mask) != rlen:
        raise DecodeError("bad_field", f"{what}.lm has {len(mask)} entries for {rlen} response tokens")
    if mask is None and version == 1:
        mask = array("B", b"\x01" * rlen)
    finish = obj.get("fr")
    if finish is not None and not isinstance(finish, str):
        raise DecodeError("bad_field", f"{what}.fr must be a string or nil")
    sample = Sample(
        index=_get(obj, "i", int, what),
        tokens=tokens,
        response=_get(obj, "resp", str, what),
        response_length=rlen,
        prompt_length=plen,
        reward=_reward(obj.get("rew"), what),
        status=status,
        finish_reason=finish,
        weight_versions=versions,
        rollout_log_probs=log_probs,
        loss_mask=mask,
        error=error,
        metadata=metadata,
    )
    if version >= 3:
        _v3_sample_from_wire(sample, obj, what, limits)
    return sample


def _packed_from_wire(raw: Any, what: str, limits: CodecLimits, ndim: int) -> Packed:
    if not isinstance(raw, list | tuple) or len(raw) != 3:
        raise DecodeError("bad_field", f"{what} must be [typecode, shape, bin]")
    code, shape, data = raw
    if not isinstance(code, str) or code not in PACKED_CODES:
        raise DecodeError("bad_field", f"{what}: typecode {code!r} is not one of {', '.join(PACKED_CODES)}")
    if (
        not isinstance(shape, list | tuple)
        or len(shape) != ndim
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise DecodeError("bad_field", f"{what}: shape {shape!r} is not {ndim} non-negative ints")
    values = _unpack_array(code, data, what, limits.max_array_items)
    if len(values) != math.prod(shape):
        raise DecodeError("bad_field", f"{what}: {len(values)} values for shape {tuple(shape)}")
    return Packed(values, tuple(shape))


def _plain_map(value: Any, what: str, kinds: type | tuple[type, ...] = object) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(
        isinstance(v, kinds) and not isinstance(v, bool) for v in value.values()
    ):
        raise DecodeError("bad_field", f"{what} must be a map" + ("" if kinds is object else " of ints"))
    return value


def _v3_sample_from_wire(sample: Sample, obj: Mapping[str, Any], what: str, limits: CodecLimits) -> None:
    """Fill the version-3 fields of ``sample`` from ``obj``, checking every length they imply."""
    rows = max(0, len(sample.tokens) - 1)
    if "mti" in obj:
        raw = obj["mti"]
        if not isinstance(raw, list | tuple) or len(raw) != 2 or not isinstance(raw[1], dict):
            raise DecodeError("bad_field", f"{what}.mti must be [plain map, packed map]")
        inputs = dict(_plain_map(raw[0], f"{what}.mti"))
        for name, packed in raw[1].items():
            if not isinstance(packed, list | tuple) or len(packed) != 3 or not isinstance(packed[1], list | tuple):
                raise DecodeError("bad_field", f"{what}.mti.{name} must be [typecode, shape, bin]")
            inputs[name] = _packed_from_wire(packed, f"{what}.mti.{name}", limits, len(packed[1]))
        sample.multimodal_train_inputs = inputs
    if "re" in obj:
        experts = _packed_from_wire(obj["re"], f"{what}.re", limits, 3)
        # media-expanded rows (miles counts vision patches) only with processed media present
        if len(experts) != rows and not (sample.multimodal_train_inputs and len(experts) > rows):
            raise DecodeError("bad_field", f"{what}.re has {len(experts)} rows for {len(sample.tokens)} tokens")
        sample.routed_experts = experts
    if "ix" in obj:
        indexer = _packed_from_wire(obj["ix"], f"{what}.ix", limits, 3)
        if len(indexer) != rows:
            raise DecodeError("bad_field", f"{what}.ix has {len(indexer)} rows for {len(sample.tokens)} tokens")
        sample.indexer_topk = indexer
    if ("tpi" in obj) != ("tpo" in obj):
        raise DecodeError("bad_field", f"{what}: top-p replay needs both tpi and tpo")
    if "tpi" in obj:
        ids = _packed_from_wire(obj["tpi"], f"{what}.tpi", limits, 1)
        offsets = _packed_from_wire(obj["tpo"], f"{what}.tpo", limits, 1)
        if len(offsets) != sample.response_length + 1 or offsets.data[0] != 0 or offsets.data[-1] != len(ids):
            raise DecodeError(
                "bad_field",
                f"{what}.tpo: {len(offsets)} offsets for {sample.response_length} response tokens, "
                f"must run from 0 to {len(ids)}",
            )
        sample.top_p_token_ids, sample.top_p_token_offsets = ids, offsets
    for key, name in (("tlp", "teacher_log_probs"), ("kl", "opd_reverse_kl")):
        if key in obj:
            values = _unpack_array("f", obj[key], f"{what}.{key}", limits.max_tokens)
            if len(values) != sample.response_length:
                raise DecodeError(
                    "bad_field", f"{what}.{key} has {len(values)} entries for {sample.response_length} response tokens"
                )
            setattr(sample, name, values)
    if "rm" in obj:
        if not isinstance(obj["rm"], bool):
            raise DecodeError("bad_field", f"{what}.rm must be a bool")
        sample.remove_sample = obj["rm"]
    if "tm" in obj:
        sample.train_metadata = _plain_map(obj["tm"], f"{what}.tm")
    if "rid" in obj:
        rid = obj["rid"]
        if not isinstance(rid, int) or isinstance(rid, bool):
            raise DecodeError("bad_field", f"{what}.rid must be an int")
        sample.rollout_id = rid
    if "spec" in obj:
        sample.spec_info = _plain_map(obj["spec"], f"{what}.spec", int)
    if "pc" in obj:
        sample.prefix_cache_info = _plain_map(obj["pc"], f"{what}.pc", int)
    if "ngt" in obj:
        ngt = obj["ngt"]
        if not isinstance(ngt, int | float) or isinstance(ngt, bool) or not math.isfinite(ngt):
            raise DecodeError("bad_field", f"{what}.ngt must be a finite number")
        sample.non_generation_time = float(ngt)
    if "ad" in obj:
        ad = obj["ad"]
        if (
            not isinstance(ad, list | tuple) or len(ad) != 2 or not isinstance(ad[0], str)
            or not isinstance(ad[1], int) or isinstance(ad[1], bool)
        ):
            raise DecodeError("bad_field", f"{what}.ad must be [name, slot]")
        sample.adapter = Adapter(ad[0], ad[1])


def _multimodal(obj: Mapping[str, Any], what: str) -> dict[str, Any] | None:
    value = obj.get("mmi")
    if value is not None and not isinstance(value, dict):
        raise DecodeError("bad_field", f"{what}.mmi must be a map or nil")
    return value


def _samples(raw: Any, what: str, limits: CodecLimits, version: int) -> list[Sample]:
    if not isinstance(raw, list):
        raise DecodeError("bad_field", f"{what} must be a list")
    if len(raw) > limits.max_samples:
        raise DecodeError("too_large", f"{len(raw)} samples exceeds {limits.max_samples}")
    return [_sample_from_wire(s, f"{what}[{i}]", limits, version) for i, s in enumerate(raw)]


def _history(obj: Mapping[str, Any], what: str) -> list[str]:
    history = obj.get("history") or []
    if not isinstance(history, list) or not all(isinstance(h, str) for h in history):
        raise DecodeError("bad_field", f"{what}.history must be a list of strings")
    return history


def _check_kind(obj: Mapping[str, Any], kind: str) -> None:
    if obj.get("kind") != kind:
        raise DecodeError("wrong_kind", f"expected a {kind} payload, got {obj.get('kind')!r}")


def decode_group(payload: Any, limits: CodecLimits = DEFAULT_LIMITS, *, views: bool = False) -> Group:
    """The group in ``payload``; with ``views``, its samples' arrays are memoryviews on
    ``payload`` (zero-copy, see the module docstring), else arrays of their own."""
    if views and _LITTLE and isinstance(payload, bytes):
        _check_payload(payload, limits)
        obj = _unpack_group_views(payload, limits)
        if obj is not None:
            try:
                _check_version(obj)
                return _group_from_wire(obj, limits)
            except DecodeError:
                pass  # malformed: the copying decoder below gives the reason
    return _group_from_wire(_unpack(payload, limits), limits)


def _group_from_wire(obj: dict[str, Any], limits: CodecLimits) -> Group:
    _check_kind(obj, "group")
    return Group(
        index=_get(obj, "index", int, "group"),
        epoch=_get(obj, "epoch", int, "group"),
        attempt=_get(obj, "attempt", int, "group"),
        prompt=_prompt_content(obj.get("prompt"), "group"),
        label=obj.get("label"),
        metadata=_get(obj, "metadata", dict, "group"),
        producer=_get(obj, "producer", str, "group"),
        samples=_samples(_get(obj, "samples", list, "group"), "group.samples", limits, obj["v"]),
        history=_history(obj, "group"),
        multimodal_inputs=_multimodal(obj, "group"),
    )


def decode_prompt(payload: Any, limits: CodecLimits = DEFAULT_LIMITS) -> Prompt:
    obj = _unpack(payload, limits)
    _check_kind(obj, "prompt")
    ids_raw = obj.get("input_ids")
    partial_raw = obj.get("partial")
    return Prompt(
        index=_get(obj, "index", int, "prompt"),
        epoch=_get(obj, "epoch", int, "prompt"),
        attempt=_get(obj, "attempt", int, "prompt"),
        prompt=_prompt_content(obj.get("prompt"), "prompt"),
        label=obj.get("label"),
        metadata=_get(obj, "metadata", dict, "prompt"),
        input_ids=None if ids_raw is None else _unpack_array("i", ids_raw, "prompt.input_ids", limits.max_tokens),
        partial=None if partial_raw is None else _samples(partial_raw, "prompt.partial", limits, obj["v"]),
        history=_history(obj, "prompt"),
        multimodal_inputs=_multimodal(obj, "prompt"),
    )


# --- stream entries -----------------------------------------------------------------------

Fields = dict[str, str | bytes | int | float]


def prompt_fields(prompt: Prompt) -> Fields:
    """Fields of a prompt-stream entry: plain ``index``/``epoch``/``attempt`` plus ``data``."""
    return {
        "index": prompt.index,
        "epoch": prompt.epoch,
        "attempt": prompt.attempt,
        "data": encode_prompt(prompt),
    }


def group_fields(group: Group) -> Fields:
    """Fields of a group-stream entry; everything but ``data`` is readable in redis-cli
    (``bytes`` is the size of ``data``)."""
    min_version = group.min_version
    reward = group.reward_mean
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
        "data": data,
    }


def group_too_large(fields: Mapping[str, Any], limit: int) -> str | None:
    """The dead-letter reason of a group entry whose data exceeds ``limit`` bytes, else None."""
    size = len(fields.get("data", b""))
    if size <= limit:
        return None
    return f"group_too_large: {size} bytes of group data exceeds max_group_bytes {limit} (rollstream init)"


def entry_data(fields: Mapping[bytes | str, Any]) -> bytes:
    """The ``data`` field of a raw stream entry, or DecodeError when it is missing (or a field name
    is not UTF-8: such an entry was not written by rollstream)."""
    for name in fields:
        if isinstance(name, bytes) and utf8(name) is None:
            raise DecodeError("bad_field", f"field name {name[:40]!r} is not UTF-8")
    data = fields.get(b"data", fields.get("data"))
    if data is None:
        raise DecodeError("missing_field", "entry has no data field")
    if isinstance(data, str):
        data = data.encode()
    if not isinstance(data, bytes):
        raise DecodeError("bad_field", "entry data is not bytes")
    return data


def decode_group_entry(
    fields: Mapping[bytes | str, Any], limits: CodecLimits = DEFAULT_LIMITS, *, views: bool = False
) -> Group:
    return decode_group(entry_data(fields), limits, views=views)


def decode_prompt_entry(fields: Mapping[bytes | str, Any], limits: CodecLimits = DEFAULT_LIMITS) -> Prompt:
    return decode_prompt(entry_data(fields), limits)
