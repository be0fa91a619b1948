"""Engine replies, from bytes straight to packed arrays, validated where they are parsed.

One typed msgspec decoder per reply shape checks types and token-id ranges in C while it decodes
(no intermediate ``dict`` tree, no per-token Python validation loop); token ids then go into
``array('i')`` and log-probs into ``array('f')`` in one C call each. Shapes:

* SGLang ``/generate``: ``text``, ``output_ids``, ``meta_info.finish_reason.type`` (or a plain
  string), ``meta_info.output_token_logprobs`` ``[[logprob, token_id, text|null], ...]``,
  ``meta_info.weight_version``; an ``n > 1`` request answers a list of those objects.
* OpenAI ``/v1/completions``: ``choices[i].text``, ``.finish_reason``, ``.logprobs.tokens`` /
  ``.token_logprobs``, vLLM's ``.token_ids`` (``return_token_ids``) or ``"token_id:N"`` tokens
  (``return_tokens_as_token_ids``), ``prompt_token_ids`` on the choice or the reply.
* OpenAI ``/v1/chat/completions``: ``choices[i].message.content``,
  ``.logprobs.content[j].token`` / ``.logprob``, the same vLLM id fields.
* vLLM's token-in/token-out ``/inference/v1/generate``: ``choices[i].token_ids``, ``.text``,
  ``.finish_reason``, ``.logprobs.content[j].logprob`` and ``.weight_versions``, the weight
  version spans ``[{version, start, end}]`` over the output tokens (checked: contiguous, in
  range, covering the output).

With routing replay on, SGLang adds ``meta_info.routed_experts`` (base64 of little-endian int32,
``(prompt + output tokens - 1) x layers x topk``, ``routed_experts_start_len`` rows skipped when
it says so); :func:`decode_routed_experts` turns it into a :class:`~rollstream.common.models.Packed`
in its smallest dtype, checking the shape and the id range. A teacher's scoring reply
(``max_new_tokens`` 0, ``logprob_start_len``) carries ``meta_info.input_token_logprobs``:
:func:`parse_teacher` checks every entry against the scored tokens.

Anything unusable raises :class:`EngineReplyInvalid` with a short ``reason`` slug: not JSON, a
wrong type or a missing field, a negative or out-of-range token id, a null, NaN or infinite
log-prob, a log-prob count that differs from the output token count when log-probs were asked
for, a wrong number of choices. It subclasses :class:`EngineRejected`, so the producer records a
FAILED sample with the reason (the group is recycled), never a crash and never a COMPLETED
sample.
"""

from __future__ import annotations

import base64
import binascii
import math
import sys
from array import array
from dataclasses import dataclass
from typing import Annotated, Any, cast

import msgspec
from rollstream.common.errors import EngineReplyInvalid as EngineReplyInvalid  # re-exported: defined in common.errors
from rollstream.common.models import Packed

TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
"""A token id that fits ``array('i')``; negative ids are refused."""


@dataclass(slots=True)
class ParsedReply:
    """One sample of a reply, normalised across APIs."""

    text: str
    output_ids: array[int]
    log_probs: array[float] | None
    finish_reason: str | None
    weight_version: Any = None
    """As the engine sent it (SGLang sends a string); parse with ``engine.parse_version``."""
    prompt_ids: array[int] | None = None
    weight_version_spans: list[tuple[Any, int, int]] | None = None
    """vLLM's ``(version, start, end)`` spans over the output tokens, as sent (versions are strings)."""
    routed_experts: str | None = None
    """SGLang's base64 routing replay, undecoded (see :func:`decode_routed_experts`)."""
    routed_experts_start: int = 0
    """Rows of the sequence the replay leaves out (SGLang ``routed_experts_start_len``)."""
    counters: dict[str, int] | None = None
    """SGLang's prefix-cache and speculative-decoding counters of the request (``cached_tokens``,
    ``prompt_tokens``, ``spec_*``, ``completion_tokens``) when it sent them."""


# -- SGLang /generate ---------------------------------------------------------------------------
# ``gc=False``: decoded JSON cannot form cycles, and untracked structs keep the thousand objects of
# a reply from triggering cyclic-GC passes over the producer's heap (~90 us of 410 per 1k reply).


class _LogProb(msgspec.Struct, array_like=True, gc=False):
    logprob: float | None
    token_id: TokenId
    token_text: Any = None


class _Finish(msgspec.Struct, gc=False):
    type: str


class _Meta(msgspec.Struct, gc=False):
    finish_reason: _Finish | str
    output_token_logprobs: list[_LogProb] | None = None
    weight_version: int | str | None = None
    routed_experts: str | None = None
    routed_experts_start_len: Annotated[int, msgspec.Meta(ge=0)] = 0
    cached_tokens: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    spec_accept_token_num: int | None = None
    spec_draft_token_num: int | None = None
    spec_verify_ct: int | None = None


