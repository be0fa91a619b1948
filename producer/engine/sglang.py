"""The SGLang dialect: native ``POST /generate``, one request per sample.

Works against an SGLang server or the SGLang gateway (``sglang-router``), which routes
``/generate``. Request: ``text`` or ``input_ids``, ``sampling_params``, ``return_logprob``,
``rid``, ``image_data``, ``return_routed_experts``. Reply: ``text``, ``output_ids``,
``meta_info.finish_reason.type`` (or a plain string), ``meta_info.output_token_logprobs``
``[[logprob, token_id, text|null], ...]``, ``meta_info.weight_version``; an ``n > 1`` request
answers a list of those objects.

With routing replay on, SGLang adds ``meta_info.routed_experts`` (base64 of little-endian int32,
``(prompt + output tokens - 1) x layers x topk``, ``routed_experts_start_len`` rows skipped when
it says so); :func:`decode_routed_experts` turns it into a :class:`~rollstream.common.models.Packed`
in its smallest dtype, checking the shape and the id range. A teacher's scoring reply
(``max_new_tokens`` 0, ``logprob_start_len``) carries ``meta_info.input_token_logprobs``:
:func:`parse_teacher` checks every entry against the scored tokens.
"""

from __future__ import annotations

import base64
import binascii
import math
import sys
from array import array
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from rollstream.common.arrays import Packed
from rollstream.common.checked import is_number
from rollstream.common.errors import EngineReplyInvalid, PromptNotSupported
from rollstream.common.weight_apis import SGLANG_WEIGHTS, Call

from .load import METRICS, EngineLoad, LoadEndpoint
from .parse import TokenId, check_logprobs, decode, floats, ids, reply_version
from .types import Encoded, Generation, Request

if TYPE_CHECKING:
    from .settings import EngineSettings

PATH = "/generate"


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

_COUNTERS = (
    "cached_tokens", "prompt_tokens", "completion_tokens", "spec_accept_token_num", "spec_draft_token_num",
    "spec_verify_ct",
)


def parse_sglang(
    raw: bytes, *, want_logprobs: bool, where: str = "", routed_experts: tuple[int, int, int] | None = None,
    counters: bool = True,
) -> list[Generation]:
    """The samples of a ``/generate`` reply (one object, or a list for ``n > 1``); with
    ``routed_experts`` ``(layers, topk, experts)``, each sample's routing replay decoded and checked;
    with ``counters``, SGLang's prefix-cache and speculative-decoding counters kept."""
    decoded: _Generate | list[_Generate] = decode(_GENERATE, raw, where)
    replies = decoded if isinstance(decoded, list) else [decoded]
    if not replies:
        raise EngineReplyInvalid("schema", "an empty list", where)
    return [_sample(reply, want_logprobs, routed_experts, where, counters) for reply in replies]


