"""Payloads back to groups and prompts, every field checked: any malformed input becomes
:class:`~..errors.DecodeError`, never anything else."""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping
from typing import Any

from ..arrays import PACKED_CODES, FloatArray, IntArray, Packed
from ..errors import DecodeError
from ..models import Adapter, Group, Prompt, Sample, Status
from .views import unpack_group_views
from .wire import DEFAULT_LIMITS, LITTLE, CodecLimits, check_payload, check_version, unpack


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
    if not LITTLE:  # pragma: no cover
        values.byteswap()
    return values


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
    spans = _spans(obj.get("wvs"), rlen, what)
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
        weight_version_spans=spans,
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


def _spans(raw: Any, rlen: int, what: str) -> list[tuple[int, int, int]] | None:
    """``wvs`` (optional): flat ``start, end, version`` triples over the response, in order."""
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) % 3 or not all(type(x) is int for x in raw):
        raise DecodeError("bad_field", f"{what}.wvs must be a flat list of int triples")
    spans = [(raw[i], raw[i + 1], raw[i + 2]) for i in range(0, len(raw), 3)]
    previous = 0
    for start, end, _ in spans:
        if not previous <= start <= end <= rlen:
            raise DecodeError("bad_field", f"{what}.wvs span {start}..{end} is out of order or past {rlen} tokens")
        previous = end
    return spans


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
    }


def _group_from_wire(obj: dict[str, Any], limits: CodecLimits) -> Group:
    return Group(
        **_shared(obj, "group"),
        producer=_get(obj, "producer", str, "group"),
        samples=_samples(_get(obj, "samples", list, "group"), "group.samples", limits, obj["v"]),
    )


def decode_prompt(payload: Any, limits: CodecLimits = DEFAULT_LIMITS) -> Prompt:
    obj = unpack(payload, limits)
    shared = _shared(obj, "prompt")
    ids_raw = obj.get("input_ids")
    partial_raw = obj.get("partial")
    return Prompt(
        **shared,
        input_ids=None if ids_raw is None else _unpack_array("i", ids_raw, "prompt.input_ids", limits.max_tokens),
        partial=None if partial_raw is None else _samples(partial_raw, "prompt.partial", limits, obj["v"]),
    )