class _Generate(msgspec.Struct, gc=False):
    meta_info: _Meta
    text: str = ""
    output_ids: list[TokenId] | None = None


_GENERATE = msgspec.json.Decoder(_Generate | list[_Generate])


# -- OpenAI-compatible ----------------------------------------------------------------------------


class _CompletionLogprobs(msgspec.Struct, gc=False):
    tokens: list[str] | None = None
    token_logprobs: list[float | None] | None = None


class _CompletionChoice(msgspec.Struct, gc=False):
    finish_reason: str
    index: int = 0
    text: str = ""
    logprobs: _CompletionLogprobs | None = None
    token_ids: list[TokenId] | None = None
    prompt_token_ids: list[TokenId] | None = None


class _Completion(msgspec.Struct, gc=False):
    choices: list[_CompletionChoice]
    prompt_token_ids: list[TokenId] | None = None


class _ChatToken(msgspec.Struct, gc=False):
    token: str
    logprob: float | None


class _ChatLogprobs(msgspec.Struct, gc=False):
    content: list[_ChatToken] | None = None


class _Message(msgspec.Struct, gc=False):
    content: str | None = None


class _ChatChoice(msgspec.Struct, gc=False):
    finish_reason: str
    index: int = 0
    message: _Message | None = None
    logprobs: _ChatLogprobs | None = None
    token_ids: list[TokenId] | None = None
    prompt_token_ids: list[TokenId] | None = None


class _Chat(msgspec.Struct, gc=False):
    choices: list[_ChatChoice]
    prompt_token_ids: list[TokenId] | None = None


_COMPLETION = msgspec.json.Decoder(_Completion)
_CHAT = msgspec.json.Decoder(_Chat)


# -- vLLM /inference/v1/generate ---------------------------------------------------------------------


class _GenerateLogProb(msgspec.Struct, gc=False):
    logprob: float | None
    token_id: TokenId | None = None


class _GenerateLogProbs(msgspec.Struct, gc=False):
    content: list[_GenerateLogProb] | None = None


class _Span(msgspec.Struct, gc=False):
    version: str | int
    start: Annotated[int, msgspec.Meta(ge=0)]
    end: Annotated[int, msgspec.Meta(ge=0)]


class _GenerateChoice(msgspec.Struct, gc=False):
    finish_reason: str
    index: int = 0
    text: str = ""
    token_ids: list[TokenId] | None = None
    logprobs: _GenerateLogProbs | None = None
    weight_versions: list[_Span] | None = None
    routed_experts: str | None = None
    """base64 ``.npy`` routing replay (``--enable-return-routed-experts``; see producer/vllm_replay.py)."""


class _VllmGenerate(msgspec.Struct, gc=False):
    choices: list[_GenerateChoice]
    prompt_token_ids: list[TokenId] | None = None


_VLLM_GENERATE = msgspec.json.Decoder(_VllmGenerate)


# -- helpers ----------------------------------------------------------------------------------------


def _decode(decoder: msgspec.json.Decoder[Any], raw: bytes, where: str) -> Any:
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise EngineReplyInvalid("schema", str(exc), where) from None
    except msgspec.DecodeError as exc:
        raise EngineReplyInvalid("not_json", f"{exc} (first bytes {bytes(raw[:80])!r})", where) from None


def _floats(values: list[float | None], where: str) -> array[float]:
    """``array('f')`` of finite log-probs; nulls, NaN, ±inf and float32 overflow are refused."""
    try:
        out = array("f", cast("list[float]", values))
    except TypeError:
        index = next(i for i, v in enumerate(values) if v is None)
        raise EngineReplyInvalid("non_finite_logprob", f"log-prob {index} is null", where) from None
    if not math.isfinite(sum(out)):  # one C pass; NaN and ±inf propagate into the sum
        index = next(i for i, v in enumerate(out) if not math.isfinite(v))
        raise EngineReplyInvalid("non_finite_logprob", f"log-prob {index} is {values[index]!r}", where)
    return out


def _ids(values: list[int]) -> array[int]:
    return array("i", values)  # ranges already checked by the decoder (TokenId)


def _check_count(ids: array[int], log_probs: array[float] | None, where: str) -> None:
    if log_probs is not None and len(log_probs) != len(ids):
        raise EngineReplyInvalid("count_mismatch", f"{len(log_probs)} log-probs for {len(ids)} output tokens", where)


# -- parsers ----------------------------------------------------------------------------------------


def parse_sglang(raw: bytes, *, want_logprobs: bool, where: str = "") -> list[ParsedReply]:
    """The samples of a ``/generate`` reply (one object, or a list for ``n > 1``)."""
    decoded = _decode(_GENERATE, raw, where)
    replies = decoded if isinstance(decoded, list) else [decoded]
    if not replies:
        raise EngineReplyInvalid("schema", "an empty list", where)
    return [_sglang_one(reply, want_logprobs, where) for reply in replies]


