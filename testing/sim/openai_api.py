"""vLLM's OpenAI-compatible API, as the simulator answers it: ``/v1/models``,
``/v1/completions`` and ``/v1/chat/completions`` (rendered by :func:`render_chat`); no weight
version (vLLM reports none there). The two completion endpoints share their parsing, choices
and envelope (:func:`_answer`); each handler reads only its prompt, and its :class:`_Endpoint`
says how its options and its reply differ. :mod:`.vllm_api` reads ``n`` and the token limit and renders chat log-probs
with the helpers here too, as vLLM's token endpoint reuses the OpenAI protocol."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from rollstream.testing.sim.model import MAX_MODEL_LEN, MODEL_NAME, detokenize, tokenize
from rollstream.testing.sim.shared import (
    _BadRequest,
    _check_poison,
    _error,
    _faultable,
    _generate_all,
    _int_param,
    _json_body,
    _token_ids,
)
from rollstream.testing.sim.state import STATE_KEY, SimState, _Outcome

VLLM_MAX_TOKENS = 16
"""vLLM's token limit for a completion that names none (``/v1/completions``, ``/inference/v1/generate``)."""

TokenLabel = Callable[[int], str]
"""How a log-prob entry names its token: its text, or ``token_id:N`` (``return_tokens_as_token_ids``)."""


def _vllm_lengths(params: dict[str, Any], limit: Any, cap: int) -> tuple[int, int]:
    """``n`` (default 1) and the token limit (``max_tokens``; None: the simulator's cap), as every
    vLLM endpoint reads them from its options (the body, or ``sampling_params``)."""
    return _int_param(params.get("n"), "n", 1, minimum=1), _int_param(limit, "max_tokens", cap)


def _token_text(tid: int) -> str:
    return detokenize([tid])


def _token_label(as_token_ids: bool) -> TokenLabel:
    return (lambda tid: f"token_id:{tid}") if as_token_ids else _token_text


def _chat_logprobs(outcome: _Outcome, label: TokenLabel) -> dict[str, Any]:
    """The chat form of log-probs, ``content[]`` (vLLM's ``/inference/v1/generate`` answers it too)."""
    return {
        "content": [
            {"token": label(tid), "logprob": lp, "top_logprobs": []}
            for tid, lp in zip(outcome.output_ids, outcome.logprobs, strict=True)
        ]
    }


def _completion_logprobs(outcome: _Outcome, label: TokenLabel) -> dict[str, Any]:
    """The legacy completion form of log-probs: parallel lists."""
    return {
        "tokens": [label(tid) for tid in outcome.output_ids],
        "token_logprobs": outcome.logprobs,
        "top_logprobs": None,
        "text_offset": list(range(len(outcome.output_ids))),
    }


def _completion_logprobs_wanted(body: dict[str, Any]) -> bool:
    """``logprobs`` is an integer (how many top log-probs) on ``/v1/completions``; present: log-probs."""
    logprobs = body.get("logprobs")
    if logprobs is not None:
        _int_param(logprobs, "logprobs", 0)
    return logprobs is not None


@dataclass(frozen=True)
class _Endpoint:
    """What one completion endpoint reads and answers differently (the rest is :func:`_answer`)."""

    kind: str
    """The reply's ``object``."""
    id_prefix: str
    limit: Callable[[dict[str, Any]], Any]
    """The token limit the body names (None: the simulator's cap)."""
    logprobs_wanted: Callable[[dict[str, Any]], bool]
    """Whether the body asks for log-probs (raising :class:`_BadRequest` for a bad value)."""
    content: Callable[[str], dict[str, Any]]
    """A choice's output from its text: ``text``, or ``message``."""
    logprobs: Callable[[_Outcome, TokenLabel], dict[str, Any]]
    prompt_ids_in_choices: bool
    """Whether each choice repeats ``prompt_token_ids`` (``return_token_ids``), besides the reply."""


_COMPLETIONS = _Endpoint(
    kind="text_completion",
    id_prefix="cmpl",
    limit=lambda body: body.get("max_tokens", VLLM_MAX_TOKENS),
    logprobs_wanted=_completion_logprobs_wanted,
    content=lambda text: {"text": text},
    logprobs=_completion_logprobs,
    prompt_ids_in_choices=True,
)
_CHAT_COMPLETIONS = _Endpoint(
    kind="chat.completion",
    id_prefix="chatcmpl",
    limit=lambda body: body.get("max_completion_tokens", body.get("max_tokens")),
    logprobs_wanted=lambda body: bool(body.get("logprobs")),
    content=lambda text: {"message": {"role": "assistant", "content": text}},
    logprobs=_chat_logprobs,
    prompt_ids_in_choices=False,
)


