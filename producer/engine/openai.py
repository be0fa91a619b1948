"""The OpenAI-compatible dialect: ``POST /v1/completions``, and ``/v1/chat/completions`` for chat
messages without a local tokenizer; a group's ``n`` samples in one request.

vLLM's ``return_tokens_as_token_ids`` and ``return_token_ids`` bring back token ids and log-probs.
Replies: ``choices[i].text``, ``.finish_reason``, ``.logprobs.tokens`` / ``.token_logprobs``,
vLLM's ``.token_ids`` or ``"token_id:N"`` tokens, ``prompt_token_ids`` on the choice or the reply;
chat: ``choices[i].message.content``, ``.logprobs.content[j].token`` / ``.logprob``, the same vLLM
id fields. These servers report no weight version in the reply: it comes from the engine's own
endpoints, as with the native dialects: vLLM's ``GET /weight_info`` (dev mode), else SGLang's
``GET /model_info``; an engine with none gets the trainer's version at admission (said once at
start, with the dialect's ``version_hint``).
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Any

import msgspec
from rollstream.common.errors import EngineReplyInvalid
from rollstream.common.weight_apis import VLLM_WEIGHTS, Call

from .load import METRICS, LoadEndpoint
from .parse import TokenId, check_logprobs, choices, decode, floats, ids
from .types import Encoded, Generation, Request

if TYPE_CHECKING:
    from .settings import EngineSettings

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


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


def _token_ids(tokens: list[str] | None) -> array[int] | None:
    """Ids of vLLM's ``return_tokens_as_token_ids`` tokens ``"token_id:N"``; None unless all are."""
    if not tokens:
        return None
    try:
        out = array("i", [int(t[9:]) if t.startswith("token_id:") else -1 for t in tokens])
    except (ValueError, OverflowError):
        return None
    return None if min(out) < 0 else out


def _sample(
    choice: Any,
    reply_prompt_ids: list[int] | None,
    text: str,
    tokens: list[str] | None,
    log_probs: array[float] | None,
    want_logprobs: bool,
    where: str,
) -> Generation:
    token_ids = ids(choice.token_ids) if choice.token_ids is not None else _token_ids(tokens)
    if token_ids is None:
        if want_logprobs and tokens:
            raise EngineReplyInvalid("schema", "no token_ids and tokens are not 'token_id:N'", where)
        token_ids = array("i")
    if want_logprobs:
        check_logprobs(token_ids, log_probs, choice.finish_reason, where, "the choice")
    prompt = choice.prompt_token_ids if choice.prompt_token_ids is not None else reply_prompt_ids
    return Generation(
        text=text, output_ids=token_ids, log_probs=log_probs, finish_reason=choice.finish_reason,
        prompt_ids=None if prompt is None else ids(prompt),
    )


def parse_completions(raw: bytes, n: int, *, want_logprobs: bool, where: str = "") -> list[Generation]:
    """The ``n`` samples of a ``/v1/completions`` reply, in ``index`` order."""
    reply: _Completion = decode(_COMPLETION, raw, where)
    out = []
    for choice in choices(reply.choices, n, where):
        lp = choice.logprobs
        tokens = lp.tokens if lp is not None else None
        log_probs = floats(lp.token_logprobs, where) if lp is not None and lp.token_logprobs is not None else None
        out.append(_sample(choice, reply.prompt_token_ids, choice.text, tokens, log_probs, want_logprobs, where))
    return out


def parse_chat(raw: bytes, n: int, *, want_logprobs: bool, where: str = "") -> list[Generation]:
    """The ``n`` samples of a ``/v1/chat/completions`` reply, in ``index`` order."""
    reply: _Chat = decode(_CHAT, raw, where)
    out = []
    for choice in choices(reply.choices, n, where):
        content = choice.logprobs.content if choice.logprobs is not None else None
        tokens = [c.token for c in content] if content is not None else None
        log_probs = floats([c.logprob for c in content], where) if content is not None else None
        text = (choice.message.content if choice.message is not None else None) or ""
        out.append(_sample(choice, reply.prompt_token_ids, text, tokens, log_probs, want_logprobs, where))
    return out


def _utf8_tokens(text: str) -> int:
    """At most one token per UTF-8 byte (+ special tokens)."""
    return len(text.encode("utf-8")) + 16


class OpenAI:
    """``--engine-api openai``."""

    name = "openai"
    batches_samples = True
    accepts_messages = True
    needs_token_ids = False
    needs_model = True
    replies_carry_versions = False
    routing_replay = False
    seed_reschedule_kills = False
    version_paths: tuple[str, ...] = ("/weight_info", "/model_info", "/get_model_info")
    """vLLM's (dev mode) first, then SGLang's: the replies of this API carry no version."""
    version_hint = (
        "vLLM answers GET /weight_info (VLLM_SERVER_DEV_MODE=1), SGLang GET /model_info; "
        "--engine-api vllm (vLLM --enable-scale-out) gives per-token version spans"
    )
    loads: tuple[LoadEndpoint, ...] = (METRICS,)  # vLLM's, or SGLang's with --enable-metrics
    abort = Call("/abort_request", {"abort_all": True})
    weights = VLLM_WEIGHTS  # vLLM's dev-mode endpoints behind its OpenAI server

    def encode(self, request: Request, settings: EngineSettings) -> Encoded:
        n = request.n
        body: dict[str, Any] = {
            "model": settings.model, "n": n, "max_tokens": request.max_new_tokens,
            "return_tokens_as_token_ids": True, "return_token_ids": True, **request.sampling,
        }
        if request.messages is not None:
            path = CHAT
            body["messages"] = [dict(m) for m in request.messages]
            if settings.return_logprob:
                body["logprobs"] = True
            prompt_tokens = len(msgspec.json.encode({"messages": body["messages"]})) + 256  # the template adds some
        else:
            path = COMPLETIONS
            text, input_ids = request.text, request.input_ids
            body["prompt"] = text if text is not None else list(input_ids or ())
            if settings.return_logprob:
                body["logprobs"] = 0  # the sampled token's log-prob only
            prompt_tokens = len(input_ids or ()) if text is None else _utf8_tokens(text)
        # vLLM echoes the prompt ids on the reply and on each choice.
        return Encoded(path, body, n, prompt_tokens, prompt_copies=n + 1)

    def decode(self, encoded: Encoded, raw: bytes, settings: EngineSettings, where: str) -> list[Generation]:
        parse = parse_chat if encoded.path == CHAT else parse_completions
        return parse(raw, encoded.weight, want_logprobs=settings.return_logprob, where=where)
