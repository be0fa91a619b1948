"""A simulated inference engine: a **test double for SGLang and vLLM, not a model**.

It is an aiohttp server speaking the subset of SGLang's native HTTP API and vLLM's
OpenAI-compatible API that rollstream uses, so the pipeline can be tested and benchmarked
without GPUs. Nothing is learned or computed from weights: the "model" finds the last
arithmetic expression in the prompt, answers it correctly with probability
:attr:`SimConfig.accuracy`, and pads the answer with digit-free filler text.

Toy tokenizer
    Token ids are the UTF-8 bytes of the text (ids 0..255): ``tokenize(text)`` is
    ``list(text.encode())`` and ``detokenize(ids)`` is ``bytes(i & 0xFF for i in ids)``
    decoded as UTF-8 with replacement. One token is one byte.

Responses
    ``<filler of lowercase letters and spaces> The answer is \\boxed{N}.`` whose total length
    ``L`` (in tokens) is drawn per request from a log-normal distribution with mean
    :attr:`SimConfig.mean_tokens` and sigma :attr:`SimConfig.length_sigma`, clipped to
    ``[len(" The answer is \\boxed{N}."), max_tokens_cap]``. The filler has no digits, so a
    continuation's input (prompt + partial response) holds no new arithmetic expression. If the
    request allows fewer than ``L`` new tokens the response is truncated (finish reason
    ``length``). Generation holds one of :attr:`SimConfig.max_running` slots (more requests
    queue) for ``base_latency + latency_per_token * tokens`` seconds; tokens accrue over that
    time, so an abort in the middle returns the tokens generated so far (finish reason
    ``abort``); a client that disconnects frees its slot. ``meta_info.weight_version`` is the
    version when the reply is sent. Sampling parameters other than the length limit
    (temperature, top_p, stop, ...) are accepted and ignored. An input containing ``POISON``
    is refused with HTTP 400.

Routing replay and teacher scoring
    With :attr:`SimConfig.moe` ``(layers, topk, experts)``, a ``/generate`` request with
    ``return_routed_experts`` gets ``meta_info.routed_experts`` in SGLang's shape: base64 of
    little-endian int32, ``(input + output tokens - 1) x layers x topk``, row ``i`` routing token
    ``i`` to the experts :func:`routed_expert` names (a function of that token, so a test can check
    every row against the tokens). A request with ``max_new_tokens`` 0 and ``return_logprob`` is
    a teacher scoring its input: ``meta_info.input_token_logprobs`` has ``[logprob, token_id,
    null]`` for every input token from ``logprob_start_len`` on (null at position 0), the
    log-prob being :func:`teacher_logprob` of the token and the one before it.

SGLang endpoints
    ``POST /generate``, ``POST /abort_request``, ``POST /pause_generation``,
    ``POST /continue_generation``, ``POST /update_weights_from_disk``, ``GET /model_info``,
    ``GET /get_model_info``, ``GET /health``, ``GET /health_generate``, ``GET /get_server_info``,
    ``POST /tokenize``, ``POST /detokenize``, ``GET /v1/models``.
    ``/pause_generation`` with mode ``abort`` (the default) aborts every in-flight request;
    other modes only hold new requests. While paused, new generation requests wait (they are
    not rejected) until ``/continue_generation``.

vLLM (OpenAI-compatible) endpoint
    ``POST /v1/completions`` with ``prompt`` (a string or a list of token ids), ``n``,
    ``max_tokens``, ``logprobs``, ``return_tokens_as_token_ids`` and ``return_token_ids``.
    ``POST /v1/chat/completions`` with ``messages`` (rendered by :func:`render_chat`) and the
    same options (``logprobs: true``). No weight version is reported there (vLLM does not
    report one).

Fault injection (for tests of retries and fallbacks)
    ``POST /sim/faults`` with a JSON object holding any of:

    * ``"generate_errors": K`` and ``"generate_error_status": S`` (429, 500 or 503; default
      500): the next ``K`` ``/generate`` or ``/v1/completions`` requests answer HTTP ``S``
      without generating; ``K = -1`` means forever, ``K = 0`` clears the fault.
    * ``"model_info"``: ``"ok"`` (normal), ``"garbage"`` (a non-JSON body), ``"error"``
      (HTTP 500), ``"missing"`` (JSON without ``weight_version``), ``"non_integer"``
      (``weight_version`` is ``"abc"``) or ``"hang"`` (sleeps 30 s before answering) for
      ``/model_info`` and ``/get_model_info``.
    * ``"report_weight_version": bool``: whether ``/generate`` replies carry
      ``meta_info.weight_version``.

    ``GET /sim/stats`` answers ``{"running", "waiting", "max_running_seen", "requests",
    "aborted", "weight_version", "paused", ...}``: ``running`` counts the requests holding a
    generation slot, ``max_running_seen`` its peak, ``requests`` every generation request
    received (including the refused ones) and ``aborted`` the generations that ended aborted.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import math
import operator
import random
import re
import socket
import sys
import time
import uuid
from array import array
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from types import TracebackType
from typing import Any

from aiohttp import web

logger = logging.getLogger(__name__)

MODEL_NAME = "rollstream-sim"
MAX_MODEL_LEN = 32768
POISON_MARKER = "POISON"
MODEL_INFO_MODES = ("ok", "garbage", "error", "missing", "non_integer", "hang")
FAULT_STATUSES = (429, 500, 503)
HANG_SECONDS = 30.0

_FILLER_WORDS = (
    "let", "me", "think", "about", "this", "carefully", "first", "we", "compute", "the",
    "value", "then", "check", "it", "again", "so", "step", "by", "and", "now", "result", "is",
    "clear", "hmm", "wait", "okay", "right", "simplify", "expression", "carry", "sum",
)  # fmt: skip


@dataclass(frozen=True)
class SimConfig:
    """Behaviour of the simulated engine."""

    seed: int = 0
    accuracy: float = 0.7
    """Probability that the boxed answer is correct (0..1)."""
    mean_tokens: int = 64
    """Mean response length in tokens (log-normal), >= 1."""
    length_sigma: float = 0.5
    """Log-normal sigma of the response length; 0 gives a fixed length."""
    max_tokens_cap: int = 16384
    """Upper clip of the drawn response length."""
    latency_per_token: float = 0.0
    """Seconds per generated token."""
    base_latency: float = 0.0
    """Seconds per request, before the first token."""
    max_running: int = 64
    """Requests generated concurrently; more wait in a queue."""
    weight_version: int = 0
    """Initial weight version."""
    report_weight_version: bool = True
    """Whether ``/generate`` replies include ``meta_info.weight_version``."""
    moe: tuple[int, int, int] | None = None
    """``(layers, topk, experts)`` of the routing replay answered to ``return_routed_experts``."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.accuracy <= 1.0:
            raise ValueError(f"accuracy must be within [0, 1], got {self.accuracy}")
        if self.mean_tokens < 1:
            raise ValueError(f"mean_tokens must be >= 1, got {self.mean_tokens}")
        if not math.isfinite(self.length_sigma) or self.length_sigma < 0:
            raise ValueError(f"length_sigma must be >= 0, got {self.length_sigma}")
        if self.max_tokens_cap < 1:
            raise ValueError(f"max_tokens_cap must be >= 1, got {self.max_tokens_cap}")
        for name in ("latency_per_token", "base_latency"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        if self.weight_version < 0:
            raise ValueError(f"weight_version must be >= 0, got {self.weight_version}")


def routed_expert(token_id: int, layer: int, k: int, experts: int) -> int:
    """The expert the simulator routes ``token_id`` to at ``layer``, choice ``k``."""
    return (token_id * 31 + layer * 7 + k * 13) % experts


def teacher_logprob(previous: int, token_id: int) -> float:
    """The simulated teacher's log-prob of ``token_id`` after ``previous`` (float32-exact)."""
    return -((previous * 131 + token_id) % 997 + 1) / 1024


def _routed_experts_b64(tokens: Sequence[int], moe: tuple[int, int, int]) -> str:
    layers, topk, experts = moe
    out = array("i")
    cache: dict[int, list[int]] = {}
    for token in tokens[: max(0, len(tokens) - 1)]:
        ids = cache.get(token)
        if ids is None:
            ids = [routed_expert(token, layer, k, experts) for layer in range(layers) for k in range(topk)]
            cache[token] = ids
        out.extend(ids)
    if sys.byteorder != "little":  # pragma: no cover
        out.byteswap()
    return base64.b64encode(out.tobytes()).decode("ascii")


def _teacher_reply(input_ids: list[int], start: int) -> dict[str, Any]:
    entries = [
        [None if i == 0 else teacher_logprob(input_ids[i - 1], input_ids[i]), input_ids[i], None]
        for i in range(max(0, start), len(input_ids))
    ]
    return {
        "text": "", "output_ids": [],
        "meta_info": {"finish_reason": {"type": "length", "length": 0}, "prompt_tokens": len(input_ids),
                      "completion_tokens": 0, "input_token_logprobs": entries},
    }


# --------------------------------------------------------------------------- toy tokenizer


def tokenize(text: str) -> list[int]:
    """Token ids of ``text``: its UTF-8 bytes (ids 0..255)."""
    return list(text.encode("utf-8"))


def detokenize(ids: Sequence[int]) -> str:
    """Text of token ids: the bytes ``id & 0xFF`` decoded as UTF-8 (invalid bytes replaced)."""
    return bytes(i & 0xFF for i in ids).decode("utf-8", "replace")


# --------------------------------------------------------------------------- the "model"

_EXPR_RUN = re.compile(r"[0-9\s+\-*/()]+")
_BINOPS: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_MAX_MAGNITUDE = 10**18


def _eval_node(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval_node(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval_node(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        result = _BINOPS[type(node.op)](_eval_node(node.left), _eval_node(node.right))
        if abs(result) > _MAX_MAGNITUDE:
            raise ValueError("value too large")
        return result
    raise ValueError(f"unsupported syntax: {type(node).__name__}")


def _has_binop(node: ast.AST) -> bool:
    return any(isinstance(n, ast.BinOp) for n in ast.walk(node))


def _as_number(value: Fraction) -> int | float:
    if value.denominator == 1:
        return int(value)
    return round(float(value), 2)


def evaluate_last_expression(text: str) -> int | float | None:
    """Value of the last arithmetic expression in ``text`` (``None`` when there is none).

    An expression is a run of digits, spaces, ``+ - * / ( )`` with at least one binary
    operator; it is evaluated exactly over the rationals without ``eval``. An integral result
    is an ``int``, any other a ``float`` rounded to 2 decimals.
    """
    for match in reversed(list(_EXPR_RUN.finditer(text))):
        candidate = match.group().strip()
        if not any(c.isdigit() for c in candidate) or len(candidate) > 1000:
            continue
        try:
            tree = ast.parse(candidate, mode="eval")
            if not _has_binop(tree):
                continue
            return _as_number(_eval_node(tree))
        except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
            continue
    return None


def _format_number(value: int | float) -> str:
    if isinstance(value, float):
        return f"{value:.2f}".rstrip("0").rstrip(".")
    return str(value)


def _answer(text: str, accuracy: float, rng: random.Random) -> str:
    correct = evaluate_last_expression(text)
    if correct is None:
        return str(rng.randint(0, 1000))
    if rng.random() < accuracy:
        return _format_number(correct)
    offset = rng.choice([i for i in range(-10, 11) if i != 0])
    wrong = correct + offset
    return _format_number(round(wrong, 2) if isinstance(wrong, float) else wrong)


def _filler(length: int, rng: random.Random) -> str:
    text = ""
    while len(text) < length:
        text = f"{text} {rng.choice(_FILLER_WORDS)}" if text else rng.choice(_FILLER_WORDS)
    return text[:length]


@dataclass(frozen=True)
class _Plan:
    """What a request would generate if nothing stopped it."""

    response_ids: list[int]
    logprobs: list[float]


def _plan_response(config: SimConfig, text: str, rng: random.Random) -> _Plan:
    answer_part = f" The answer is \\boxed{{{_answer(text, config.accuracy, rng)}}}."
    if config.length_sigma > 0:
        mu = math.log(config.mean_tokens) - config.length_sigma**2 / 2
        drawn = round(rng.lognormvariate(mu, config.length_sigma))
    else:
        drawn = config.mean_tokens
    total = max(len(answer_part), min(drawn, config.max_tokens_cap))
    ids = tokenize(_filler(total - len(answer_part), rng) + answer_part)
    logprobs = [-round(0.001 + 2.0 * rng.random() ** 3, 4) for _ in ids]
    return _Plan(ids, logprobs)


# --------------------------------------------------------------------------- engine state


@dataclass(eq=False)
class _Job:
    """One generation holding (or waiting for) a slot."""

    rid: str
    abort: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True)
class _Outcome:
    output_ids: list[int]
    logprobs: list[float]
    finish: str
    """``stop``, ``length`` or ``abort``."""
    abort_message: str = ""


@dataclass
class SimState:
    """Mutable state of one simulated engine (exposed for tests as ``SimEngine.state``)."""

    config: SimConfig
    weight_version: int = 0
    report_weight_version: bool = True
    rng: random.Random = field(default_factory=random.Random)
    semaphore: asyncio.Semaphore = field(default_factory=asyncio.Semaphore)
    resumed: asyncio.Event = field(default_factory=asyncio.Event)
    closing: asyncio.Event = field(default_factory=asyncio.Event)
    jobs: set[_Job] = field(default_factory=set)
    running: int = 0
    waiting: int = 0
    max_running_seen: int = 0
    requests: int = 0
    aborted: int = 0
    generated_tokens: int = 0
    faults_injected: int = 0
    generate_errors: int = 0
    generate_error_status: int = 500
    model_info_mode: str = "ok"

    @classmethod
    def from_config(cls, config: SimConfig) -> SimState:
        state = cls(
            config=config,
            weight_version=config.weight_version,
            report_weight_version=config.report_weight_version,
            rng=random.Random(config.seed),
            semaphore=asyncio.Semaphore(config.max_running),
        )
        state.resumed.set()
        return state

    @property
    def paused(self) -> bool:
        return not self.resumed.is_set()

    def abort(self, rid: str | None = None) -> int:
        """Abort the in-flight generations (all, or those of ``rid``); returns how many."""
        count = 0
        for job in list(self.jobs):
            if (rid is None or job.rid == rid) and not job.abort.is_set():
                job.abort.set()
                count += 1
        return count

    def stats(self) -> dict[str, Any]:
        return {
            "running": self.running,
            "waiting": self.waiting,
            "in_flight": len(self.jobs),
            "max_running_seen": self.max_running_seen,
            "requests": self.requests,
            "aborted": self.aborted,
            "generated_tokens": self.generated_tokens,
            "faults_injected": self.faults_injected,
            "weight_version": self.weight_version,
            "paused": self.paused,
        }

    def take_fault(self) -> int | None:
        """Count a generation request; the HTTP status to fail it with, if a fault is armed."""
        self.requests += 1
        if self.generate_errors == 0:
            return None
        if self.generate_errors > 0:
            self.generate_errors -= 1
        self.faults_injected += 1
        return self.generate_error_status

    async def wait_resumed(self) -> bool:
        """Wait while paused; ``False`` when the engine is shutting down."""
        while not self.resumed.is_set() and not self.closing.is_set():
            waiter = asyncio.ensure_future(self.resumed.wait())
            closer = asyncio.ensure_future(self.closing.wait())
            try:
                await asyncio.wait({waiter, closer}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
                closer.cancel()
        return not self.closing.is_set()

    async def generate(self, rid: str, plan: _Plan, max_new_tokens: int) -> _Outcome:
        """Run one generation: queue for a slot, then let tokens accrue until done or aborted."""
        n_out = min(len(plan.response_ids), max_new_tokens)
        finish = "stop" if n_out == len(plan.response_ids) else "length"
        job = _Job(rid)
        self.jobs.add(job)
        try:
            if not await self._acquire_slot(job):
                self.aborted += 1
                return _Outcome([], [], "abort", "Abort in waiting queue")
            try:
                produced = await self._run(job, n_out)
            finally:
                self.running -= 1
                self.semaphore.release()
        finally:
            self.jobs.discard(job)
        self.generated_tokens += produced
        if produced < n_out:
            self.aborted += 1
            return _Outcome(
                plan.response_ids[:produced],
                plan.logprobs[:produced],
                "abort",
                "Abort in the middle of generation",
            )
        return _Outcome(plan.response_ids[:n_out], plan.logprobs[:n_out], finish)

    async def _acquire_slot(self, job: _Job) -> bool:
        """Take a slot unless aborted first (then ``False``, holding nothing)."""
        self.waiting += 1
        acquire = asyncio.ensure_future(self.semaphore.acquire())
        aborted = asyncio.ensure_future(job.abort.wait())
        try:
            await asyncio.wait({acquire, aborted}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled (client gone, shutdown): never keep a slot
            if acquire.done() and not acquire.cancelled() and acquire.exception() is None:
                self.semaphore.release()
            raise
        finally:
            self.waiting -= 1
            aborted.cancel()
            if not acquire.done():
                acquire.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await acquire
        if acquire.cancelled():
            return False
        if job.abort.is_set():
            self.semaphore.release()
            return False
        self.running += 1
        self.max_running_seen = max(self.max_running_seen, self.running)
        return True

    async def _run(self, job: _Job, n_out: int) -> int:
        """Hold the slot while ``n_out`` tokens accrue; the number produced before any abort."""
        config = self.config
        duration = config.base_latency + config.latency_per_token * n_out
        start = time.monotonic()
        try:
            await asyncio.wait_for(job.abort.wait(), timeout=duration)
        except TimeoutError:
            return n_out
        elapsed = time.monotonic() - start - config.base_latency
        if elapsed < 0:
            return 0
        if config.latency_per_token <= 0:
            return n_out
        return min(n_out, int(elapsed / config.latency_per_token))


STATE_KEY = web.AppKey("rollstream_sim_state", SimState)


# --------------------------------------------------------------------------- helpers


class _BadRequest(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


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
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _BadRequest(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _token_ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    ):
        raise _BadRequest(f"{name} must be a list of token ids (batches are not supported)")
    return value


def _check_poison(text: str) -> None:
    if POISON_MARKER in text:
        raise _BadRequest(f"the input contains the marker {POISON_MARKER}: request refused")


@web.middleware
async def _errors_middleware(
    request: web.Request, handler: Callable[[web.Request], Any]
) -> web.StreamResponse:
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except _BadRequest as exc:
        return _error(400, exc.message)


async def _generate_all(state: SimState, text: str, rids: list[str], max_tokens: int) -> list[_Outcome] | None:
    """Plan one response per request id, wait out a pause, generate them concurrently; None
    when the engine shuts down while paused."""
    plans = [_plan_response(state.config, text, random.Random(state.rng.getrandbits(64))) for _ in rids]
    if not await state.wait_resumed():
        return None
    runs = (state.generate(rid, plan, max_tokens) for rid, plan in zip(rids, plans, strict=True))
    return list(await asyncio.gather(*runs))


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


Handler = Callable[[web.Request], Awaitable[web.Response]]


def _faultable(handler: Handler) -> Handler:
    """A generation endpoint that first answers an injected fault (``/sim/faults``), if one is due."""

    async def handle(request: web.Request) -> web.Response:
        status = request.app[STATE_KEY].take_fault()
        if status is not None:
            return _error(status, f"injected fault: HTTP {status}")
        return await handler(request)

    return handle


# --------------------------------------------------------------------------- SGLang API


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
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise _BadRequest("sampling_params must be an object")
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
    outcomes = await _generate_all(state, text, [rid], max_new_tokens)
    if outcomes is None:
        return _error(503, "the engine is shutting down")
    outcome = outcomes[0]

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
        "cached_tokens": 0,
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
    aborted = state.abort() if mode == "abort" else 0
    logger.info("generation paused (mode %s, %d requests aborted)", mode, aborted)
    return web.json_response({"success": True, "message": f"paused, {aborted} aborted"})


async def _continue_generation(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    state.resumed.set()
    logger.info("generation continued")
    return web.json_response({"success": True, "message": "continued"})


async def _update_weights_from_disk(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await _json_body(request)
    version = body.get("weight_version")
    if version is None:
        state.weight_version += 1
    else:
        try:
            state.weight_version = int(version)
        except (TypeError, ValueError) as exc:
            raise _BadRequest(f"weight_version must be an integer, got {version!r}") from exc
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


# --------------------------------------------------------------------------- vLLM API


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


# --------------------------------------------------------------------------- simulator control


async def _set_faults(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await _json_body(request)
    if "generate_errors" in body:
        count = body["generate_errors"]
        if isinstance(count, bool) or not isinstance(count, int) or count < -1:
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
    return web.json_response(
        {
            "generate_errors": state.generate_errors,
            "generate_error_status": state.generate_error_status,
            "model_info": state.model_info_mode,
            "report_weight_version": state.report_weight_version,
        }
    )


async def _stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE_KEY].stats())


async def _on_shutdown(app: web.Application) -> None:
    state = app[STATE_KEY]
    state.closing.set()
    state.abort()


def create_app(config: SimConfig) -> web.Application:
    """The aiohttp application of a simulated engine (its state is ``app[STATE_KEY]``)."""
    app = web.Application(middlewares=[_errors_middleware])
    app[STATE_KEY] = SimState.from_config(config)
    app.on_shutdown.append(_on_shutdown)
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
    app.router.add_post("/detokenize", _detokenize)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/completions", _faultable(_completions))
    app.router.add_post("/v1/chat/completions", _faultable(_chat_completions))
    app.router.add_post("/sim/faults", _set_faults)
    app.router.add_get("/sim/stats", _stats)
    return app


# --------------------------------------------------------------------------- running it


class SimEngine:
    """A simulated engine served on ``host:port`` (port 0 picks a free port).

    Use as ``async with SimEngine(SimConfig()) as engine: ... engine.url ...``, or call
    :meth:`start` and :meth:`aclose`. ``engine.state`` is the live :class:`SimState`.
    """

    def __init__(
        self, config: SimConfig | None = None, *, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.config = config if config is not None else SimConfig()
        self.host = host
        self.port = port
        self.app = create_app(self.config)
        self._runner: web.AppRunner | None = None

    @property
    def state(self) -> SimState:
        return self.app[STATE_KEY]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        if self._runner is not None:
            raise RuntimeError("the simulated engine is already started")
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.setblocking(False)
            runner = web.AppRunner(
                self.app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None
            )
            await runner.setup()
            await web.SockSite(runner, sock).start()
        except BaseException:
            sock.close()
            raise
        self._runner = runner
        self.port = sock.getsockname()[1]

    async def aclose(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> SimEngine:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


async def serve(config: SimConfig, host: str, port: int) -> None:
    """Serve a simulated engine until cancelled (``rollstream sim-engine``)."""
    async with SimEngine(config, host=host, port=port) as engine:
        logger.info(
            "simulated SGLang/vLLM engine (a test double, not a model) listening on %s",
            engine.url,
        )
        await asyncio.Event().wait()
