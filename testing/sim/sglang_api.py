"""SGLang's native HTTP API, as the simulator answers it: ``/generate`` (with routing replay and
teacher scoring), abort, pause / continue, ``/update_weights_from_disk``, model and server info,
health, tokenize / detokenize."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from typing import Any

from aiohttp import web
from rollstream.testing.sim.model import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    _routed_experts_b64,
    _teacher_reply,
    detokenize,
    tokenize,
)
from rollstream.testing.sim.shared import (
    HANG_SECONDS,
    _BadRequest,
    _check_poison,
    _error,
    _faultable,
    _generate_all,
    _int_param,
    _json_body,
    _sampling_params,
    _token_ids,
)
from rollstream.testing.sim.state import STATE_KEY

NOT_TAKEN = "NOT-TAKEN"
"""A ``/update_weights_from_disk`` model path holding this answers success and loads nothing."""

logger = logging.getLogger(__name__)


async def _generate(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await _json_body(request)
    if body.get("text") is not None:
        text = body["text"]
        if not isinstance(text, str):
            raise _BadRequest("text must be a string (batches are not supported)")
        input_ids = tokenize(text)
    elif body.get("input_ids") is not None:
        input_ids = _token_ids(body["input_ids"], "input_ids")
        text = detokenize(input_ids)
    else:
        raise _BadRequest("either text or input_ids is required")
    sampling = _sampling_params(body)
    max_new_tokens = _int_param(sampling.get("max_new_tokens"), "max_new_tokens", 128)
    if max_new_tokens == 0 and body.get("return_logprob"):  # a teacher scoring its input
        _check_poison(text)
        logprob_start = _int_param(body.get("logprob_start_len"), "logprob_start_len", 0)
        return web.json_response(_teacher_reply(input_ids, logprob_start))
    rid = body.get("rid")
    if rid is None:
        rid = uuid.uuid4().hex
    elif not isinstance(rid, str):
        raise _BadRequest("rid must be a string (batches are not supported)")
    _check_poison(text)

    start = time.monotonic()
    cached = state.cached_prefix(input_ids)
    if state.config.prefill_per_token and not state.config.kv_capacity_tokens:  # else the scheduler's
        await asyncio.sleep(state.config.prefill_per_token * (len(input_ids) - cached))
    state.cache(input_ids)  # a radix cache holds the prompt once it is prefilled
    (outcome,) = await _generate_all(state, text, [rid], max_new_tokens, len(input_ids), len(input_ids) - cached)
    if outcome.finish != "abort":
        state.cache([*input_ids, *outcome.output_ids])

    finish_reason: dict[str, Any] = {"type": outcome.finish}
    if outcome.finish == "length":
        finish_reason["length"] = max_new_tokens
    elif outcome.finish == "abort":
        finish_reason["message"] = outcome.abort_message
        finish_reason["status_code"] = 200
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason,
        "prompt_tokens": len(input_ids),
        "completion_tokens": len(outcome.output_ids),
        "cached_tokens": cached,
        "e2e_latency": time.monotonic() - start,
    }
    if state.report_weight_version:
        meta["weight_version"] = str(state.weight_version)
    if body.get("return_logprob"):
        meta["output_token_logprobs"] = [
            [lp, tid, None] for lp, tid in zip(outcome.logprobs, outcome.output_ids, strict=True)
        ]
    if body.get("return_routed_experts") and state.config.moe is not None:
        meta["routed_experts"] = _routed_experts_b64([*input_ids, *outcome.output_ids], state.config.moe)
    return web.json_response(
        {
            "text": detokenize(outcome.output_ids),
            "output_ids": outcome.output_ids,
            "meta_info": meta,
        }
    )


async def _abort_request(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await _json_body(request, optional=True)
    if body.get("abort_all"):
        state.abort()
    elif body.get("rid") is not None:
        state.abort(str(body["rid"]))
    return web.json_response({})


async def _pause_generation(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await _json_body(request, optional=True)
    mode = body.get("mode", "abort")
    if mode not in ("abort", "retract", "in_place"):
        raise _BadRequest(f"unknown pause mode {mode!r}")
    state.resumed.clear()
    state.sglang_pause = mode
    aborted = state.abort() if mode == "abort" else 0
    logger.info("generation paused (mode %s, %d requests aborted)", mode, aborted)
    return web.json_response({"success": True, "message": f"paused, {aborted} aborted"})


async def _continue_generation(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    state.resumed.set()
    state.sglang_pause = None
    logger.info("generation continued")
    return web.json_response({"success": True, "message": "continued"})


async def _update_weights_from_disk(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await _json_body(request)
    version = body.get("weight_version")
    path = str(body.get("model_path"))
    if version is not None:
        try:
            version = int(version)
        except (TypeError, ValueError) as exc:
            raise _BadRequest(f"weight_version must be an integer, got {version!r}") from exc
    flush = body.get("flush_cache", True) is not False
    if flush and state.sglang_pause == "in_place" and state.jobs:
        # SGLang: an in_place pause leaves the requests holding their KV, so the reload's flush
        # refuses and the scheduler's assert on it stops the server (docs/engines.md)
        return _error(500, "Cache not flushed because there are pending requests")
    state.reloads.append(path)
    if NOT_TAKEN in path:  # a reload that answers success and loads nothing (a broken checkpoint)
        logger.info("weights 'updated' from %r: not taken, still version %d", path, state.weight_version)
    else:
        await state.reload()
        state.set_version(state.weight_version + 1 if version is None else version)
    # SGLang flushes its radix cache in the reload (flush_cache, on by default; its scheduler
    # asserts the flush, which needs no request running: unpaused, the reload first waits for the
    # requests in flight, which the simulator does not)
    if flush:
        state.reset_cache()
    logger.info("weights updated from %r, version %d", body.get("model_path"), state.weight_version)
    return web.json_response(
        {
            "success": True,
            "message": f"Succeeded to update model weights (version {state.weight_version}).",
            "num_paused_requests": 0,
        }
    )


async def _model_info(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    mode = state.model_info_mode
    if mode in ("vllm", "absent"):  # vLLM's server has no /model_info
        return _error(404, "Not Found")
    if mode == "hang":
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(state.closing.wait(), timeout=HANG_SECONDS)
    if mode == "garbage":
        return web.Response(text="<html>not json", content_type="text/html")
    if mode == "error":
        return _error(500, "injected model_info fault")
    info: dict[str, Any] = {
        "model_path": MODEL_NAME,
        "tokenizer_path": None,
        "is_generation": True,
        "weight_version": str(state.weight_version),
    }
    if mode == "missing":
        del info["weight_version"]
    elif mode == "non_integer":
        info["weight_version"] = "abc"
    return web.json_response(info)


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _server_info(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    return web.json_response(
        {
            "version": "rollstream-sim",
            "model_path": MODEL_NAME,
            "sim_config": dataclasses.asdict(state.config),
            "weight_version": str(state.weight_version),
            "max_running_requests": state.config.max_running,
            "internal_states": [state.stats()],
        }
    )


async def _get_load(request: web.Request) -> web.Response:
    """SGLang's ``/get_load``: one object per DP rank (requests, waiting ones, tokens in use)."""
    state = request.app[STATE_KEY]
    if not state.load_endpoints:
        return _error(404, "Not Found")
    stats = state.stats()
    return web.json_response([{"dp_rank": 0, "num_reqs": stats["running"] + stats["waiting"],
                               "num_waiting_reqs": stats["waiting"], "num_tokens": state.kv_used}])


