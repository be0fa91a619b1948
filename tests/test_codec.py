"""The codec: round trips, packed arrays, bounded and strict decoding."""

from __future__ import annotations

import math
from array import array
from typing import Any

import msgpack
import pytest
from rollstream.common.codec import (
    SCHEMA_VERSION,
    CodecLimits,
    decode_group,
    decode_group_entry,
    decode_prompt,
    decode_prompt_entry,
    encode_group,
    encode_prompt,
    group_fields,
    prompt_fields,
)
from rollstream.common.errors import DecodeError
from rollstream.common.models import Group, Prompt, Sample, Status, retry_prompt


def make_group(n: int = 4, tokens: int = 100) -> Group:
    samples = [
        Sample(
            index=i,
            tokens=list(range(10)) + [1000 + j for j in range(tokens)],
            response="x" * tokens,
            response_length=tokens,
            reward={"score": 1.0, "format": 0.5} if i == 0 else float(i),
            status=Status.TRUNCATED if i == 1 else Status.COMPLETED,
            finish_reason="length" if i == 1 else "stop",
            weight_versions=[3, 4],
            rollout_log_probs=[-0.5] * tokens,
            loss_mask=[1] * tokens if i == 2 else None,
            metadata={"engine": "http://e"},
        )
        for i in range(n)
    ]
    return Group(index=42, prompt=[{"role": "user", "content": "hi"}], samples=samples, label="7",
                 epoch=2, attempt=1, metadata={"source": "t"}, producer="p-1")


def test_group_round_trip_keeps_every_field() -> None:
    group = make_group()
    decoded = decode_group(encode_group(group))
    assert decoded == group
    assert decoded.samples[0].reward == {"score": 1.0, "format": 0.5}
    assert decoded.samples[1].status is Status.TRUNCATED
    assert decoded.samples[0].rollout_log_probs is not None
    assert decoded.samples[0].rollout_log_probs.tolist() == [-0.5] * 100
    assert decoded.samples[2].loss_mask is not None and decoded.samples[3].loss_mask is None
    assert decoded.min_version == 3
    assert decoded.samples[0].prompt_length == 10


def test_recycle_history_travels_with_the_group() -> None:
    group = make_group(1)
    group.history = ["aborted", "stale: staleness 3 > 1"]
    assert decode_group(encode_group(group)).history == ["aborted", "stale: staleness 3 > 1"]


def test_prompt_round_trip_with_partial_state() -> None:
    partial = make_group(2).samples
    prompt = Prompt(index=5, prompt="What is 2 + 2?", label=4, epoch=1, attempt=2,
                    metadata={"k": [1, 2]}, input_ids=[1, 2, 3], partial=partial, history=["aborted"])
    decoded = decode_prompt(encode_prompt(prompt))
    assert decoded.index == 5 and decoded.attempt == 2 and decoded.label == 4
    assert decoded.input_ids is not None and decoded.input_ids.tolist() == [1, 2, 3]
    assert decoded.partial == partial
    assert decoded.history == ["aborted"]


def test_tokens_travel_as_packed_little_endian_arrays() -> None:
    group = make_group(n=8, tokens=8192)
    payload = encode_group(group)
    raw = msgpack.unpackb(payload)
    assert isinstance(raw["samples"][0]["tok"], bytes)
    assert raw["samples"][0]["tok"][:8] == array("i", [0, 1]).tobytes()
    per_token = len(payload) / (8 * 8202)
    assert per_token < 4 + 4 + 1 + 0.2  # ids + log-probs + the 1-char response text + overhead


