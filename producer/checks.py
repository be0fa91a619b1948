"""What a generate function may return: :func:`as_samples` (the shape of the result) and
:func:`check_sample` (each sample publishable); a problem fails the sample with the reason."""

from __future__ import annotations

import math
import sys
from typing import Any

import msgpack
from rollstream.common.arrays import Packed
from rollstream.common.codec import check_lengths
from rollstream.common.errors import DecodeError, InvalidResult
from rollstream.common.models import SAMPLE_FIELDS, Sample, Status
from rollstream.common.sample_fields import Kind


def as_samples(result: Any) -> list[Sample]:
    """The samples of a generate function's result: one Sample or a non-empty list of them."""
    if isinstance(result, Sample):
        return [result]
    if isinstance(result, list | tuple):
        if not result:
            raise InvalidResult("returned an empty list: an episode yields at least one sample")
        for i, item in enumerate(result):
            if isinstance(item, list | tuple):
                raise InvalidResult(f"returned a nested list (item {i} is a {type(item).__name__}): give a flat list")
            if not isinstance(item, Sample):
                raise InvalidResult(f"item {i} of the returned list is a {type(item).__name__}, not a Sample")
        return list(result)
    raise InvalidResult(f"returned a {type(result).__name__}, not a Sample or a list of Samples")


_HIGH_BYTE = 3 if sys.byteorder == "little" else 0
_NOT_HUGE = bytes(b for b in range(256) if b & 0x7F != 0x7F)


def _maybe_non_finite(values: Any) -> bool:
    """False when no float32 in ``values`` can be NaN or infinite, in C loops: a non-finite
    float32 has all exponent bits set, so the byte holding the sign and the top seven of them
    is 0x7f or 0xff (as it is only for magnitudes of ~1.7e38 and more). True: look closer.
    (A contiguous copy sliced with a step: ~6x faster than a strided memoryview's ``tobytes``.)"""
    high = memoryview(values).tobytes()[_HIGH_BYTE::4]
    return bool(high.translate(None, _NOT_HUGE))


def check_sample(sample: Sample) -> str | None:
    """Why ``sample`` cannot be published (None when it can): its metadata (and the other free-form
    fields) plain data the wire format encodes, tokens = prompt + response, one loss-mask entry
    (0/1) and one log-prob per response token, finite log-probs where the mask is 1, version
    spans inside the response, and every length the decoder checks (the training arrays of
    ``response_length`` entries or a row per token: :func:`~rollstream.common.codec.check_lengths`).
    FAILED samples are published as they are, once they encode and decode."""
    problem = _not_plain(sample)
    if problem is not None:
        return problem
    if sample.status == Status.FAILED:
        return lengths_problem(sample)
    tokens, rlen, plen = sample.tokens, sample.response_length, sample.prompt_length
    if rlen < 0 or plen < 0 or plen + rlen != len(tokens):
        return f"tokens ({len(tokens)}) != prompt ({plen}) + response ({rlen})"
    mask = sample.loss_mask
    if mask is None or len(mask) != rlen:
        return f"loss mask has {'no' if mask is None else len(mask)} entries for {rlen} response tokens"
    if bytes(mask).translate(None, b"\x00\x01"):  # C speed: anything left is neither 0 nor 1
        return "loss mask holds values other than 0 and 1"
    log_probs = sample.rollout_log_probs
    if log_probs is not None:
        if len(log_probs) != rlen:
            return f"{len(log_probs)} log-probs for {rlen} response tokens"
        if _maybe_non_finite(log_probs) and not all(
            math.isfinite(lp) for lp, m in zip(log_probs, mask, strict=True) if m
        ):
            return "a non-finite log-prob on a trained token (loss mask 1)"
    if not all(type(v) is int for v in sample.weight_versions):
        return "weight_versions must be ints"
    if sample.weight_version_spans is not None:
        end = 0
        for span in sample.weight_version_spans:
            if len(span) != 3 or not all(type(x) is int for x in span) or not end <= span[0] <= span[1] <= rlen:
                return f"weight version span {span!r} is out of order or outside the response"
            end = span[1]
    return lengths_problem(sample)


def lengths_problem(sample: Sample) -> str | None:
    """Why the lengths of ``sample``'s fields do not agree (what the trainer's decoder would
    refuse, failing the whole group), or None."""
    try:
        check_lengths(sample)
    except DecodeError as exc:
        return exc.detail
    return None


_FREE_FORM = tuple(f.name for f in SAMPLE_FIELDS if f.kind in (Kind.TEXT, Kind.REWARD, Kind.MAP, Kind.COUNTERS))
"""The fields that hold whatever the user's code put there (msgpack encodes them as they are)."""
_MEDIA = tuple(f.name for f in SAMPLE_FIELDS if f.kind is Kind.MEDIA)
"""Processed media: plain values beside the packed tensors."""


def _not_plain(sample: Sample) -> str | None:
    """Why a free-form field of ``sample`` cannot be encoded (msgpack, as the codec does), or
    None: an object the codec cannot encode would stop the producer at publish (fatal) instead
    of failing one sample."""
    if not isinstance(sample.metadata, dict):
        return f"metadata is a {type(sample.metadata).__name__}, not a dict"
    for name in _FREE_FORM:
        value = getattr(sample, name)
        if value is not None and (problem := not_plain(value, name)) is not None:
            return problem
    for name in _MEDIA:
        media = getattr(sample, name)
        if media is None:
            continue
        if not isinstance(media, dict):
            return f"{name} is a {type(media).__name__}, not a dict"
        plain = {k: v for k, v in media.items() if not isinstance(v, Packed)}  # tensors travel packed
        if (problem := not_plain(plain, name)) is not None:
            return problem
    if not isinstance(sample.response, str):
        return f"response is a {type(sample.response).__name__}, not a str"
    return None


def not_plain(value: Any, what: str) -> str | None:
    """Why ``value`` is not plain data the wire format encodes (msgpack, as the codec), or None."""
    try:
        msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        return f"{what} is not plain data (str, numbers, lists, dicts): {exc}"
    return None