async def _loads(request: web.Request) -> web.Response:
    """SGLang's ``/v1/loads``: per DP rank, running and waiting requests and the token usage."""
    state = request.app[STATE_KEY]
    if not state.load_endpoints:
        return _error(404, "Not Found")
    stats = state.stats()
    load = {
        "dp_rank": 0, "num_running_reqs": stats["running"], "num_waiting_reqs": stats["waiting"],
        "num_total_reqs": stats["running"] + stats["waiting"], "num_used_tokens": state.kv_used,
        "max_total_num_tokens": state.config.kv_capacity_tokens,
    }
    usage = state.kv_usage()
    if usage is not None:
        load["token_usage"] = usage
    return web.json_response({"timestamp": time.time(), "dp_rank_count": 1, "loads": [load]})


async def _tokenize(request: web.Request) -> web.Response:
    body = await _json_body(request)
    text = body.get("prompt", body.get("text"))
    if not isinstance(text, str):
        raise _BadRequest("prompt must be a string")
    tokens = tokenize(text)
    return web.json_response(
        {"tokens": tokens, "count": len(tokens), "max_model_len": MAX_MODEL_LEN}
    )


async def _detokenize(request: web.Request) -> web.Response:
    body = await _json_body(request)
    text = detokenize(_token_ids(body.get("tokens"), "tokens"))
    return web.json_response({"text": text, "prompt": text})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/generate", _faultable(_generate))
    app.router.add_post("/abort_request", _abort_request)
    app.router.add_post("/pause_generation", _pause_generation)
    app.router.add_post("/continue_generation", _continue_generation)
    app.router.add_post("/update_weights_from_disk", _update_weights_from_disk)
    app.router.add_get("/model_info", _model_info)
    app.router.add_get("/get_model_info", _model_info)
    app.router.add_get("/health", _health)
    app.router.add_get("/health_generate", _health)
    app.router.add_get("/get_server_info", _server_info)
    app.router.add_get("/server_info", _server_info)  # what the SGLang gateway asks first
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_get("/get_load", _get_load)
    app.router.add_get("/v1/loads", _loads)
    app.router.add_post("/detokenize", _detokenize)
