"""Wire format v3: every field slime and miles train on, through the codec, Redis, both
frameworks' ``Sample`` and a reproduction of their train-data conversion."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from array import array
from typing import Any

import msgpack
import numpy as np
import pytest
from conftest import make_namespace
from integration_helpers import STANDINS  # noqa: F401  (puts the stand-ins on sys.path)
from redis.asyncio import Redis
from rollstream.common.codec import decode_group, decode_prompt, encode_group, encode_prompt, group_fields
from rollstream.common.errors import DecodeError, InvalidResult
from rollstream.common.keys import Keys
from rollstream.common.models import SAMPLE_FIELDS, Group, Packed, Sample, Status, retry_prompt
from rollstream.common.sample_fields import SampleField
from rollstream.consumer import GroupConsumer
from rollstream.integrations.convert import MILES, SLIME, Framework, from_framework, to_framework
from rollstream.producer.checks import check_sample
from rollstream.testing.samples import example_value, full_group, full_sample

V3_FIELDS = (
    "routed_experts", "indexer_topk", "top_p_token_ids", "top_p_token_offsets", "teacher_log_probs",
    "opd_reverse_kl", "remove_sample", "train_metadata", "rollout_id", "spec_info", "prefix_cache_info",
    "non_generation_time", "adapter", "multimodal_train_inputs",
)


def _plain(sample: Sample) -> Sample:
    """``sample`` with every version-3 field at its default."""
    defaults = {f.name: f.default for f in dataclasses.fields(Sample) if f.name in V3_FIELDS}
    return dataclasses.replace(sample, **defaults)


def test_every_field_of_the_data_model_is_covered_here() -> None:
    """A field added to Sample without a wire key (and a test here) fails this test."""
    v2 = {"index", "tokens", "response", "response_length", "prompt_length", "reward", "status", "finish_reason",
          "weight_versions", "rollout_log_probs", "loss_mask", "error", "metadata", "weight_version_spans"}
    assert {f.name for f in dataclasses.fields(Sample)} == v2 | set(V3_FIELDS)
    sample = full_sample(1)
    defaults = {f.name: f.default for f in dataclasses.fields(Sample) if f.name in V3_FIELDS}
    assert all(getattr(sample, name) != default for name, default in defaults.items()), "full_sample sets them all"


@pytest.mark.parametrize("views", [False, True], ids=["copy", "views"])
def test_every_field_round_trips_through_the_codec(views: bool) -> None:
    group = full_group()
    decoded = decode_group(encode_group(group), views=views)
    assert decoded == group
    for name in V3_FIELDS:
        assert getattr(decoded.samples[1], name) == getattr(group.samples[1], name), name
    assert decoded.multimodal_inputs == group.multimodal_inputs
    experts = decoded.samples[0].routed_experts
    assert experts is not None and experts.shape == (10, 3, 2) and experts.typecode == "B"
    kind = memoryview if views else array
    for s in decoded.samples:
        for packed in (s.routed_experts, s.indexer_topk, s.top_p_token_ids, s.top_p_token_offsets):
            assert isinstance(packed, Packed) and isinstance(packed.data, kind)
        assert isinstance(s.teacher_log_probs, kind) and isinstance(s.opd_reverse_kl, kind)


def test_prompts_carry_the_fields_of_their_partial_samples_and_media() -> None:
    group = full_group(2)
    prompt = retry_prompt(group, "aborted", keep_partial=True)
    decoded = decode_prompt(encode_prompt(prompt))
    assert decoded.partial == group.samples
    assert decoded.multimodal_inputs == {"images": ["data:image/png;base64,AA=="]}


def test_unset_fields_cost_nothing_on_the_wire() -> None:
    group = full_group(2)
    plain = dataclasses.replace(group, samples=[_plain(s) for s in group.samples], multimodal_inputs=None)
    payload = encode_group(plain)
    obj = msgpack.unpackb(payload)
    # no version-3 field: version 2, exactly the keys the previous build wrote
    assert obj["v"] == 2 and "mmi" not in obj
    assert [sorted(s) for s in obj["samples"]] == [
        sorted(["i", "tok", "resp", "rlen", "pl", "rew", "st", "fr", "wv", "lp", "lm", "err", "md"])
    ] * 2
    # each field set adds its own key and nothing else
    for name in V3_FIELDS:
        samples = [dataclasses.replace(plain.samples[0], **{name: getattr(group.samples[1], name)}), plain.samples[1]]
        one = msgpack.unpackb(encode_group(dataclasses.replace(plain, samples=samples)))
        assert one["v"] == 3
        assert len(one["samples"][0]) == 14 and len(one["samples"][1]) == 13, name


@pytest.mark.parametrize(("experts", "code", "itemsize"), [(256, "B", 1), (257, "H", 2), (70_000, "i", 4)])
def test_packed_arrays_travel_in_their_smallest_exact_dtype(experts: int, code: str, itemsize: int) -> None:
    rows, layers, topk = 99, 4, 2
    values = np.random.default_rng(0).integers(0, experts, size=(rows, layers, topk), dtype=np.int64)
    values[0, 0, 0] = experts - 1
    sample = Sample(index=0, tokens=list(range(rows + 1)), response_length=10, routed_experts=values)
    assert sample.routed_experts is not None and sample.routed_experts.typecode == code
    payload = encode_group(Group(index=0, prompt="p", samples=[sample]))
    wire = msgpack.unpackb(payload)["samples"][0]["re"]
    assert wire[0] == code and wire[1] == [rows, layers, topk] and len(wire[2]) == rows * layers * topk * itemsize
    decoded = decode_group(payload, views=True).samples[0].routed_experts
    assert decoded is not None
    np.testing.assert_array_equal(decoded.numpy(), values)
    assert Packed.of([-1, 5]).typecode == "i"  # negative ids (padding) keep int32
    flat = Packed.of(array("i", [1, 2, 300]))  # a flat packed array: one dimension, narrowed
    assert (flat.shape, flat.typecode, flat.tolist()) == ((3,), "H", [1, 2, 300])
    assert Packed.of(np.zeros((2, 3), dtype=np.float64)).typecode == "f"
    with pytest.raises(ValueError, match="int32"):
        Packed.of([2**31])


def test_numpy_views_of_take_share_the_payload_memory() -> None:
    group = full_group(2)
    payload = encode_group(group)
    decoded = decode_group(payload, views=True)
    base = np.frombuffer(payload, dtype=np.uint8)
    experts = decoded.samples[0].routed_experts
    assert experts is not None
    view = experts.numpy()
    assert np.shares_memory(view, base) and not view.flags.writeable
    assert view.shape == (10, 3, 2) and view.dtype == np.uint8
    assert np.shares_memory(np.frombuffer(decoded.samples[0].teacher_log_probs, dtype=np.float32), base)


def _mutate(obj: dict[str, Any], key: str, value: Any) -> bytes:
    obj["samples"][0][key] = value
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("re", ["B", [9, 3, 2], bytes(54)], "re has 9 rows"),
        ("re", ["q", [10, 3, 2], bytes(480)], "typecode"),
        ("re", ["B", [10, 3, 2], bytes(59)], "60 values|59 values"),
        ("re", ["B", [10, 6], bytes(60)], "shape"),
        ("re", b"raw", r"\[typecode, shape, bin\]"),
        ("ix", ["H", [9, 2, 4], bytes(144)], "ix has 9 rows"),
        ("tpo", ["B", [5], bytes(5)], "tpo: 5 offsets"),
        ("tlp", array("f", [0.0] * 4).tobytes(), "tlp has 4 entries"),
        ("kl", b"abc", "multiple of 4"),
        ("rm", 1, "rm must be a bool"),
        ("tm", [1], "tm must be a map"),
        ("rid", "x", "rid must be an int"),
        ("spec", {"a": "b"}, "spec must be a map of ints"),
        ("ngt", float("nan"), "finite"),
        ("ad", ["x"], r"ad must be \[name, slot\]"),
        ("mti", {"a": 1}, "mti must be"),
    ],
)
@pytest.mark.parametrize("views", [False, True], ids=["copy", "views"])
def test_malformed_version_3_fields_are_decode_errors(key: str, value: Any, match: str, views: bool) -> None:
    obj = msgpack.unpackb(encode_group(full_group(1)))
    with pytest.raises(DecodeError, match=match):
        decode_group(_mutate(obj, key, value), views=views)


def test_top_p_replay_needs_both_arrays() -> None:
    obj = msgpack.unpackb(encode_group(full_group(1)))
    del obj["samples"][0]["tpo"]
    with pytest.raises(DecodeError, match="needs both"):
        decode_group(msgpack.packb(obj, use_bin_type=True))


async def test_every_field_round_trips_through_redis_and_take(redis: Redis, redis_url: str, ns: str) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=4, batch_size=2)
    groups = [full_group(4, index=i) for i in range(2)]
    for group in groups:
        await redis.xadd(Keys(ns).groups, group_fields(group))
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        async with asyncio.timeout(20):
            batch = await consumer.take(2)
        assert batch.groups == groups
        experts = batch.routed_experts_numpy()
        assert len(experts) == 8
        for got, sample in zip(experts, [s for g in groups for s in g.samples], strict=True):
            assert got is not None and sample.routed_experts is not None
            np.testing.assert_array_equal(got, np.array(sample.routed_experts.tolist(), dtype=np.uint8))
            assert got.base is not None and not got.flags.writeable  # a view on the entry, not a copy
        indexer = batch.indexer_topk_numpy()[0]
        assert indexer is not None and indexer.dtype == np.uint16
        top_p = batch.top_p_numpy()[3]
        assert top_p is not None and top_p[1][0] == 0 and top_p[1][-1] == len(top_p[0])
        teacher = batch.teacher_log_probs_numpy()[2]
        assert teacher is not None and teacher.tolist() == [-0.5, -1.0, -1.5, -2.0, -2.5]
        kl = batch.opd_reverse_kl_numpy()[0]
        assert kl is not None and len(kl) == 5
        await consumer.commit(batch)


@pytest.mark.parametrize("framework", [SLIME, MILES], ids=["slime", "miles"])
def test_every_field_round_trips_through_the_framework_sample(framework: Framework) -> None:
    group = full_group(4)
    sample_cls = framework.sample_class()
    converted = to_framework(group, sample_cls)
    back = from_framework(converted)
    assert back == group
    for name in V3_FIELDS:
        assert [getattr(s, name) for s in back.samples] == [getattr(s, name) for s in group.samples], name
    fw = converted[1]
    assert fw.rollout_routed_experts.dtype == np.int32 and fw.rollout_routed_experts.shape == (10, 3, 2)
    assert fw.remove_sample is True and fw.train_metadata == {"loss": "opd", "weight": 0.5}
    assert fw.rollout_id == 7 * 4 + 0 and converted[2].rollout_id == 7 * 4 + 1  # siblings share it
    assert fw.spec_info.spec_accept_token_num == 3 and fw.prefix_cache_info.cached_tokens == 2
    assert fw.non_generation_time == 0.75
    assert fw.multimodal_inputs == {"images": ["data:image/png;base64,AA=="]}
    assert fw.multimodal_train_inputs["pixel_values"].shape == (2, 6)
    if framework is MILES:
        assert fw.adapter == type(fw.adapter)(name="math-lora", slot=1)
        assert fw.rollout_indexer_topk.shape == (10, 2, 4) and fw.opd_reverse_kl == [0.0, 0.125, 0.25, 0.375, 0.5]
    else:
        assert len(fw.rollout_top_p_token_offsets) == 6 and fw.teacher_log_probs[0] == -0.5


PUBLISHED_FIELDS = {
    # dataclasses.fields(Sample) of slime @ 624b824 and miles @ 31f1ca9 (slime/utils/types.py,
    # miles/utils/types.py): the stand-ins must have exactly these
    "slime": ["group_index", "index", "rollout_id", "prompt", "tokens", "multimodal_inputs",
              "multimodal_train_inputs", "multimodal_train_input_id", "apply_chat_template_kwargs", "response",
              "response_length", "label", "reward", "loss_mask", "weight_versions", "rollout_log_probs",
              "rollout_top_p_token_ids", "rollout_top_p_token_offsets", "rollout_routed_experts", "remove_sample",
              "teacher_log_probs", "status", "metadata", "generate_function_path", "custom_rm_path",
              "train_metadata", "session_id", "non_generation_time", "spec_info", "prefix_cache_info"],
    "miles": ["group_index", "index", "rollout_id", "prompt", "tokens", "multimodal_inputs",
              "multimodal_train_inputs", "response", "response_length", "label", "reward", "loss_mask",
              "weight_versions", "rollout_log_probs", "rollout_routed_experts", "rollout_indexer_topk",
              "remove_sample", "teacher_log_probs", "opd_reverse_kl", "status", "metadata",
              "generate_function_path", "train_metadata", "adapter", "reward_spec", "routing_key",
              "non_generation_time", "spec_info", "prefix_cache_info"],
}


@pytest.mark.parametrize("framework", [SLIME, MILES], ids=["slime", "miles"])
def test_the_stand_ins_have_every_published_field(framework: Framework) -> None:
    assert [f.name for f in dataclasses.fields(framework.sample_class())] == PUBLISHED_FIELDS[framework.name]


def _r3_args() -> argparse.Namespace:
    return argparse.Namespace(reward_key="score", rollout_top_p=0.9, use_rollout_routing_replay=True,
                              num_layers=3, moe_router_topk=2)


def test_slime_train_data_conversion_reads_every_key_with_the_right_length() -> None:
    from slime.ray.rollout import convert_samples_to_train_data

    groups = [full_group(4, index=i) for i in range(2)]
    samples = [s for g in groups for s in to_framework(g, SLIME.sample_class(), for_training=True)]
    data = convert_samples_to_train_data(_r3_args(), samples)
    ours = [s for g in groups for s in g.samples]
    for key in ("tokens", "response_lengths", "rewards", "raw_reward", "truncated", "sample_indices", "rollout_ids",
                "loss_masks", "rollout_mask_sums", "round_number", "rollout_log_probs", "rollout_top_p_token_ids",
                "rollout_top_p_token_offsets", "rollout_routed_experts", "metadata", "multimodal_train_inputs",
                "teacher_log_probs", "source_names"):
        assert len(data[key]) == 8, key
    for i, s in enumerate(ours):
        assert len(data["tokens"][i]) == len(s.tokens)
        assert data["rollout_routed_experts"][i].shape == (len(s.tokens) - 1, 3, 2)
        assert len(data["teacher_log_probs"][i]) == s.response_length
        assert len(data["rollout_top_p_token_offsets"][i]) == s.response_length + 1
        assert data["loss_masks"][i] == ([0] * s.response_length if s.remove_sample else list(s.loss_mask or []))
    assert data["source_names"] == ["vqa"] * 8
    assert len(set(data["rollout_ids"])) == 4  # two samples per rollout execution, in each group


def test_miles_train_data_conversion_reads_every_key_with_the_right_length() -> None:
    from miles.ray.rollout.train_data_conversion import convert_samples_to_train_data

    groups = [full_group(4, index=i) for i in range(2)]
    samples = [s for g in groups for s in to_framework(g, MILES.sample_class(), for_training=True)]
    for s in samples:
        s.metadata["adapter_global_batch_size"] = 8
    data = convert_samples_to_train_data(_r3_args(), samples, {"step_slots": [1]})
    for key in ("tokens", "response_lengths", "rewards", "raw_reward", "truncated", "sample_indices", "rollout_ids",
                "loss_masks", "rollout_mask_sums", "round_number", "rollout_log_probs", "rollout_routed_experts",
                "rollout_indexer_topk", "metadata", "multimodal_train_inputs", "weight_versions", "teacher_log_probs",
                "adapter_slots", "opd_reverse_kl"):
        assert len(data[key]) == 8, key
    ours = [s for g in groups for s in g.samples]
    for i, s in enumerate(ours):
        assert data["rollout_indexer_topk"][i].shape == (len(s.tokens) - 1, 2, 4)
        assert len(data["opd_reverse_kl"][i]) == s.response_length
    assert data["adapter_slots"] == [1] * 8 and data["step_adapter_batch_sizes"] == {1: 8}


# -- the fields declared once (common/sample_fields.py, docs/architecture.md "where a change goes") --


def test_every_layer_derives_the_fields_from_the_one_table() -> None:
    """The codec's keys, its zero-copy struct and the batch's numpy views follow SAMPLE_FIELDS."""
    from rollstream.common.codec import decode, encode, wire, zero_copy
    from rollstream.common.models import SAMPLE_FIELDS
    from rollstream.consumer import batch

    assert [f.name for f in SAMPLE_FIELDS] == [f.name for f in dataclasses.fields(Sample)]
    assert len({f.key for f in SAMPLE_FIELDS}) == len(SAMPLE_FIELDS), "one wire key per field"
    assert wire.V3_SAMPLE_KEYS == tuple(f.key for f in SAMPLE_FIELDS if f.since >= 3)
    # plus ``ofl``: where a version-4 sample's offloaded arrays are (not a field: docs/wire.md)
    assert zero_copy._SampleView.__struct_fields__ == (*(f.key for f in SAMPLE_FIELDS), "ofl")
    assert set(batch._VIEWS) == {f.name for f in SAMPLE_FIELDS if f.numpy}
    kinds = {f.kind for f in SAMPLE_FIELDS}
    assert kinds <= set(decode._FROM_WIRE) and kinds <= set(encode._TO_WIRE)
    from rollstream.integrations import convert

    assert {f.kind for f in SAMPLE_FIELDS if f.framework} <= set(convert._TO_FRAMEWORK)
    # each kind's way into the framework sample has its way back (generate functions' samples)
    assert set(convert._FROM_FRAMEWORK) == set(convert._TO_FRAMEWORK)
    sample = full_sample(1)
    encoded = encode._sample_to_wire(sample)
    assert list(encoded) == [f.key for f in SAMPLE_FIELDS if not f.optional or f.is_set(getattr(sample, f.name))]


def test_no_layer_spells_a_version_3_wire_key_or_framework_field() -> None:
    """A field's key and framework name are written once, in its declaration: the codec, the
    conversion and the batch read them from the table (a hand-written branch would fail here)."""
    import re
    from pathlib import Path

    from rollstream.common.models import SAMPLE_FIELDS

    root = Path(__file__).resolve().parent.parent
    keys = {f.key for f in SAMPLE_FIELDS if f.since >= 3}
    framework = {f.framework for f in SAMPLE_FIELDS if f.framework}
    # (the batch's named shortcuts, tokens_numpy() & co., spell our field names: those are allowed)
    for path, spelled in [*((p, keys | framework) for p in (root / "common" / "codec").glob("*.py")),
                          (root / "integrations" / "convert.py", keys | framework),
                          (root / "integrations" / "generate.py", keys | framework),
                          (root / "consumer" / "batch.py", keys)]:
        literals = set(re.findall(r"\"([a-z_]+)\"", path.read_text()))
        assert not literals & spelled, f"{path.name} spells {sorted(literals & spelled)}"


def test_metadata_maps_keep_any_plain_value() -> None:
    sample = dataclasses.replace(full_sample(0), metadata={"ok": True, "n": None}, train_metadata={"kl": False})
    for views in (False, True):
        decoded = decode_group(encode_group(Group(index=0, prompt="p", samples=[sample])), views=views).samples[0]
        assert decoded.metadata == {"ok": True, "n": None} and decoded.train_metadata == {"kl": False}


def test_batch_numpy_views_serve_every_declared_field() -> None:
    from rollstream.common.errors import ConfigError
    from rollstream.common.models import SAMPLE_FIELDS
    from rollstream.consumer.batch import Batch

    group = decode_group(encode_group(full_group(2)), views=True)
    batch = Batch(id="b", groups=[group], entry_ids=[b"1-0"])
    for f in SAMPLE_FIELDS:
        if f.numpy:
            got = batch.numpy_views(f.name)
            want = [getattr(s, f.name) for s in group.samples]
            assert [None if g is None else g.tolist() for g in got] == [
                None if w is None else w.tolist() for w in want], f.name
    assert [a.tolist() for a in batch.tokens_numpy()] == [s.tokens.tolist() for s in group.samples]
    with pytest.raises(ConfigError, match="no numpy view"):
        batch.numpy_views("reward")


# -- a framework Sample a generate function returns, back as ours (integrations/generate.py) --


@dataclasses.dataclass
class _Info:
    index: int
    n: int
    admitted_version: int = 0


@dataclasses.dataclass
class _Episode:
    info: _Info


def _from_framework(fw: Any, group: Group, member: int) -> Sample:
    from rollstream.integrations.generate import from_framework_sample

    episode = _Episode(_Info(group.index, len(group.samples)))
    return from_framework_sample(fw, member, None, episode)  # type: ignore[arg-type]


MAPPED = tuple(f for f in SAMPLE_FIELDS if f.framework)
"""The fields declared with a framework counterpart: the round trip below covers a new one."""


@pytest.mark.parametrize("framework", [SLIME, MILES], ids=["slime", "miles"])
def test_a_framework_sample_a_generate_function_returns_keeps_every_mapped_field(framework: Framework) -> None:
    """Ours -> the framework's (convert.py) -> ours (generate.py): every field the framework has
    comes back; one it lacks comes back unset (nothing invented)."""
    group = full_group(4)
    names = {f.name for f in dataclasses.fields(framework.sample_class())}
    for original, fw in zip(group.samples, to_framework(group, framework.sample_class()), strict=True):
        back = _from_framework(fw, group, original.index)
        for f in MAPPED:
            want = getattr(original, f.name) if f.framework in names else f.unset
            assert getattr(back, f.name) == want, f.name
        for name in ("tokens", "response", "response_length", "prompt_length", "reward", "status", "finish_reason",
                     "weight_versions", "rollout_log_probs", "loss_mask", "error"):
            assert getattr(back, name) == getattr(original, name), name
        assert check_sample(back) is None


@pytest.mark.parametrize("rollout_id", [None, 7 * 2 + 1, 7, 3], ids=["unset", "its-index", "group-index", "other"])
def test_the_rollout_id_a_generate_function_sets_reaches_the_trainer_as_it_was(rollout_id: int | None) -> None:
    group = full_group(2)
    fw = to_framework(group, SLIME.sample_class())[1]
    fw.rollout_id = rollout_id
    back = _from_framework(fw, group, 1)
    again = to_framework(dataclasses.replace(group, samples=[group.samples[0], back]), SLIME.sample_class())[1]
    assert again.rollout_id == (fw.index if rollout_id is None else rollout_id)


def _per_token_cases() -> list[Any]:
    cases = []
    for framework in (SLIME, MILES):
        names = {f.name for f in dataclasses.fields(framework.sample_class())}
        for f in MAPPED:
            if f.length is not None and f.framework in names:
                cases.append(pytest.param(framework, str(f.framework), f.name, id=f"{framework.name}-{f.name}"))
        cases.append(pytest.param(framework, "loss_mask", "loss_mask", id=f"{framework.name}-loss_mask"))
    return cases


@pytest.mark.parametrize(("framework", "attribute", "name"), _per_token_cases())
def test_a_per_token_field_of_the_wrong_length_is_an_invalid_result(
    framework: Framework, attribute: str, name: str
) -> None:
    """One entry short is refused with the field's name, not truncated or dropped (the trainer's
    decoder would refuse the whole group)."""
    group = full_group(2)
    fw = to_framework(group, framework.sample_class())[0]
    setattr(fw, attribute, getattr(fw, attribute)[:-1])
    with pytest.raises(InvalidResult, match=name):
        _from_framework(fw, group, 0)


@pytest.mark.parametrize(
    ("attribute", "value", "match"),
    [
        ("train_metadata", [1], "train_metadata: a list, not a dict"),
        ("rollout_id", "5", "rollout_id: 'str' object cannot be interpreted as an integer"),
        ("non_generation_time", float("inf"), "non_generation_time"),
        ("rollout_routed_experts", np.zeros((10, 6), dtype=np.int32), "not 3 dimensions"),
        ("multimodal_train_inputs", ["x"], "multimodal_train_inputs: a list"),
    ],
)
def test_a_declared_field_that_cannot_be_ours_is_an_invalid_result(attribute: str, value: Any, match: str) -> None:
    group = full_group(2)
    fw = to_framework(group, MILES.sample_class())[0]
    setattr(fw, attribute, value)
    with pytest.raises(InvalidResult, match=match):
        _from_framework(fw, group, 0)


@pytest.mark.parametrize("field", [f for f in SAMPLE_FIELDS if f.length is not None], ids=lambda f: f.name)
@pytest.mark.parametrize("status", [Status.COMPLETED, Status.FAILED], ids=["completed", "failed"])
def test_check_sample_refuses_a_length_the_decoder_would(field: SampleField, status: Status) -> None:
    """Before publish, not on the trainer's side where the whole group would fail to decode."""
    sample = dataclasses.replace(full_sample(0), status=status)
    assert check_sample(sample) is None
    short = example_value(field, len(sample.tokens) - 1, sample.response_length - 1)  # one short
    problem = check_sample(dataclasses.replace(sample, **{field.name: short}))
    assert problem is not None and (field.name in problem or field.name == "loss_mask"), problem


def test_media_a_generate_function_returns_must_be_plain_data_or_tensors() -> None:
    """Processed media now comes back from a framework sample: an object the codec cannot encode
    fails the sample before publish (it would stop the producer at publish otherwise)."""
    group = full_group(2)
    fw = to_framework(group, MILES.sample_class())[0]
    fw.multimodal_train_inputs = {**fw.multimodal_train_inputs, "image": object()}
    back = _from_framework(fw, group, 0)
    assert isinstance(back.multimodal_train_inputs["pixel_values"], Packed)
    assert "multimodal_train_inputs is not plain data" in (check_sample(back) or "")
