"""Groups and prompts to msgpack payloads: token arrays as packed little-endian ``bin`` fields, the
version-3 keys written only when their field is set (an entry without any is version 2)."""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from typing import Any

import msgpack

from ..models import Group, Packed, Prompt, Sample
from .wire import LITTLE, V3_SAMPLE_KEYS

_V3_KEYS = frozenset(V3_SAMPLE_KEYS)


def _pack_array(values: array[Any] | memoryview[Any]) -> bytes | memoryview:
    if LITTLE:  # msgpack packs the buffer as bin: one copy, into the payload
        return memoryview(values).cast("B")
    swapped = array(values.typecode, values)  # type: ignore[union-attr]  # pragma: no cover - big-endian: no views
    swapped.byteswap()  # pragma: no cover
    return swapped.tobytes()  # pragma: no cover


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
    wire: dict[str, Any] = {
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
    }
    v3 = _v3_sample_fields(sample)
    if v3:  # rare: most samples carry none (then the entry stays version 2)
        wire.update(v3)
    if sample.weight_version_spans is not None:  # optional, flat: start, end, version, ...
        wire["wvs"] = [x for span in sample.weight_version_spans for x in span]
    return wire


def _version_of(samples: list[dict[str, Any]], multimodal: Any) -> int:
    """3 when a version-3 field is used, else 2 (readable by the previous build)."""
    if multimodal is not None or any(not _V3_KEYS.isdisjoint(s) for s in samples):  # a C loop per sample
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
