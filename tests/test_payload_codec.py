"""The payload plane in the codec and the config: which arrays leave the entry, what the entry
keeps (refs, offsets, plain fields), and that a decoder refuses every inconsistent reference."""

from __future__ import annotations

import dataclasses
import itertools
import sys
from array import array
from typing import Any

import msgpack
import numpy as np
import pytest
from rollstream.common.arrays import Packed, Unfetched
from rollstream.common.codec import (
    OFFLOAD_VERSION,
    decode_group,
    decode_group_entry,
    encode_group,
    encode_group_offloaded,
    group_fields,
    group_fields_offloaded,
)
from rollstream.common.config import PipelineConfig
from rollstream.common.errors import ConfigError, DecodeError, PayloadError, PayloadNotFetched
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
    small = 201 * 4 + 200 * 4 + 200  # tokens, log-probs and loss mask go with them
    size = routed + teacher + small + 4  # each array at an offset aligned to 8 (the tokens' 804 bytes pad 4)
    assert fields["store_bytes"] == sum(o.ref.size for o in objects) == 2 * size
    assert int(fields["bytes"]) == len(fields["data"]) < 1000  # the control fields only
    decoded = decode_group_entry(raw_fields(fields), views=True)
    first = decoded.samples[0]
    for name in ("tokens", "rollout_log_probs", "loss_mask", "teacher_log_probs", "routed_experts"):
        assert isinstance(getattr(first, name), Unfetched), name  # a placeholder, never None
    assert len(first.tokens) == 201 and first.prompt_length == 1 and len(first.loss_mask or ()) == 200
    assert first.routed_experts.shape == (200, 48, 8)  # type: ignore[union-attr]
    assert decoded.payload is not None and decoded.payload.nbytes == 2 * size
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
    assert set(ofl[1]) == {"tok", "lp", "lm", "re", "tlp"}
    assert not {"tok", "lp", "lm", "re", "tlp"} & set(wire["samples"][0])  # none also in the entry
    assert wire["samples"][0]["rlen"] == 200 and wire["samples"][0]["pl"] == 1  # the lengths stay
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
    small = 201 * 4 + 200 * 4 + 200  # tokens, log-probs, loss mask
    bar = routed + teacher + small - 1  # no array alone, all together
    assert bar > max(routed, teacher) and 200 + teacher + small < bar
    fields, objects = group_fields_offloaded(group, bar, keys())
    assert len(objects) == 1 and fields["refs"] == "ns/obj-0-1"  # the first sample's object only
    decoded = decode_group_entry(raw_fields(fields), views=True)
    first, second = decoded.samples
    assert isinstance(first.routed_experts, Unfetched) and isinstance(first.teacher_log_probs, Unfetched)  # went
    assert isinstance(first.tokens, Unfetched)  # with its tokens, log-probs and mask
    assert isinstance(second.routed_experts, Packed) and isinstance(second.tokens, memoryview)  # all stayed
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
    (lambda w: w["samples"][0]["ofl"][1].__setitem__("rew", [0, 4, "i", [1]]), "not an offloadable field"),
    (lambda w: w["samples"][0].__setitem__("tok", b"\0" * 804), "also in the entry"),  # tok twice
    (lambda w: w["samples"][0].__setitem__("lp", None), "also in the entry"),  # nil beside its spec
    (lambda w: w["samples"][0]["ofl"][1].__setitem__("tok", [0, 800, "i", [200]]), r"pl 1 \+ rlen 200 != 200 tokens"),
    (lambda w: w["samples"][0]["ofl"][1].__setitem__("tok", [0, 804, "i", [202]]), "804 bytes for 202 items"),
    (lambda w: w["samples"][0]["ofl"][1].__setitem__("tok", [0, 4, "f", [1]]), "does not describe an array"),
    (lambda w: w["samples"][0]["ofl"][1].__setitem__("lm", [0, 199, "B", [199]]), "lm has 199 entries for 200"),
    (lambda w: w["samples"][0]["ofl"][1].__setitem__("tok", [0, 4 * 10**9, "i", [10**9]]), "too_large|describe"),
    (lambda w: w["samples"][0]["ofl"][1].pop("tok"), "missing_field|group.samples"),  # tok nowhere
    (lambda w: w["samples"][0].__setitem__("rlen", 300), "rlen 300 outside"),  # lengths vs ofl's tokens
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


def test_an_offloaded_array_is_a_length_known_placeholder_that_refuses_its_values() -> None:
    """Before the fetch every offloaded field (tokens, log-probs and mask as well as R3) is an
    Unfetched: its length and shape serve every length rule, any read of its values raises
    PayloadNotFetched saying how to fetch; the fetch (attach) puts the exact arrays in its place."""
    group = r3_group(n=1)
    data, objects = encode_group_offloaded(group, 1, keys())
    decoded = decode_group(data, views=True)
    sample = decoded.samples[0]
    tokens, routed = sample.tokens, sample.routed_experts
    assert isinstance(tokens, Unfetched) and isinstance(routed, Unfetched)
    assert (len(tokens), tokens.shape, tokens.typecode, tokens.nbytes) == (201, (201,), "i", 804)
    assert sample.prompt_length == 1 and sample.response_length == 200 and len(routed) == 200
    assert sample.rollout_log_probs is not None and sample.loss_mask is not None  # never None: None is "absent"
    reads = [
        lambda: tokens[0], lambda: list(tokens), lambda: tokens.tolist(), lambda: tokens.tobytes(),
        lambda: np.asarray(tokens), lambda: sample.response_tokens, lambda: routed.numpy(),
        lambda: routed.data, lambda: 3 in tokens, lambda: encode_group(decoded), lambda: routed.rows(3),
        lambda: list(reversed(tokens)), lambda: tokens.cast("B"), lambda: Packed.of(routed),  # type: ignore[arg-type]
    ]
    if sys.version_info >= (3, 12):  # the buffer protocol of a Python class (PEP 688)
        reads.append(lambda: memoryview(tokens))
    for read in reads:
        with pytest.raises(PayloadNotFetched, match=r"Sample\.\w+ .* not fetched.*await batch\.fetch\(\)") as info:
            read()
        assert isinstance(info.value, PayloadError) and info.value.key == objects[0].ref.key
    assert decoded.payload is not None
    decoded.payload.attach(decoded, {objects[0].ref.key: memoryview(b"".join(bytes(p) for p in objects[0].parts))})
    assert sample.tokens.tolist() == list(range(201)) and sample.loss_mask.tolist() == [1] * 200  # type: ignore[union-attr]
    decoded.payload = None
    assert decoded == group


def test_an_archive_row_of_a_group_whose_objects_were_not_read_says_so_and_keeps_its_lengths() -> None:
    """The archiver reads a group's objects before writing its row; when they cannot be read the
    row keeps the entry as it came (refs included), says why in ``decode_error``, and its samples
    keep their lengths, not a short or empty token list."""
    from rollstream.common.archive_schema import ArchiveRecord, record_row

    fields, _ = group_fields_offloaded(r3_group(n=1), 1, keys())
    record = ArchiveRecord("1-0", "trained", "", "t", 0, 0, "groups", 0, 0, "5-0", 0, {b"data": fields["data"]})
    row = record_row(record)
    assert row["decode_error"] and "payload store" in row["decode_error"] and row["data"] == fields["data"]
    [cells] = row["samples"]
    assert cells["tokens"] is None and cells["loss_mask"] is None and cells["rollout_log_probs"] is None
    assert (cells["prompt_length"], cells["response_length"]) == (1, 200)
