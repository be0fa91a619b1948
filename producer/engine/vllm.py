"""The vLLM dialect: token-in/token-out ``POST /inference/v1/generate`` (``--enable-scale-out``).

Prompt token ids in (from ``--tokenizer`` or the engine's ``/tokenize``), ``n`` samples per
request; out, per choice: ``token_ids``, ``text``, ``finish_reason``,
``logprobs.content[j].logprob`` and ``weight_versions``, the weight version spans
``[{version, start, end}]`` over the output tokens (checked: contiguous, in range, covering the
output; a version that is not an integer, vLLM's ``"default"`` before the first
``/update_weight_version``, makes the spans unknown). ``GET /weight_info`` where a reply has no
spans. No per-request ``seed`` is sent unless ``request_seed`` is on: a seeded request that vLLM's
CPU engine reschedules (a pause with ``keep``, the recompute after a reload) kills that engine.

A new per-choice field is one struct field on :class:`Choice` and one line in :func:`_sample` (the
routing replay, ``routed_experts``, is decoded by :mod:`.vllm_replay`).
"""

from __future__ import annotations

import random
from array import array
from typing import TYPE_CHECKING, Annotated, Any, cast

import msgspec
from rollstream.common.errors import EngineReplyInvalid, PromptNotSupported
from rollstream.common.weight_apis import VLLM_WEIGHTS, Call

from .load import METRICS, LoadEndpoint
from .parse import TokenId, check_logprobs, choices, decode, floats, ids, reply_version
from .types import Encoded, Generation, Request
from .vllm_replay import routed_experts_of

if TYPE_CHECKING:
    from .settings import EngineSettings

PATH = "/inference/v1/generate"


class _LogProb(msgspec.Struct, gc=False):
    logprob: float | None
    token_id: TokenId | None = None


class _LogProbs(msgspec.Struct, gc=False):
    content: list[_LogProb] | None = None


class _Span(msgspec.Struct, gc=False):
    version: str | int
    start: Annotated[int, msgspec.Meta(ge=0)]
    end: Annotated[int, msgspec.Meta(ge=0)]


class Choice(msgspec.Struct, gc=False):
    finish_reason: str
    index: int = 0
    text: str = ""
    token_ids: list[TokenId] | None = None
    logprobs: _LogProbs | None = None
    weight_versions: list[_Span] | None = None
    routed_experts: str | None = None
    """base64 ``.npy`` routing replay (``--enable-return-routed-experts``; :mod:`.vllm_replay`)."""


class _Reply(msgspec.Struct, gc=False):
    choices: list[Choice]
    prompt_token_ids: list[TokenId] | None = None


_REPLY = msgspec.json.Decoder(_Reply)


def _spans(spans: list[_Span] | None, length: int, where: str) -> list[tuple[int, int, int]] | None:
    """Validated ``(version, start, end)`` spans, contiguous from 0 to ``length``; None when the
    reply has none or a version is not an integer."""
    if spans is None:
        return None
    position = 0
    for span in spans:
        if span.start != position or span.end < span.start:
            raise EngineReplyInvalid("spans", f"weight version spans not contiguous at token {position}", where)
        position = span.end
    if spans and position != length:
        raise EngineReplyInvalid("spans", f"weight version spans cover {position} of {length} output tokens", where)
    out = []
    for span in spans:
        version = reply_version(span.version, where)
        if version is None:
            return None
        out.append((version, span.start, span.end))
    return out or None


def _sample(
    choice: Choice, prompt_ids: array[int] | None, want_logprobs: bool, replay: tuple[int, int, int] | None, where: str
) -> Generation:
    content = choice.logprobs.content if choice.logprobs is not None else None
    log_probs = floats([c.logprob for c in content], where) if content is not None else None
    token_ids = ids(choice.token_ids) if choice.token_ids is not None else None
    if token_ids is None:
        if content is None or any(c.token_id is None for c in content):
            if choice.finish_reason != "abort":
                raise EngineReplyInvalid("schema", "no token_ids", where)
            token_ids = array("i")
        else:
            token_ids = array("i", [cast(int, c.token_id) for c in content])
    if want_logprobs:
        check_logprobs(token_ids, log_probs, choice.finish_reason, where, "the choice")
    spans = _spans(choice.weight_versions, len(token_ids), where)
    return Generation(
        text=choice.text, output_ids=token_ids, log_probs=log_probs, finish_reason=choice.finish_reason,
        weight_version=spans[-1][0] if spans else None, prompt_ids=prompt_ids, weight_version_spans=spans,
        routed_experts=routed_experts_of(choice.routed_experts, choice.finish_reason, replay, where),
    )


def parse_vllm_generate(
    raw: bytes, n: int, *, want_logprobs: bool, where: str = "", routed_experts: tuple[int, int, int] | None = None
) -> list[Generation]:
    """The ``n`` samples of a vLLM ``/inference/v1/generate`` reply, in ``index`` order; with
    ``routed_experts`` ``(layers, topk, experts)``, each sample's routing replay decoded and checked."""
    reply: _Reply = decode(_REPLY, raw, where)
    prompt = reply.prompt_token_ids
    return [
        _sample(choice, None if prompt is None else ids(prompt), want_logprobs, routed_experts, where)
        for choice in choices(reply.choices, n, where)
    ]


class VLLM:
    """``--engine-api vllm``."""

    name = "vllm"
    batches_samples = True
    accepts_messages = False
    needs_token_ids = True
    needs_model = False
    replies_carry_versions = True
    routing_replay = True
    seed_reschedule_kills = True
    version_paths: tuple[str, ...] = ("/weight_info",)
    version_hint = "vLLM reports weight_versions spans and GET /weight_info once /update_weight_version set one"
    loads: tuple[LoadEndpoint, ...] = (METRICS,)
    abort = Call("/abort_requests", {})  # dev mode; an empty body aborts everything in flight
    weights = VLLM_WEIGHTS  # dev mode: /collective_rpc reload_weights, then /update_weight_version

    def encode(self, request: Request, settings: EngineSettings) -> Encoded:
        input_ids = request.input_ids
        if input_ids is None:  # the client tokenizes first (needs_token_ids)
            raise PromptNotSupported(
                "--engine-api vllm sends token ids: give a tokenizer (--tokenizer) or an engine with /tokenize"
            )
        n = request.n
        params: dict[str, Any] = {"n": n, "max_tokens": request.max_new_tokens, **request.sampling}
        if settings.return_logprob:
            params["logprobs"] = 0  # the sampled token's log-prob only
        if settings.request_seed:
            params["seed"] = random.getrandbits(31)
        body = {
            "token_ids": input_ids if isinstance(input_ids, list | array) else list(input_ids),
            "sampling_params": params,
            "output_mode": "text",
        }
        # The reply may echo the prompt ids (on the reply and on each choice), like the completions API.
        # With the routing replay on, every choice's replay also covers the prompt's tokens.
        replay = n * len(input_ids) if settings.routed_experts is not None else 0
        return Encoded(PATH, body, n, len(input_ids), prompt_copies=n + 1, replay_prompt_tokens=replay)

    def decode(self, encoded: Encoded, raw: bytes, settings: EngineSettings, where: str) -> list[Generation]:
        return parse_vllm_generate(raw, encoded.weight, want_logprobs=settings.return_logprob, where=where,
                                   routed_experts=settings.routed_experts)
