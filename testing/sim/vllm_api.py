"""vLLM's RL and token-in/token-out endpoints (``--enable-scale-out``, ``VLLM_SERVER_DEV_MODE=1``),
as the simulator answers them: ``/inference/v1/generate`` with weight version spans, ``/pause``,
``/resume``, ``/collective_rpc`` (``reload_weights``), ``/update_weight_version``,
``/weight_info``, ``/abort_requests``, ``/reset_prefix_cache``."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from aiohttp import web
from rollstream.testing.sim.model import POISON_MARKER, _routed_experts_npy_b64, detokenize
from rollstream.testing.sim.openai_api import VLLM_MAX_TOKENS, _chat_logprobs, _token_text, _vllm_lengths
from rollstream.testing.sim.shared import (
    _BadRequest,
    _check_poison,
    _error,
    _faultable,
    _generate_all,
    _json_body,
    _sampling_params,
    _token_ids,
)
from rollstream.testing.sim.state import STATE_KEY


async def _vllm_generate(request: web.Request) -> web.Response:
    """``/inference/v1/generate``: token ids in; ids, text, log-probs and weight spans out."""
    state = request.app[STATE_KEY]
    body = await _json_body(request)
    prompt_ids = _token_ids(body.get("token_ids"), "token_ids")
    sampling = _sampling_params(body)
    limit = sampling.get("max_tokens", VLLM_MAX_TOKENS)
    n, max_tokens = _vllm_lengths(sampling, limit, state.config.max_tokens_cap)
    text = detokenize(prompt_ids)
    _check_poison(text)
    rid = f"generate-tokens-{uuid.uuid4().hex}"
    cached = state.cached_prefix(prompt_ids)
    state.cache(prompt_ids)
    outcomes = await _generate_all(state, text, [f"{rid}-{i}" for i in range(n)], max_tokens, len(prompt_ids),
                                   len(prompt_ids) - cached)
    for outcome in outcomes:
        if outcome.finish != "abort":
            state.cache([*prompt_ids, *outcome.output_ids])
    choices = []
    for i, outcome in enumerate(outcomes):
        choice: dict[str, Any] = {
            "index": i,
            "finish_reason": outcome.finish,
            "token_ids": outcome.output_ids,
            "text": detokenize(outcome.output_ids),
            "weight_versions": state.spans(outcome),
            "logprobs": None,
        }
        if state.config.moe is not None:  # vLLM sends it whenever the server has the flag
            choice["routed_experts"] = _routed_experts_npy_b64([*prompt_ids, *outcome.output_ids], state.config.moe)
        if sampling.get("logprobs") is not None:
            choice["logprobs"] = _chat_logprobs(outcome, _token_text)
        choices.append(choice)
    return web.json_response({"request_id": rid, "output_mode": "text", "choices": choices})


async def _vllm_pause(request: web.Request) -> web.Response:
    """``/pause?mode=abort|wait|keep``: new requests wait; abort ends the ones in flight, wait
    returns when they have finished, keep lets them run (the simulator cannot freeze them)."""
    state = request.app[STATE_KEY]
    mode = request.query.get("mode", "abort")
    if mode not in ("abort", "wait", "keep"):
        raise _BadRequest(f"unknown pause mode {mode!r}")
    clear_cache = request.query.get("clear_cache")
    state.pauses.append((mode, clear_cache))
    state.resumed.clear()
    if (clear_cache or "true").lower() != "false":  # vLLM's default: the pause resets the prefix cache
        state.reset_cache()
    if mode == "abort":
        state.abort()
    elif mode == "wait":
        while state.jobs and not state.closing.is_set():  # noqa: ASYNC110 (jobs end on their own)
            await asyncio.sleep(0.01)
    return web.json_response({"status": "paused"})


async def _vllm_resume(request: web.Request) -> web.Response:
    request.app[STATE_KEY].resumed.set()
    return web.json_response({"status": "resumed"})


async def _vllm_collective_rpc(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await _json_body(request)
    if body.get("method") != "reload_weights":
        raise _BadRequest(f"the simulator only runs reload_weights, not {body.get('method')!r}")
    kwargs = body.get("kwargs") or {}
    path = kwargs.get("weights_path") if isinstance(kwargs, dict) else None
    if not isinstance(path, str) or not path:
        raise _BadRequest("reload_weights needs kwargs.weights_path")
    if POISON_MARKER in path:
        return _error(500, f"cannot load weights from {path}")
    state.reloads.append(path)
    await state.reload()  # the prefix cache is kept, as vLLM keeps it: its KV is now stale
    return web.json_response({"results": [None]})


async def _vllm_reset_prefix_cache(request: web.Request) -> web.Response:
    """``/reset_prefix_cache``: the prefix cache emptied (the requests running are not touched)."""
    request.app[STATE_KEY].reset_cache()
    return web.Response(status=200)


async def _vllm_update_weight_version(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await _json_body(request)
    try:
        state.set_version(int(body.get("new_version", "")))
    except (TypeError, ValueError) as exc:
        raise _BadRequest(f"the simulator takes integer versions, got {body.get('new_version')!r}") from exc
    return web.json_response({"success": True, "new_version": str(state.weight_version)})


async def _vllm_weight_info(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if state.model_info_mode == "absent":  # vLLM without VLLM_SERVER_DEV_MODE
        return _error(404, "Not Found")
    if state.model_info_mode == "missing":
        return web.json_response({})
    return web.json_response({"weight_version": str(state.weight_version)})


async def _vllm_abort_requests(request: web.Request) -> web.Response:
    count = request.app[STATE_KEY].abort()
    return web.json_response({"status": "aborted", "aborted": count})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/inference/v1/generate", _faultable(_vllm_generate))
    app.router.add_post("/pause", _vllm_pause)
    app.router.add_post("/resume", _vllm_resume)
    app.router.add_post("/collective_rpc", _vllm_collective_rpc)
    app.router.add_post("/update_weight_version", _vllm_update_weight_version)
    app.router.add_get("/weight_info", _vllm_weight_info)
    app.router.add_post("/abort_requests", _vllm_abort_requests)
    app.router.add_post("/reset_prefix_cache", _vllm_reset_prefix_cache)
