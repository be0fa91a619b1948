"""What every simulated API shares: request parsing (a bad request is HTTP 400 through the
middleware), the fault injection in front of generation endpoints (``/sim/faults``), the
simulator's own control endpoints (``/sim/faults``, ``/sim/stats``) and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from rollstream.common.checked import is_int, is_number
from rollstream.testing.sim.model import POISON_MARKER, _plan_response
from rollstream.testing.sim.state import STATE_KEY, SimState, _Outcome

MODEL_INFO_MODES = ("ok", "garbage", "error", "missing", "non_integer", "hang", "vllm", "absent")
FAULT_STATUSES = (429, 500, 503)
BAD_REPLY_MODES = ("not_json", "schema", "too_large", "hang")
HANG_SECONDS = 30.0


class _BadRequest(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _ShuttingDown(Exception):
    """Raised by a generation the shutdown overtook while paused: HTTP 503 through the middleware."""


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


async def _json_body(request: web.Request, *, optional: bool = False) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        if optional:
            return {}
        raise _BadRequest("empty request body")
    try:
        parsed = json.loads(raw)
    except ValueError as exc:
        raise _BadRequest(f"invalid JSON body: {exc}") from exc
    if not isinstance(parsed, dict):
        raise _BadRequest("the JSON body must be an object")
    return parsed


def _int_param(value: Any, name: str, default: int, *, minimum: int = 0) -> int:
    if value is None:
        return default
    if not is_int(value) or value < minimum:
        raise _BadRequest(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _token_ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(
        is_int(i) for i in value
    ):
        raise _BadRequest(f"{name} must be a list of token ids (batches are not supported)")
    return value


def _sampling_params(body: dict[str, Any]) -> dict[str, Any]:
    """``sampling_params``, the object of options SGLang's ``/generate`` and vLLM's
    ``/inference/v1/generate`` both take (absent or null: none)."""
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise _BadRequest("sampling_params must be an object")
    return sampling


def _check_poison(text: str) -> None:
    if POISON_MARKER in text:
        raise _BadRequest(f"the input contains the marker {POISON_MARKER}: request refused")


@web.middleware
async def errors_middleware(
    request: web.Request, handler: Callable[[web.Request], Any]
) -> web.StreamResponse:
    wedge = not request.path.startswith("/sim/")
    state = request.app[STATE_KEY]
    try:
        if wedge:
            await state.unwedged.wait()  # a wedged engine accepts, and never answers
        response: web.StreamResponse = await handler(request)
        if wedge:
            await state.unwedged.wait()
        return response
    except _BadRequest as exc:
        return _error(400, exc.message)
    except _ShuttingDown:
        return _error(503, "the engine is shutting down")


def _rng(state: SimState, text: str, choice: int) -> random.Random:
    """The random source of one reply: the engine's own stream, or with ``deterministic`` one
    seeded by the seed, the input and the choice's number only."""
    if not state.config.deterministic:
        return random.Random(state.rng.getrandbits(64))
    digest = hashlib.blake2b(f"{state.config.seed}:{choice}:{text}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


async def _generate_all(state: SimState, text: str, rids: list[str], max_tokens: int,
                        prompt_tokens: int = 0, prefill_tokens: int | None = None) -> list[_Outcome]:
    """Plan one response per request id, wait out a pause, generate them concurrently; raises
    :class:`_ShuttingDown` when the engine shuts down while paused. The prompt's tokens (and the
    uncached ones) count with a KV capacity."""
    plans = [_plan_response(state.config, text, _rng(state, text, i)) for i in range(len(rids))]
    if not await state.wait_resumed():
        raise _ShuttingDown
    runs = (state.generate(rid, plan, max_tokens, prompt_tokens, prefill_tokens)
            for rid, plan in zip(rids, plans, strict=True))
    return list(await asyncio.gather(*runs))



Handler = Callable[[web.Request], Awaitable[web.Response]]


def _faultable(handler: Handler) -> Handler:
    """A generation endpoint that first answers an injected fault (``/sim/faults``), if one is due."""

    async def handle(request: web.Request) -> web.Response:
        state = request.app[STATE_KEY]
        status = state.take_fault()
        if status is not None:
            return _error(status, f"injected fault: HTTP {status}")
        bad = state.take_bad_reply()
        if bad is not None:
            return await _bad_reply(state, bad)
        return await handler(request)

    return handle


async def _bad_reply(state: SimState, mode: str) -> web.Response:
    """An HTTP 200 reply no client can use (``/sim/faults`` ``bad_reply``)."""
    if mode == "hang":
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(state.closing.wait(), timeout=HANG_SECONDS)
        return _error(503, "the engine is shutting down")
    if mode == "schema":
        return web.json_response({"unexpected": "shape", "meta_info": 7})
    if mode == "too_large":
        filler = state.bad_reply_bytes - len('{"text": ""}')
        return web.Response(body=b'{"text": "' + b"x" * max(0, filler) + b'"}', content_type="application/json")
    return web.Response(text="<html>502 bad gateway</html>", content_type="application/json")


async def _set_faults(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await _json_body(request)
    if "generate_errors" in body:
        count = body["generate_errors"]
        if not is_int(count) or count < -1:
            raise _BadRequest("generate_errors must be an integer >= -1")
        status = body.get("generate_error_status", 500)
        if status not in FAULT_STATUSES:
            raise _BadRequest(f"generate_error_status must be one of {FAULT_STATUSES}")
        state.generate_errors = count
        state.generate_error_status = status
    if "model_info" in body:
        if body["model_info"] not in MODEL_INFO_MODES:
            raise _BadRequest(f"model_info must be one of {MODEL_INFO_MODES}")
        state.model_info_mode = body["model_info"]
    if "report_weight_version" in body:
        if not isinstance(body["report_weight_version"], bool):
            raise _BadRequest("report_weight_version must be a boolean")
        state.report_weight_version = body["report_weight_version"]
    if "load_endpoints" in body:
        if not isinstance(body["load_endpoints"], bool):
            raise _BadRequest("load_endpoints must be a boolean")
        state.load_endpoints = body["load_endpoints"]
    if "reload_seconds" in body:
        seconds = body["reload_seconds"]
        if not is_number(seconds) or not 0 <= seconds <= HANG_SECONDS:
            raise _BadRequest(f"reload_seconds must be a number of seconds within [0, {HANG_SECONDS}]")
        state.reload_seconds = float(seconds)
    if "wedge" in body:
        if not isinstance(body["wedge"], bool):
            raise _BadRequest("wedge must be a boolean")
        if body["wedge"]:
            state.unwedged.clear()
        else:
            state.unwedged.set()
    if "bad_replies" in body:
        count = body["bad_replies"]
        if not is_int(count) or count < -1:
            raise _BadRequest("bad_replies must be an integer >= -1")
        mode = body.get("bad_reply", "not_json")
        if mode not in BAD_REPLY_MODES:
            raise _BadRequest(f"bad_reply must be one of {BAD_REPLY_MODES}")
        size = _int_param(body.get("bad_reply_bytes"), "bad_reply_bytes", 2**20, minimum=16)
        state.bad_replies, state.bad_reply_mode, state.bad_reply_bytes = count, mode, size
    return web.json_response(
        {
            "generate_errors": state.generate_errors,
            "generate_error_status": state.generate_error_status,
            "model_info": state.model_info_mode,
            "report_weight_version": state.report_weight_version,
            "bad_replies": state.bad_replies,
            "bad_reply": state.bad_reply_mode,
            "wedge": not state.unwedged.is_set(),
            "load_endpoints": state.load_endpoints,
            "reload_seconds": state.reload_seconds,
        }
    )


async def _restart(request: web.Request) -> web.Response:
    """``POST /sim/restart`` ``{"version": V}`` (default 0): the engine restarted on its base weights."""
    state = request.app[STATE_KEY]
    body = await _json_body(request, optional=True)
    version = _int_param(body.get("version"), "version", 0)
    state.restart(version)
    return web.json_response({"weight_version": state.weight_version, "restarts": state.restarts})


async def _stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE_KEY].stats())


async def _on_shutdown(app: web.Application) -> None:
    state = app[STATE_KEY]
    state.closing.set()
    state.unwedged.set()
    state.abort()


def add_routes(app: web.Application) -> None:
    """The simulator's own control endpoints."""
    app.on_shutdown.append(_on_shutdown)
    app.router.add_post("/sim/faults", _set_faults)
    app.router.add_get("/sim/stats", _stats)
    app.router.add_post("/sim/restart", _restart)
