"""vLLM's OpenAI-compatible API, as the simulator answers it: ``/v1/models``,
``/v1/completions`` and ``/v1/chat/completions`` (rendered by :func:`render_chat`); no weight
version (vLLM reports none there)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web
from rollstream.testing.sim.base import (
    _BadRequest,
    _check_poison,
    _error,
    _faultable,
    _generate_all,
    _int_param,
    _json_body,
    _token_ids,
)
from rollstream.testing.sim.model import MAX_MODEL_LEN, MODEL_NAME, detokenize, tokenize
from rollstream.testing.sim.state import STATE_KEY


def _openai_reply(
    body: dict[str, Any],
    reply_id: str,
    kind: str,
    choices: list[dict[str, Any]],
    prompt_ids: list[int],
    completion_tokens: int,
    return_token_ids: bool,
) -> web.Response:
    """The envelope shared by ``/v1/completions`` and ``/v1/chat/completions``."""
    reply: dict[str, Any] = {
        "id": reply_id,
        "object": kind,
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
    state = request.app[STATE_KEY]
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
    n = _int_param(body.get("n"), "n", 1, minimum=1)
    max_tokens = _int_param(body.get("max_tokens", 16), "max_tokens", state.config.max_tokens_cap)
    logprobs = body.get("logprobs")
    if logprobs is not None:
        _int_param(logprobs, "logprobs", 0)
    as_token_ids = bool(body.get("return_tokens_as_token_ids"))
    return_token_ids = bool(body.get("return_token_ids"))
    _check_poison(text)

    cmpl_id = f"cmpl-{uuid.uuid4().hex}"
    outcomes = await _generate_all(state, text, [f"{cmpl_id}-{i}" for i in range(n)], max_tokens)
    if outcomes is None:
        return _error(503, "the engine is shutting down")

    choices: list[dict[str, Any]] = []
    completion_tokens = 0
    for i, outcome in enumerate(outcomes):
        completion_tokens += len(outcome.output_ids)
        choice: dict[str, Any] = {
            "index": i,
            "text": detokenize(outcome.output_ids),
            "logprobs": None,
            "finish_reason": outcome.finish,
            "stop_reason": None,
        }
        if logprobs is not None:
            choice["logprobs"] = {
                "tokens": [
                    f"token_id:{tid}" if as_token_ids else detokenize([tid])
                    for tid in outcome.output_ids
                ],
                "token_logprobs": outcome.logprobs,
                "top_logprobs": None,
                "text_offset": list(range(len(outcome.output_ids))),
            }
        if return_token_ids:
            choice["token_ids"] = outcome.output_ids
            choice["prompt_token_ids"] = prompt_ids
        choices.append(choice)
    return _openai_reply(body, cmpl_id, "text_completion", choices, prompt_ids, completion_tokens, return_token_ids)


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
    state = request.app[STATE_KEY]
    body = await _json_body(request)
    text = render_chat(body.get("messages"))
    prompt_ids = tokenize(text)
    n = _int_param(body.get("n"), "n", 1, minimum=1)
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _int_param(limit, "max_tokens", state.config.max_tokens_cap)
    want_logprobs = bool(body.get("logprobs"))
    as_token_ids = bool(body.get("return_tokens_as_token_ids"))
    return_token_ids = bool(body.get("return_token_ids"))
    _check_poison(text)

    chat_id = f"chatcmpl-{uuid.uuid4().hex}"
    outcomes = await _generate_all(state, text, [f"{chat_id}-{i}" for i in range(n)], max_tokens)
    if outcomes is None:
        return _error(503, "the engine is shutting down")
    choices: list[dict[str, Any]] = []
    completion_tokens = 0
    for i, outcome in enumerate(outcomes):
        completion_tokens += len(outcome.output_ids)
        choice: dict[str, Any] = {
            "index": i,
            "message": {"role": "assistant", "content": detokenize(outcome.output_ids)},
            "logprobs": None,
            "finish_reason": outcome.finish,
            "stop_reason": None,
        }
        if want_logprobs:
            choice["logprobs"] = {
                "content": [
                    {
                        "token": f"token_id:{tid}" if as_token_ids else detokenize([tid]),
                        "logprob": lp,
                        "top_logprobs": [],
                    }
                    for tid, lp in zip(outcome.output_ids, outcome.logprobs, strict=True)
                ]
            }
        if return_token_ids:
            choice["token_ids"] = outcome.output_ids
        choices.append(choice)
    return _openai_reply(body, chat_id, "chat.completion", choices, prompt_ids, completion_tokens, return_token_ids)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/completions", _faultable(_completions))
    app.router.add_post("/v1/chat/completions", _faultable(_chat_completions))