def _sample(
    reply: _Generate, want_logprobs: bool, shape: tuple[int, int, int] | None, where: str, counters: bool
) -> Generation:
    meta = reply.meta_info
    finish = meta.finish_reason.type if isinstance(meta.finish_reason, _Finish) else meta.finish_reason
    pairs = meta.output_token_logprobs
    log_probs = floats([p.logprob for p in pairs], where) if pairs is not None else None
    if reply.output_ids is not None:
        token_ids = ids(reply.output_ids)
    elif pairs is not None:
        token_ids = array("i", [p.token_id for p in pairs])
    elif finish == "abort":
        token_ids = array("i")
    else:
        raise EngineReplyInvalid("schema", "no output_ids and no output_token_logprobs", where)
    if want_logprobs:
        check_logprobs(token_ids, log_probs, finish, where, "meta_info")
    experts = None
    if shape is not None:
        if meta.routed_experts is not None:
            experts = decode_routed_experts(meta.routed_experts, *shape, where=where)
        elif finish != "abort":
            raise EngineReplyInvalid(
                "routed_experts", "asked for but meta_info has none (start SGLang with --enable-return-routed-experts)",
                where,
            )
    return Generation(
        text=reply.text, output_ids=token_ids, log_probs=log_probs, finish_reason=finish,
        weight_version=reply_version(meta.weight_version, where), routed_experts=experts,
        routed_experts_start=meta.routed_experts_start_len, counters=_counters(meta) if counters else None,
        prefix_cache=(meta.prompt_tokens, meta.cached_tokens)
        if meta.prompt_tokens is not None and meta.cached_tokens is not None else None,
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
    entries = decode(_TEACHER, raw, where).meta_info.input_token_logprobs
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
    return floats([e.logprob for e in scored], where)


def _number(value: object) -> float | None:
    if not is_number(value):
        return None
    number = float(value)
    return number if math.isfinite(number) and number >= 0 else None


_LOADS = msgspec.json.Decoder()


def parse_sglang_load(raw: bytes) -> EngineLoad | None:
    """The load in a ``GET /v1/loads`` reply (``loads[].num_running_reqs``, ``num_waiting_reqs``,
    ``token_usage``) or an older ``GET /get_load`` one (per DP rank ``num_reqs``,
    ``num_waiting_reqs``: no KV usage), summed over DP ranks; None when unusable."""
    try:
        reply = _LOADS.decode(raw)
    except msgspec.DecodeError:
        return None
    ranks = reply.get("loads") if isinstance(reply, dict) else reply  # /v1/loads, or /get_load's list
    if not isinstance(ranks, list) or not ranks or not all(isinstance(r, dict) for r in ranks):
        return None
    running = waiting = 0.0
    usage: float | None = None
    for rank in ranks:
        queued = _number(rank.get("num_waiting_reqs"))
        total = _number(rank.get("num_running_reqs"))
        if total is None and (all_reqs := _number(rank.get("num_reqs"))) is not None:
            total = max(0.0, all_reqs - (queued or 0.0))  # /get_load counts the waiting ones in num_reqs
        if total is None or queued is None:
            return None
        running += total
        waiting += queued
        share = _number(rank.get("token_usage"))
        if share is not None:
            usage = share if usage is None else max(usage, share)
    return EngineLoad(int(running), int(waiting), usage, None)


class SGLang:
    """``--engine-api sglang``."""

    name = "sglang"
    batches_samples = False
    accepts_messages = False
    needs_token_ids = False
    needs_model = False
    replies_carry_versions = True
    routing_replay = True
    seed_reschedule_kills = False
    version_paths: tuple[str, ...] = ("/model_info", "/get_model_info")  # the gateway only routes the latter
    version_hint = "SGLang reports meta_info.weight_version in its replies and at GET /model_info"
    loads: tuple[LoadEndpoint, ...] = (
        LoadEndpoint("/v1/loads", parse_sglang_load), LoadEndpoint("/get_load", parse_sglang_load), METRICS,
    )
    abort = Call("/abort_request", {"abort_all": True})
    weights = SGLANG_WEIGHTS

    def encode(self, request: Request, settings: EngineSettings) -> Encoded:
        if request.messages is not None:
            raise PromptNotSupported(
                "SGLang's /generate does not take chat messages: configure a tokenizer with a chat "
                "template (--tokenizer) or use --engine-api openai",
            )
        body: dict[str, Any] = {
            "sampling_params": {"max_new_tokens": request.max_new_tokens, **request.sampling},
            "return_logprob": settings.return_logprob,
        }
        text, input_ids = request.text, request.input_ids
        if text is not None:
            body["text"] = text
        else:
            body["input_ids"] = input_ids if isinstance(input_ids, list | array) else list(input_ids or ())
        if request.rid is not None:
            body["rid"] = request.rid
        if request.image_data:
            body["image_data"] = list(request.image_data)
        replay = 0
        if settings.routed_experts is not None:
            body["return_routed_experts"] = True
            # SGLang echoes no prompt ids; a routing replay has a row per prompt and output token.
            replay = len(input_ids or ()) if text is None else len(text.encode("utf-8")) + 16
        return Encoded(PATH, body, replay_prompt_tokens=replay)

    def decode(self, encoded: Encoded, raw: bytes, settings: EngineSettings, where: str) -> list[Generation]:
        return parse_sglang(raw, want_logprobs=settings.return_logprob, where=where,
                            routed_experts=settings.routed_experts, counters=settings.engine_stats)[:1]
