"""The payload plane in the codec and the config: which arrays leave the entry, what the entry
keeps (refs, offsets, plain fields), and that a decoder refuses every inconsistent reference."""

from __future__ import annotations

import dataclasses
import itertools
from array import array
from typing import Any

import msgpack
import numpy as np
import pytest
from rollstream.common.arrays import Packed
from rollstream.common.codec import (
    OFFLOAD_VERSION,
    decode_group,
    decode_group_entry,
    encode_group_offloaded,
    group_fields,
    group_fields_offloaded,
)
from rollstream.common.config import PipelineConfig
from rollstream.common.errors import ConfigError, DecodeError
from rollstream.common.models import Group, Sample


def r3_group(n: int = 2, tokens: int = 200, seed: int = 0) -> Group:
    rng = np.random.default_rng(seed)
    samples = [
        Sample(
            index=i, tokens=array("i", range(tokens + 1)), response_length=tokens, prompt_length=1,
            weight_versions=[1], loss_mask=array("B", [1] * tokens), rollout_log_probs=array("f", [-0.5] * tokens),
            routed_experts=Packed.of(rng.integers(0, 128, (tokens, 48, 8))),
            teacher_log_probs=array("f", rng.random(tokens, dtype=np.float32)),
        )
        for i in range(n)
    ]
    return Group(index=7, prompt="p", samples=samples)


def keys() -> Any:
    counter = itertools.count()
    return lambda: f"ns/obj-{next(counter)}"


def raw_fields(fields: dict[str, Any]) -> dict[bytes, bytes]:
    return {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in fields.items()}


def test_big_arrays_leave_the_entry_and_come_back_through_attach() -> None:
    group = r3_group()
    routed = group.samples[0].routed_experts.nbytes  # type: ignore[union-attr]
    fields, objects = group_fields_offloaded(group, routed, keys())
    assert [o.ref.key for o in objects] == ["ns/obj-0-2.0", "ns/obj-0-2.1"]  # one object per sample, one base
    assert fields["objects"] == 2 and fields["refs"] == "ns/obj-0-2"  # the group's one ledger member
    teacher = len(memoryview(group.samples[0].teacher_log_probs).cast("B"))  # type: ignore[arg-type]
    assert teacher < routed  # under the bar alone: it goes with its sample's routing all the same
    assert fields["store_bytes"] == sum(o.ref.size for o in objects) == 2 * (routed + teacher)
    assert int(fields["bytes"]) == len(fields["data"]) < routed
    decoded = decode_group_entry(raw_fields(fields), views=True)
    assert isinstance(decoded.samples[0].tokens, memoryview)  # in-entry arrays are still zero-copy views
    assert decoded.samples[0].teacher_log_probs is None and decoded.samples[0].routed_experts is None
    assert decoded.payload is not None and decoded.payload.nbytes == 2 * (routed + teacher)
    buffers = {o.ref.key: memoryview(b"".join(bytes(p) for p in o.parts)) for o in objects}
    decoded.payload.attach(decoded, buffers)
    view = decoded.samples[1].routed_experts.numpy()  # type: ignore[union-attr]
    assert view.shape == (200, 48, 8) and view.dtype == np.uint8
    assert np.shares_memory(view, np.frombuffer(buffers["ns/obj-0-2.1"], dtype=np.uint8))  # no copy
    decoded.payload = None
    assert decoded == group


def test_several_arrays_of_one_sample_share_its_object_aligned() -> None:
    group = r3_group(n=1)
    data, objects = encode_group_offloaded(group, 1, keys())
    assert len(objects) == 1
    wire = msgpack.unpackb(data)
    assert wire["v"] == OFFLOAD_VERSION
    ofl = wire["samples"][0]["ofl"]
    assert set(ofl[1]) == {"re", "tlp"}
    assert all(spec[0] % 8 == 0 for spec in ofl[1].values())
    decoded = decode_group(data, views=True)
    assert decoded.payload is not None
    decoded.payload.attach(decoded, {objects[0].ref.key: memoryview(b"".join(bytes(p) for p in objects[0].parts))})
    decoded.payload = None
    assert decoded == group


