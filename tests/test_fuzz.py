"""Fuzzing the decoder: whatever bytes reach it, the only error it may raise is DecodeError.

A group entry is written by any producer (or by hand with redis-cli); the trainer must turn
garbage into a dead-letter entry with a reason, never crash on an IndexError or a MemoryError.
"""

from __future__ import annotations

from array import array
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollstream.common.codec import (
    DEFAULT_LIMITS,
    CodecLimits,
    decode_group,
    decode_group_entry,
    decode_prompt,
    encode_group,
    encode_prompt,
)
from rollstream.common.errors import DecodeError
from rollstream.common.models import Group, Prompt, Sample, Status

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SMALL = CodecLimits(max_payload_bytes=1 << 16, max_samples=8, max_tokens=256, max_string_bytes=1 << 12,
                    max_container_len=64)


def _group() -> Group:
    samples = [
        Sample(index=i, tokens=array("i", [1, 2, 3, 4 + i]), response="\\boxed{4}", response_length=2,
               reward=1.0, status=Status.COMPLETED, finish_reason="stop", weight_versions=[3],
               rollout_log_probs=array("f", [-0.1, -0.2]), loss_mask=array("B", [1, 1]), metadata={"e": "x"})
        for i in range(2)
    ]
    return Group(index=7, epoch=0, attempt=1, prompt="2+2?", label="4", metadata={"k": 1},
                 producer="p-1", samples=samples)


def _prompt() -> Prompt:
    return Prompt(index=3, prompt=[{"role": "user", "content": "hi"}], label={"a": 1}, epoch=1, attempt=2,
                  metadata={"m": [1, 2]}, input_ids=array("i", [5, 6]), partial=_group().samples,
                  history=["aborted"])


GROUP_BYTES = encode_group(_group())
PROMPT_BYTES = encode_prompt(_prompt())


def _decode_all(payload: Any) -> None:
    """Every decoder on ``payload``: each either succeeds or raises DecodeError."""
    for decode in (decode_group, decode_prompt):
        for limits in (SMALL, None):
            try:
                decode(payload) if limits is None else decode(payload, limits)
            except DecodeError:
                pass
    for limits in (SMALL, DEFAULT_LIMITS):
        _views_agree(payload, limits)
    for fields in ({b"data": payload}, {"data": payload}, {b"index": b"1"}, {b"data": payload, b"x": b""}):
        try:
            decode_group_entry(fields, SMALL)
        except DecodeError:
            pass


def _views_agree(payload: Any, limits: CodecLimits) -> None:
    """The zero-copy decoder accepts exactly what the copying one does, with the same result or reason."""
    try:
        copied = decode_group(payload, limits)
    except DecodeError as exc:
        with pytest.raises(DecodeError) as info:
            decode_group(payload, limits, views=True)
        assert info.value.reason == exc.reason
        return
    # compared encoded: equal bytes whatever the values (a NaN label is not equal to itself)
    assert encode_group(decode_group(payload, limits, views=True)) == encode_group(copied)


def test_valid_payloads_round_trip() -> None:
    assert decode_group(GROUP_BYTES).samples[1].tokens == array("i", [1, 2, 3, 5])
    assert decode_prompt(PROMPT_BYTES).history == ["aborted"]


@FUZZ
@given(st.binary(max_size=2048))
def test_arbitrary_bytes(payload: bytes) -> None:
    _decode_all(payload)


@FUZZ
@given(st.sampled_from([GROUP_BYTES, PROMPT_BYTES]), st.lists(st.integers(min_value=0), min_size=1, max_size=8))
def test_bit_flips_of_real_payloads(payload: bytes, positions: list[int]) -> None:
    mutated = bytearray(payload)
    for position in positions:
        bit = position % (len(mutated) * 8)
        mutated[bit // 8] ^= 1 << (bit % 8)
    _decode_all(bytes(mutated))


@FUZZ
@given(st.sampled_from([GROUP_BYTES, PROMPT_BYTES]), st.integers(min_value=0), st.binary(max_size=16))
def test_truncated_and_spliced_payloads(payload: bytes, cut: int, splice: bytes) -> None:
    cut %= len(payload)
    _decode_all(payload[:cut])
    _decode_all(payload[:cut] + splice + payload[cut + len(splice):])


_leaves = (
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True) | st.text(max_size=20) | st.binary(max_size=40)
)
_values = st.recursive(
    _leaves,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=30,
)


@FUZZ
@given(_values)
def test_random_msgpack_structures(value: Any) -> None:
    _decode_all(msgpack.packb(value, use_bin_type=True))


def _mutate(obj: Any, key: str, value: Any) -> bytes:
    return msgpack.packb({**obj, key: value}, use_bin_type=True)


GROUP_OBJ = msgpack.unpackb(GROUP_BYTES, raw=False)
PROMPT_OBJ = msgpack.unpackb(PROMPT_BYTES, raw=False)


@FUZZ
@given(st.sampled_from(sorted(GROUP_OBJ)), _values)
def test_group_with_one_field_replaced(key: str, value: Any) -> None:
    _decode_all(_mutate(GROUP_OBJ, key, value))


@FUZZ
@given(st.sampled_from(sorted(PROMPT_OBJ)), _values)
def test_prompt_with_one_field_replaced(key: str, value: Any) -> None:
    _decode_all(_mutate(PROMPT_OBJ, key, value))


@FUZZ
@given(st.sampled_from(sorted(GROUP_OBJ["samples"][0])), _values, st.integers(min_value=0, max_value=1))
def test_sample_with_one_field_replaced(key: str, value: Any, which: int) -> None:
    samples = [dict(s) for s in GROUP_OBJ["samples"]]
    samples[which][key] = value
    _decode_all(_mutate(GROUP_OBJ, "samples", samples))


@FUZZ
@given(st.sampled_from(sorted(GROUP_OBJ["samples"][0])), _values)
def test_partial_sample_of_prompt_replaced(key: str, value: Any) -> None:
    partial = [dict(s) for s in PROMPT_OBJ["partial"]]
    partial[0][key] = value
    _decode_all(_mutate(PROMPT_OBJ, "partial", partial))


@pytest.mark.parametrize(
    "payload",
    [
        msgpack.packb({**GROUP_OBJ, "samples": [GROUP_OBJ["samples"][0]] * 9}, use_bin_type=True),
        msgpack.packb({**GROUP_OBJ, "prompt": "x" * 5000}, use_bin_type=True),
        msgpack.packb([0] * 100, use_bin_type=True),
        b"\xdd\xff\xff\xff\xff",  # array32 header claiming 4G items
        b"\xdf\xff\xff\xff\xff",  # map32 header claiming 4G pairs
        b"\xc6\xff\xff\xff\xff",  # bin32 header claiming 4 GB
        b"\xc9\x00\x00\x00\x01\x01\x00",  # ext32
        b"\xc1",  # never-used type byte
    ],
)
def test_oversized_and_hostile_headers_are_decode_errors(payload: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_group(payload, SMALL)