async def _answer(
    state: SimState, body: dict[str, Any], endpoint: _Endpoint, text: str, prompt_ids: list[int]
) -> web.Response:
    """Read the options of a completion request whose prompt is ``text`` (``prompt_ids``),
    generate its ``n`` choices and answer them as ``endpoint`` does."""
    n, max_tokens = _vllm_lengths(body, endpoint.limit(body), state.config.max_tokens_cap)
    want_logprobs = endpoint.logprobs_wanted(body)
    label = _token_label(bool(body.get("return_tokens_as_token_ids")))
    return_token_ids = bool(body.get("return_token_ids"))
    _check_poison(text)

    reply_id = f"{endpoint.id_prefix}-{uuid.uuid4().hex}"
    outcomes = await _generate_all(state, text, [f"{reply_id}-{i}" for i in range(n)], max_tokens,
                                   len(tokenize(text)))
    choices: list[dict[str, Any]] = []
    for i, outcome in enumerate(outcomes):
        choice: dict[str, Any] = {
            "index": i,
            **endpoint.content(detokenize(outcome.output_ids)),
            "logprobs": endpoint.logprobs(outcome, label) if want_logprobs else None,
            "finish_reason": outcome.finish,
            "stop_reason": None,
        }
        if return_token_ids:
            choice["token_ids"] = outcome.output_ids
            if endpoint.prompt_ids_in_choices:
                choice["prompt_token_ids"] = prompt_ids
        choices.append(choice)
    completion_tokens = sum(len(outcome.output_ids) for outcome in outcomes)
    reply: dict[str, Any] = {
        "id": reply_id,
        "object": endpoint.kind,
        "created": int(time.time()),
        "model": body.get("model") or MODEL_NAME,
        "choices": choices,
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt_ids) + completion_tokens,
        },
    }
    if return_token_ids:
        reply["prompt_token_ids"] = prompt_ids
    return web.json_response(reply)


async def _models(request: web.Request) -> web.Response:
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": MODEL_NAME,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "rollstream",
                    "root": MODEL_NAME,
                    "max_model_len": MAX_MODEL_LEN,
                }
            ],
        }
    )


async def _completions(request: web.Request) -> web.Response:
    """``/v1/completions``: ``prompt`` as text or token ids, ``n``, ``max_tokens`` (default 16),
    ``logprobs`` (an integer), ``return_tokens_as_token_ids``, ``return_token_ids``."""
    body = await _json_body(request)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        text = prompt
        prompt_ids = tokenize(text)
    elif isinstance(prompt, list):
        prompt_ids = _token_ids(prompt, "prompt")
        text = detokenize(prompt_ids)
    else:
        raise _BadRequest("prompt must be a string or a list of token ids")
    return await _answer(request.app[STATE_KEY], body, _COMPLETIONS, text, prompt_ids)


def render_chat(messages: Any) -> str:
    """The simulator's chat template: ``<|role|>\ncontent\n`` per message, then ``<|assistant|>\n``."""
    if not isinstance(messages, list) or not messages:
        raise _BadRequest("messages must be a non-empty list")
    parts = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise _BadRequest("each message must be an object with a string content")
        parts.append(f"<|{message.get('role', 'user')}|>\n{message['content']}\n")
    return "".join(parts) + "<|assistant|>\n"


async def _chat_completions(request: web.Request) -> web.Response:
    """vLLM's ``/v1/chat/completions`` subset: ``messages``, ``n``, ``max_tokens``
    (or ``max_completion_tokens``), ``logprobs``, ``return_tokens_as_token_ids``, ``return_token_ids``."""
    body = await _json_body(request)
    text = render_chat(body.get("messages"))
    return await _answer(request.app[STATE_KEY], body, _CHAT_COMPLETIONS, text, tokenize(text))


async def _metrics(request: web.Request) -> web.Response:
    """vLLM's ``/metrics`` (Prometheus text): its load gauges and preemption counter."""
    state = request.app[STATE_KEY]
    if not state.load_endpoints:
        return _error(404, "Not Found")
    stats = state.stats()
    label = f'{{engine="0",model_name="{MODEL_NAME}"}}'
    lines = [
        "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{label} {stats['running']}.0",
        "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{label} {stats['waiting']}.0",
        "# TYPE vllm:num_preemptions_total counter", f"vllm:num_preemptions_total{label} {state.preemptions}.0",
    ]
    usage = state.kv_usage()
    if usage is not None:  # a simulator without a KV capacity has none to report
        lines += ["# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc{label} {usage}"]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def add_routes(app: web.Application) -> None:
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/completions", _faultable(_completions))
    app.router.add_post("/v1/chat/completions", _faultable(_chat_completions))