def test_the_bar_is_per_sample_all_of_a_samples_arrays_go_or_none() -> None:
    """A sample whose offloadable arrays together reach the bar sends them all to its object,
    each under the bar alone; a sample whose arrays together stay under it keeps them all."""
    group = r3_group()
    small = dataclasses.replace(group.samples[1], routed_experts=Packed.of(np.zeros((200, 1, 1), dtype=np.uint8)))
    group = dataclasses.replace(group, samples=[group.samples[0], small])
    routed = group.samples[0].routed_experts.nbytes  # type: ignore[union-attr]
    teacher = len(memoryview(group.samples[0].teacher_log_probs).cast("B"))  # type: ignore[arg-type]
    bar = routed + teacher - 1  # neither array alone, both together
    assert bar > max(routed, teacher) and 200 + teacher < bar
    fields, objects = group_fields_offloaded(group, bar, keys())
    assert len(objects) == 1 and fields["refs"] == "ns/obj-0-1"  # the first sample's object only
    decoded = decode_group_entry(raw_fields(fields), views=True)
    first, second = decoded.samples
    assert first.routed_experts is None and first.teacher_log_probs is None  # both went
    assert second.routed_experts is not None and second.teacher_log_probs is not None  # both stayed
    assert decoded.payload is not None
    decoded.payload.attach(decoded, {objects[0].ref.key: memoryview(b"".join(bytes(p) for p in objects[0].parts))})
    decoded.payload = None
    assert decoded == group


def test_nothing_over_the_bar_is_exactly_the_inline_entry() -> None:
    group = r3_group()
    fields, objects = group_fields_offloaded(group, 1 << 30, keys())
    assert objects == [] and fields == group_fields(group)


def _tampered(change: Any) -> bytes:
    data, _ = encode_group_offloaded(r3_group(n=1), 1, keys())
    wire = msgpack.unpackb(data)
    change(wire)
    return msgpack.packb(wire)


def _set_spec(index: int, value: Any) -> Any:
    def change(wire: dict[str, Any]) -> None:
        spec = wire["samples"][0]["ofl"][1]["re"]
        spec[index] = value
    return change


@pytest.mark.parametrize("change, match", [
    (_set_spec(0, 10**9), "does not describe an array"),
    (_set_spec(1, 5), "does not describe an array|bytes for"),
    (_set_spec(2, "d"), "does not describe an array"),
    (_set_spec(3, [200, 48]), "does not describe an array"),
    (lambda w: w["samples"][0].__setitem__("re", ["B", [0, 48, 8], b""]), "also in the entry"),
    (lambda w: w["samples"][0]["ofl"].__setitem__(0, 3), "naming one of 1 objects"),
    (lambda w: w["objs"].append(["ns/unused", 1, 0]), "an object no sample's array is in"),
    (lambda w: w["objs"][0].__setitem__(0, "../escape"), "group.objs"),
    (lambda w: w.__setitem__("v", 3), "outside a version-4 group"),
    (lambda w: w["samples"][0]["ofl"][1].__setitem__("tok", [0, 4, "i", [1]]), "not an offloadable field"),
])
def test_inconsistent_references_are_refused(change: Any, match: str) -> None:
    payload = _tampered(change)
    for views in (False, True):
        with pytest.raises(DecodeError, match=match):
            decode_group(payload, views=views)


def test_rows_of_an_offloaded_replay_are_checked_against_the_tokens() -> None:
    def shorter(wire: dict[str, Any]) -> None:
        spec = wire["samples"][0]["ofl"][1]["re"]
        spec[1], spec[3] = 199 * 384, [199, 48, 8]
    with pytest.raises(DecodeError, match="199 rows for 201 tokens"):
        decode_group(_tampered(shorter))


def test_the_config_keeps_the_store_and_checks_it() -> None:
    config = PipelineConfig(n_samples_per_prompt=2, batch_size=2, payload_store="fs:///tmp/x", payload_min_bytes=4096)
    assert PipelineConfig.from_redis(config.to_redis()) == config
    assert PipelineConfig(n_samples_per_prompt=2, batch_size=2).payload_store == ""
    for bad in ("s3://bucket", "fs://relative", "mooncake://nohostport", "fs:///a b"):
        with pytest.raises(ConfigError, match="payload store URL"):
            PipelineConfig(n_samples_per_prompt=2, batch_size=2, payload_store=bad)
    with pytest.raises(ConfigError, match="payload_min_bytes"):
        PipelineConfig(n_samples_per_prompt=2, batch_size=2, payload_min_bytes=0)
    assert PipelineConfig(n_samples_per_prompt=2, batch_size=2, payload_store="mooncake://m:50051?metadata=http://m:8080/metadata")