def _sglang_one(reply: _Generate, want_logprobs: bool, where: str) -> ParsedReply:
    meta = reply.meta_info
    finish = meta.finish_reason.type if isinstance(meta.finish_reason, _Finish) else meta.finish_reason
    pairs = meta.output_token_logprobs
    log_probs = _floats([p.logprob for p in pairs], where) if pairs is not None else None
    if reply.output_ids is not None:
        ids = _ids(reply.output_ids)
    elif pairs is not None:
        ids = array("i", [p.token_id for p in pairs])
    elif finish == "abort":
        ids = array("i")
    else:
        raise EngineReplyInvalid("schema", "no output_ids and no output_token_logprobs", where)
    if want_logprobs:
        if log_probs is None and finish != "abort":
            raise EngineReplyInvalid("no_logprobs", "log-probs were asked for but meta_info has none", where)
        _check_count(ids, log_probs, where)
    return ParsedReply(
        text=reply.text, output_ids=ids, log_probs=log_probs, finish_reason=finish, weight_version=meta.weight_version,
        routed_experts=meta.routed_experts, routed_experts_start=meta.routed_experts_start_len,
        counters=_counters(meta),
    )


_COUNTERS = (
    "cached_tokens", "prompt_tokens", "completion_tokens", "spec_accept_token_num", "spec_draft_token_num",
    "spec_verify_ct",
)


def _counters(meta: _Meta) -> dict[str, int] | None:
    out = {name: value for name in _COUNTERS if isinstance(value := getattr(meta, name), int) and value >= 0}
    return out or None


def decode_routed_experts(encoded: str, layers: int, topk: int, experts: int, where: str = "") -> Packed:
    """SGLang's base64 int32 routing replay as ``(rows, layers, topk)`` in its smallest exact
    dtype; ``EngineReplyInvalid`` (``routed_experts``) when it is not base64, not a whole number of
    ``layers x topk`` int32 rows, or holds an id outside ``0 .. experts - 1``."""
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise EngineReplyInvalid("routed_experts", f"not base64: {exc}", where) from None
    row = 4 * layers * topk
    if len(raw) % row:
        raise EngineReplyInvalid(
            "routed_experts", f"{len(raw)} bytes is not a whole number of {layers} x {topk} int32 rows", where
        )
    rows = len(raw) // row
    values = array("i")
    values.frombytes(raw)
    if sys.byteorder != "little":  # pragma: no cover - SGLang sends little-endian
        values.byteswap()
    if not values:
        return Packed(array("B"), (0, layers, topk))
    lo, hi = min(values), max(values)  # one C pass each
    if lo < 0 or hi >= experts:
        raise EngineReplyInvalid("routed_experts", f"expert id {lo if lo < 0 else hi} outside 0..{experts - 1}", where)
    code = "B" if experts <= 256 else "H" if experts <= 65536 else "i"  # exact: every id is below experts
    return Packed(values if code == "i" else array(code, values), (rows, layers, topk))


class _Teacher(msgspec.Struct, gc=False):
    input_token_logprobs: list[_LogProb]


class _TeacherReply(msgspec.Struct, gc=False):
    meta_info: _Teacher


_TEACHER = msgspec.json.Decoder(_TeacherReply)


def parse_teacher(raw: bytes, tokens: array[int] | memoryview, response_length: int, where: str = "") -> array[float]:
    """The teacher's log-probs of the last ``response_length`` of ``tokens``, from a scoring
    reply whose ``input_token_logprobs`` end at the last token: every entry's token id must be
    the token it scores (an engine that scored other tokens is refused, ``teacher_mismatch``)."""
    entries = _decode(_TEACHER, raw, where).meta_info.input_token_logprobs
    if len(entries) < response_length:
        raise EngineReplyInvalid(
            "teacher_count", f"{len(entries)} input log-probs for {response_length} response tokens", where
        )
    scored = entries[len(entries) - response_length :]
    start = len(tokens) - response_length
    for i, entry in enumerate(scored):
        if entry.token_id != tokens[start + i]:
            raise EngineReplyInvalid(
                "teacher_mismatch", f"entry {i} scores token {entry.token_id}, the response has {tokens[start + i]}",
                where,
            )
    return _floats([e.logprob for e in scored], where)


def _token_ids(tokens: list[str] | None) -> array[int] | None:
    """Ids of vLLM's ``return_tokens_as_token_ids`` tokens ``"token_id:N"``; None unless all are."""
    if not tokens:
        return None
    try:
        ids = array("i", [int(t[9:]) if t.startswith("token_id:") else -1 for t in tokens])
    except (ValueError, OverflowError):
        return None
    return None if min(ids) < 0 else ids


