"""Reply validation shared by the dialects: bytes to typed structs, lists to packed arrays.

Each dialect declares one typed msgspec decoder per reply shape, which checks types and token-id
ranges in C while it decodes (no intermediate ``dict`` tree, no per-token Python loop); token ids
then go into ``array('i')`` and log-probs into ``array('f')`` in one C call each
(``struct.pack``: about twice as fast as ``array(code, list)``, which calls a method per item). Structs are
declared ``gc=False``: decoded JSON cannot form cycles, and untracked structs keep the thousand
objects of a reply from triggering cyclic-GC passes over the producer's heap (~90 us of 410 per
1k reply). Anything unusable raises :class:`EngineReplyInvalid` with a short ``reason`` slug.
"""

from __future__ import annotations

import math
import struct
from array import array
from typing import Annotated, Any, cast

import msgspec
from rollstream.common.errors import EngineReplyInvalid
from rollstream.common.versions import out_of_range, parse_version

TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
"""A token id that fits ``array('i')``; negative ids are refused."""


def decode(decoder: msgspec.json.Decoder[Any], raw: bytes, where: str) -> Any:
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise EngineReplyInvalid("schema", str(exc), where) from None
    except msgspec.DecodeError as exc:
        raise EngineReplyInvalid("not_json", f"{exc} (first bytes {bytes(raw[:80])!r})", where) from None


def floats(values: list[float | None], where: str) -> array[float]:
    """``array('f')`` of finite log-probs; nulls, NaN, ±inf and float32 overflow are refused."""
    out = array("f")
    try:
        out.frombytes(struct.pack(f"{len(values)}f", *values))
    except (struct.error, OverflowError):  # a null, or beyond float32: the item-wise path names it
        return _floats_one_by_one(values, where)
    if not math.isfinite(sum(out)):  # one C pass; NaN and ±inf propagate into the sum
        index = next(i for i, v in enumerate(out) if not math.isfinite(v))
        raise EngineReplyInvalid("non_finite_logprob", f"log-prob {index} is {values[index]!r}", where)
    return out


def _floats_one_by_one(values: list[float | None], where: str) -> array[float]:
    try:
        out = array("f", cast("list[float]", values))
    except TypeError:
        null = next(i for i, v in enumerate(values) if v is None)
        raise EngineReplyInvalid("non_finite_logprob", f"log-prob {null} is null", where) from None
    index = next((i for i, v in enumerate(out) if not math.isfinite(v)), None)  # float32 overflow: inf
    if index is None:
        return out
    raise EngineReplyInvalid("non_finite_logprob", f"log-prob {index} is {values[index]!r}", where)


def ids(values: list[int]) -> array[int]:
    """``array('i')`` of ids whose ranges the decoder checked (:data:`TokenId`)."""
    out = array("i")
    out.frombytes(struct.pack(f"{len(values)}i", *values))
    return out


def check_logprobs(
    token_ids: array[int], log_probs: array[float] | None, finish_reason: str | None, where: str, holder: str
) -> None:
    """Log-probs were asked for: one per output token, present unless the request was aborted."""
    if log_probs is None:
        if finish_reason != "abort":
            raise EngineReplyInvalid("no_logprobs", f"log-probs were asked for but {holder} has none", where)
        return
    if len(log_probs) != len(token_ids):
        raise EngineReplyInvalid(
            "count_mismatch", f"{len(log_probs)} log-probs for {len(token_ids)} output tokens", where
        )


def choices(items: list[Any], n: int, where: str) -> list[Any]:
    """The ``n`` choices of an OpenAI-style reply, in ``index`` order."""
    if len(items) != n:
        raise EngineReplyInvalid("choices", f"{len(items)} choices, expected {n}", where)
    return sorted(items, key=lambda c: c.index)


def json_object(raw: bytes) -> dict[str, Any] | None:
    """A small JSON reply (model info, worker list, tokenize) as a dict; None when it is not one."""
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None
    return value if isinstance(value, dict) else None


def reply_version(value: Any, where: str) -> int | None:
    """The weight version in an engine's reply (:func:`parse_version`); one above 2^63-1 makes the
    reply unusable (the engine's fault, never the user's code nor the codec's at publish)."""
    if out_of_range(value):
        text = str(value) if isinstance(value, str) or value.bit_length() < 256 else ""
        shown = text if 0 < len(text) <= 40 else f"{text[:24]}... ({len(text)} digits)" if text else "of 78+ digits"
        raise EngineReplyInvalid("version", f"weight version {shown} is not within 0..2^63-1", where)
    return parse_version(value)