def test_entry_fields_are_readable_without_msgpack() -> None:
    fields = group_fields(make_group())
    assert fields["index"] == 42 and fields["status"] == "truncated"
    assert fields["min_version"] == 3 and fields["producer"] == "p-1" and fields["n"] == 4
    assert math.isclose(float(str(fields["reward_mean"])), (1.0 + 1 + 2 + 3) / 4)
    assert decode_group_entry({b"data": fields["data"]}) == make_group()
    assert set(prompt_fields(Prompt(index=1, prompt="p"))) == {"index", "epoch", "attempt", "data"}


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xc1", "not_msgpack"),
        (b"", "not_msgpack"),
        (msgpack.packb([1, 2]), "bad_field"),
        (msgpack.packb({"v": 99, "kind": "group"}), "unknown_schema"),
        (msgpack.packb({"kind": "group"}), "unknown_schema"),
        (msgpack.packb({"v": SCHEMA_VERSION, "kind": "prompt"}), "wrong_kind"),
        (msgpack.packb({"v": SCHEMA_VERSION, "kind": "group", "index": 1}), "missing_field"),
        (msgpack.packb({"v": SCHEMA_VERSION, "kind": "group", "index": "1", "epoch": 0, "attempt": 0,
                        "prompt": "p", "metadata": {}, "producer": "x", "samples": []}), "bad_field"),
    ],
)
def test_malformed_payloads_raise_decode_error(payload: bytes, reason: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode_group(payload)
    assert info.value.reason == reason


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xc1", "not_msgpack"),
        (msgpack.packb([1, 2]), "bad_field"),
        (msgpack.packb({"v": 99, "kind": "group"}), "unknown_schema"),
        (msgpack.packb({"v": SCHEMA_VERSION, "kind": "group", "index": 1}), "missing_field"),
    ],
)
def test_the_zero_copy_decoder_rejects_with_the_same_reasons(payload: bytes, reason: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode_group(payload, views=True)
    assert info.value.reason == reason


def test_zero_copy_samples_are_views_on_the_payload_and_equal_the_copies() -> None:
    payload = encode_group(make_group())
    viewed = decode_group(payload, views=True)
    assert viewed == decode_group(payload)
    sample = viewed.samples[2]
    assert isinstance(sample.tokens, memoryview) and sample.tokens.obj is payload and sample.tokens.format == "i"
    assert sample.response_tokens.tolist() == [1000 + j for j in range(100)] and len(sample.tokens) == 110
    assert isinstance(sample.rollout_log_probs, memoryview) and sample.rollout_log_probs.format == "f"
    assert isinstance(sample.loss_mask, memoryview) and sample.loss_mask.format == "B"
    # what the consumer does with a group: recycle it (with its partial samples) and re-encode it
    retry = retry_prompt(viewed, "aborted", keep_partial=True)
    assert decode_prompt(encode_prompt(retry)).partial == viewed.samples
    assert encode_group(viewed) == payload
    # a v1 payload (no pl / lm) takes the same path
    raw = msgpack.unpackb(payload)
    raw["v"] = 1
    v1 = msgpack.packb(raw)
    assert decode_group(v1, views=True) == decode_group(v1)


def test_bad_sample_fields_are_rejected() -> None:
    raw = msgpack.unpackb(encode_group(make_group(1)))
    raw["samples"][0]["tok"] = b"\x00\x01\x02"  # not a multiple of 4 bytes
    with pytest.raises(DecodeError, match="multiple of 4"):
        decode_group(msgpack.packb(raw))
    raw = msgpack.unpackb(encode_group(make_group(1)))
    raw["samples"][0]["rlen"] = 10_000  # longer than the tokens
    with pytest.raises(DecodeError, match="rlen"):
        decode_group(msgpack.packb(raw))
    raw = msgpack.unpackb(encode_group(make_group(1)))
    raw["samples"][0]["st"] = "exploded"
    with pytest.raises(DecodeError, match="status"):
        decode_group(msgpack.packb(raw))


def test_oversized_input_is_rejected_before_decoding() -> None:
    payload = encode_group(make_group(n=4, tokens=1000))
    with pytest.raises(DecodeError) as info:
        decode_group(payload, CodecLimits(max_payload_bytes=1000))
    assert info.value.reason == "too_large"
    with pytest.raises(DecodeError) as info:
        decode_group(payload, CodecLimits(max_tokens=100))
    assert info.value.reason == "too_large"
    with pytest.raises(DecodeError) as info:
        decode_group(payload, CodecLimits(max_samples=2))
    assert info.value.reason == "too_large"


def test_missing_data_field_and_unencodable_metadata() -> None:
    with pytest.raises(DecodeError, match="no data"):
        decode_group_entry({b"index": b"1"})
    group = make_group(1)
    group.metadata = {"obj": object()}
    with pytest.raises(ValueError, match="plain data"):
        encode_group(group)


def test_codec_limits_validate() -> None:
    with pytest.raises(ValueError):
        CodecLimits(max_tokens=0)


def _v1_sample(index: int, tokens: list[int], rlen: int, **extra: Any) -> dict[str, Any]:
    """A sample map exactly as schema version 1 wrote it (no pl/err; flags in md)."""
    return {
        "i": index, "tok": array("i", tokens).tobytes(), "resp": "r", "rlen": rlen, "rew": None,
        "st": extra.pop("st", "completed"), "fr": "stop", "wv": [1], "lp": None, "lm": None,
        "md": extra.pop("md", {"engine": "http://e"}),
    }


def test_version_1_groups_still_decode_with_their_flags_as_fields() -> None:
    v1 = msgpack.packb(
        {
            "v": 1, "kind": "group", "index": 3, "epoch": 0, "attempt": 1, "prompt": "p", "label": None,
            "metadata": {}, "producer": "old", "history": ["aborted"],
            "samples": [
                _v1_sample(0, [5, 6, 7, 100, 101], 2),
                _v1_sample(1, [102], 1, md={"engine": "e", "prompt_ids": "unknown"}),
                _v1_sample(2, [5, 6, 7], 0, st="failed", md={"error": "HTTP 400: too long"}),
            ],
        },
        use_bin_type=True,
    )
    group = decode_group_entry({b"index": b"3", b"data": v1})
    known, unknown, failed = group.samples
    assert (known.prompt_length, known.response_tokens.tolist()) == (3, [100, 101])
    assert known.loss_mask is not None and known.loss_mask.tolist() == [1, 1]
    assert unknown.prompt_length == 0 and "prompt_ids" not in unknown.metadata
    assert failed.error == "HTTP 400: too long" and "error" not in failed.metadata
    assert failed.loss_mask is not None and len(failed.loss_mask) == 0
    # re-encoded, it is a version-2 group with the same content
    assert decode_group(encode_group(group)) == group


def test_version_1_prompts_with_partial_samples_still_decode() -> None:
    v1 = msgpack.packb(
        {
            "v": 1, "kind": "prompt", "index": 9, "epoch": 1, "attempt": 2, "prompt": "p", "label": "4",
            "metadata": {"k": 1}, "input_ids": array("i", [5, 6]).tobytes(),
            "partial": [_v1_sample(0, [5, 6, 100], 1, st="aborted")], "history": ["aborted", "aborted"],
        },
        use_bin_type=True,
    )
    prompt = decode_prompt_entry({"data": v1})
    assert (prompt.index, prompt.attempt, prompt.label, prompt.history) == (9, 2, "4", ["aborted", "aborted"])
    assert prompt.input_ids is not None and prompt.input_ids.tolist() == [5, 6]
    assert prompt.partial is not None and prompt.partial[0].prompt_length == 2
    assert prompt.partial[0].status is Status.ABORTED


def test_version_2_checks_the_prompt_length_and_the_loss_mask() -> None:
    group = make_group(1)
    group.samples[0].prompt_length = 3
    with pytest.raises(DecodeError, match="pl 3"):
        decode_group(encode_group(group))
    group = make_group(1)
    group.samples[0].loss_mask = array("B", [1])
    with pytest.raises(DecodeError, match="lm has 1"):
        decode_group(encode_group(group))


def test_a_future_schema_version_is_refused() -> None:
    with pytest.raises(DecodeError, match=f"schema version {SCHEMA_VERSION + 1}"):
        decode_group(msgpack.packb({"v": SCHEMA_VERSION + 1, "kind": "group"}))


def test_retry_prompt_is_the_next_attempt_with_prompt_ids_and_history() -> None:
    group = make_group(2)
    prompt = retry_prompt(group, "aborted", keep_partial=True)
    assert (prompt.index, prompt.attempt, prompt.epoch, prompt.label) == (42, 2, 2, "7")
    assert prompt.input_ids is not None and prompt.input_ids.tolist() == list(range(10))
    assert prompt.history == ["aborted"] and prompt.partial == group.samples
    assert retry_prompt(group, "failed").partial is None