def _choices(choices: list[Any], n: int, where: str) -> list[Any]:
    if len(choices) != n:
        raise EngineReplyInvalid("choices", f"{len(choices)} choices, expected {n}", where)
    return sorted(choices, key=lambda c: c.index)


def _openai_sample(
    choice: Any,
    reply_prompt_ids: list[int] | None,
    text: str,
    tokens: list[str] | None,
    log_probs: array[float] | None,
    want_logprobs: bool,
    where: str,
) -> ParsedReply:
    ids = _ids(choice.token_ids) if choice.token_ids is not None else _token_ids(tokens)
    if ids is None:
        if want_logprobs and tokens:
            raise EngineReplyInvalid("schema", "no token_ids and tokens are not 'token_id:N'", where)
        ids = array("i")
    if want_logprobs:
        if log_probs is None and choice.finish_reason != "abort":
            raise EngineReplyInvalid("no_logprobs", "log-probs were asked for but the choice has none", where)
        _check_count(ids, log_probs, where)
    prompt = choice.prompt_token_ids if choice.prompt_token_ids is not None else reply_prompt_ids
    return ParsedReply(
        text=text,
        output_ids=ids,
        log_probs=log_probs,
        finish_reason=choice.finish_reason,
        prompt_ids=None if prompt is None else _ids(prompt),
    )


def parse_completions(raw: bytes, n: int, *, want_logprobs: bool, where: str = "") -> list[ParsedReply]:
    """The ``n`` samples of a ``/v1/completions`` reply, in ``index`` order."""
    reply: _Completion = _decode(_COMPLETION, raw, where)
    out = []
    for choice in _choices(reply.choices, n, where):
        lp = choice.logprobs
        tokens = lp.tokens if lp is not None else None
        log_probs = _floats(lp.token_logprobs, where) if lp is not None and lp.token_logprobs is not None else None
        out.append(_openai_sample(choice, reply.prompt_token_ids, choice.text, tokens, log_probs, want_logprobs, where))
    return out


def parse_chat(raw: bytes, n: int, *, want_logprobs: bool, where: str = "") -> list[ParsedReply]:
    """The ``n`` samples of a ``/v1/chat/completions`` reply, in ``index`` order."""
    reply: _Chat = _decode(_CHAT, raw, where)
    out = []
    for choice in _choices(reply.choices, n, where):
        content = choice.logprobs.content if choice.logprobs is not None else None
        tokens = [c.token for c in content] if content is not None else None
        log_probs = _floats([c.logprob for c in content], where) if content is not None else None
        text = (choice.message.content if choice.message is not None else None) or ""
        out.append(_openai_sample(choice, reply.prompt_token_ids, text, tokens, log_probs, want_logprobs, where))
    return out


def _spans(spans: list[_Span] | None, length: int, where: str) -> list[tuple[Any, int, int]] | None:
    """Validated ``(version, start, end)`` spans: contiguous from 0 to ``length``."""
    if spans is None:
        return None
    position = 0
    for span in spans:
        if span.start != position or span.end < span.start:
            raise EngineReplyInvalid("spans", f"weight version spans not contiguous at token {position}", where)
        position = span.end
    if spans and position != length:
        raise EngineReplyInvalid("spans", f"weight version spans cover {position} of {length} output tokens", where)
    return [(span.version, span.start, span.end) for span in spans]


def parse_vllm_generate(raw: bytes, n: int, *, want_logprobs: bool, where: str = "") -> list[ParsedReply]:
    """The ``n`` samples of a vLLM ``/inference/v1/generate`` reply, in ``index`` order."""
    reply: _VllmGenerate = _decode(_VLLM_GENERATE, raw, where)
    out = []
    for choice in _choices(reply.choices, n, where):
        content = choice.logprobs.content if choice.logprobs is not None else None
        log_probs = _floats([c.logprob for c in content], where) if content is not None else None
        ids = _ids(choice.token_ids) if choice.token_ids is not None else None
        if ids is None:
            if content is None or any(c.token_id is None for c in content):
                if choice.finish_reason != "abort":
                    raise EngineReplyInvalid("schema", "no token_ids", where)
                ids = array("i")
            else:
                ids = array("i", [cast(int, c.token_id) for c in content])
        if want_logprobs:
            if log_probs is None and choice.finish_reason != "abort":
                raise EngineReplyInvalid("no_logprobs", "log-probs were asked for but the choice has none", where)
            _check_count(ids, log_probs, where)
        out.append(
            ParsedReply(
                text=choice.text,
                output_ids=ids,
                log_probs=log_probs,
                finish_reason=choice.finish_reason,
                prompt_ids=None if reply.prompt_token_ids is None else _ids(reply.prompt_token_ids),
                weight_version_spans=_spans(choice.weight_versions, len(ids), where),
                routed_experts=choice.routed_experts,
            )
        )
    return out
