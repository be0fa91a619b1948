"""A simulated inference engine: a **test double for SGLang and vLLM, not a model**.

This module assembles the app and runs it; the parts live beside it, one module per seam:
:mod:`.model` (tokenizer, answers, routing replay, teacher), :mod:`.state` (the shared
scheduler and state), :mod:`.shared` (parsing, fault injection, ``/sim/*``) and one module per
API simulated: :mod:`.sglang_api`, :mod:`.openai_api` (vLLM's OpenAI API), :mod:`.vllm_api` (vLLM's RL
and token endpoints). Every public name is still importable from here.

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
    is refused with HTTP 400. A prompt ending with ``[reply=N]`` sets its own length: ``L`` is
    ``N`` minus the tokens the input holds after the marker (a continuation's partial response),
    at least the answer (:func:`~.model.reply_length`).

Routing replay and teacher scoring
    With :attr:`SimConfig.moe` ``(layers, topk, experts)``, a ``/generate`` request with
    ``return_routed_experts`` gets ``meta_info.routed_experts`` in SGLang's shape: base64 of
    little-endian int32, ``(input + output tokens - 1) x layers x topk``, row ``i`` routing token
    ``i`` to the experts :func:`routed_expert` names (a function of that token, so a test can check
    every row against the tokens); every ``/inference/v1/generate`` choice gets the same rows in
    vLLM's form, ``routed_experts`` = base64 of the ``.npy`` buffer ``np.save`` writes (uint8 up to
    256 experts). A request with ``max_new_tokens`` 0 and ``return_logprob`` is
    a teacher scoring its input: ``meta_info.input_token_logprobs`` has ``[logprob, token_id,
    null]`` for every input token from ``logprob_start_len`` on (null at position 0), the
    log-prob being :func:`teacher_logprob` of the token and the one before it.
Multi-turn (tool calls)
    A prompt holding ``[tools=K]`` (or ``[tools=K:search]``) is answered, for its first K
    replies, with ``<filler> <tool>calc: EXPR</tool>`` (EXPR: the input's last arithmetic
    expression; finish reason ``stop``); a reply whose input already holds K closed tool calls
    answers as usual. The input is the whole trajectory (prompt, replies, tool results), so a
    rollout that appends tool results (e.g. ``<result>5</result>``) and asks again gets exactly K
    tool turns, then the answer: deterministic, for tests and the demo (:func:`tool_turn`).

SGLang endpoints
    ``POST /generate``, ``POST /abort_request``, ``POST /pause_generation``,
    ``POST /continue_generation``, ``POST /update_weights_from_disk``, ``GET /model_info``,
    ``GET /get_model_info``, ``GET /health``, ``GET /health_generate``, ``GET /get_server_info``,
    ``POST /tokenize``, ``POST /detokenize``, ``GET /v1/models``.
    ``/pause_generation`` with mode ``abort`` (the default) aborts every in-flight request;
    other modes only hold new requests. While paused, new generation requests wait (they are
    not rejected) until ``/continue_generation``.

vLLM's RL and token endpoints (as ``vllm ... --enable-scale-out`` with ``VLLM_SERVER_DEV_MODE=1``)
    ``POST /inference/v1/generate`` (``token_ids``, ``sampling_params.n/max_tokens/logprobs``;
    each choice has ``token_ids``, ``text``, ``logprobs.content[].logprob``, ``finish_reason`` and
    ``weight_versions`` spans: a version change while a request runs splits its span at the
    tokens produced by then), ``POST /pause?mode=abort|wait|keep``, ``POST /resume``,
    ``POST /collective_rpc`` (``reload_weights`` only; a path containing ``POISON`` fails with
    500; the prefix cache is kept, as vLLM keeps it), ``POST /update_weight_version``,
    ``GET /weight_info``, ``POST /abort_requests``, ``POST /reset_prefix_cache`` (empties the
    prefix cache; so does ``/pause`` unless ``clear_cache=false``).

vLLM (OpenAI-compatible) endpoint
    ``POST /v1/completions`` with ``prompt`` (a string or a list of token ids), ``n``,
    ``max_tokens``, ``logprobs``, ``return_tokens_as_token_ids`` and ``return_token_ids``.
    ``POST /v1/chat/completions`` with ``messages`` (rendered by :func:`render_chat`) and the
    same options (``logprobs: true``). No weight version is reported in these replies (vLLM does
    not report one); ``GET /weight_info`` says it (above).

Fault injection (for tests of retries and fallbacks)
    ``POST /sim/faults`` with a JSON object holding any of:

    * ``"generate_errors": K`` and ``"generate_error_status": S`` (429, 500 or 503; default
      500): the next ``K`` ``/generate`` or ``/v1/completions`` requests answer HTTP ``S``
      without generating; ``K = -1`` means forever, ``K = 0`` clears the fault.
    * ``"model_info"``: ``"ok"`` (normal), ``"garbage"`` (a non-JSON body), ``"error"``
      (HTTP 500), ``"missing"`` (JSON without ``weight_version``), ``"non_integer"``
      (``weight_version`` is ``"abc"``) or ``"hang"`` (sleeps 30 s before answering) for
      ``/model_info`` and ``/get_model_info``; ``"vllm"``: those two answer 404 and
      ``/weight_info`` the version (vLLM's server in dev mode); ``"absent"``: all three answer 404
      (vLLM's OpenAI server as started by default). ``"missing"`` also drops the version from
      ``/weight_info``.
    * ``"report_weight_version": bool``: whether ``/generate`` replies carry
      ``meta_info.weight_version``.
    * ``"bad_replies": K`` and ``"bad_reply": MODE``: the next ``K`` generation requests (``-1``:
      forever, ``0`` clears) get an unusable HTTP 200 reply instead of a generation: ``not_json``
      (an HTML page), ``schema`` (JSON of the wrong shape), ``too_large`` (a JSON body of
      ``"bad_reply_bytes"`` bytes, default 1 MiB) or ``hang`` (no reply until the client gives up,
      at most 30 s). Injected faults (``generate_errors``) are answered first.

    * ``"reload_seconds": S``: every weight reload (``/update_weights_from_disk``,
      ``reload_weights``) takes ``S`` seconds (a large checkpoint).
    * ``"wedge": true`` (``false`` clears): every request but ``/sim/*`` is accepted and not
      answered until the wedge clears, replies of requests already running included (a GPU or
      NCCL hang: ``/health`` hangs too).

    ``POST /sim/restart`` ``{"version": V}`` (default 0): the engine restarted from its base
    checkpoint: in-flight generations end aborted, the prefix cache is emptied, the weight version
    is ``V``, no pause, no wedge.

Prefix cache
    With :attr:`SimConfig.prefix_cache_tokens`, ``/generate`` finds the longest cached prefix of
    its input in whole 16-token blocks (each block keyed by the hash of its whole prefix, LRU to
    the capacity), pays :attr:`SimConfig.prefill_per_token` per uncached token before decoding,
    reports ``meta_info.cached_tokens`` (and ``prompt_tokens``) as SGLang does, caches the
    prompt's blocks once prefilled (the samples of a group running at once share them) and the
    output's when a request ends not aborted; vLLM's ``/inference/v1/generate`` looks its prompt up
    the same way. Each block remembers the weights it was computed with: a reload that keeps the
    cache (vLLM's ``reload_weights``) makes it stale, SGLang's ``/update_weights_from_disk`` flushes
    it (as SGLang does), vLLM's ``/reset_prefix_cache`` and ``/pause`` empty it. ``/sim/stats``
    counts ``prompt_tokens`` and ``cached_tokens`` (the hit rate), ``stale_cached_tokens`` (cached
    tokens reused under weights since replaced: samples that match neither version) and
    ``cache_resets``.

KV capacity and load
    With :attr:`SimConfig.kv_capacity_tokens`, generations are scheduled in steps of
    ``KV_STEP_TOKENS`` tokens as vLLM schedules them: running requests first, the newest preempted
    when their next tokens do not fit (its tokens recomputed at ``prefill_per_token`` when it is
    readmitted, the whole batch waiting), waiting ones admitted in order while they fit and nothing
    was preempted in the step. ``GET /metrics`` (vLLM's names: ``vllm:num_requests_running``,
    ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ``vllm:num_preemptions_total``),
    ``GET /v1/loads`` and ``GET /get_load`` (SGLang's two forms) report the load; without a
    capacity no KV usage is reported. ``"load_endpoints": false`` in ``/sim/faults`` makes them
    answer 404.

    ``GET /sim/stats`` answers ``{"running", "waiting", "max_running_seen", "requests",
    "aborted", "weight_version", "paused", ...}``: ``running`` counts the requests holding a
    generation slot, ``max_running_seen`` its peak, ``requests`` every generation request
    received (including the refused ones), ``aborted`` the generations that ended aborted and
    ``bad_replies_sent`` the unusable replies sent.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from types import TracebackType

from aiohttp import web
from rollstream.testing.sim import openai_api, sglang_api, shared, vllm_api
from rollstream.testing.sim.model import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    POISON_MARKER,
    SimConfig,
    detokenize,
    evaluate_last_expression,
    routed_expert,
    teacher_logprob,
    tokenize,
    tool_turn,
)
from rollstream.testing.sim.openai_api import render_chat
from rollstream.testing.sim.state import STATE_KEY, SimState

__all__ = [
    "MAX_MODEL_LEN", "MODEL_NAME", "POISON_MARKER", "STATE_KEY", "SimConfig", "SimEngine", "SimState",
    "create_app", "detokenize", "evaluate_last_expression", "render_chat", "routed_expert", "serve",
    "teacher_logprob", "tokenize", "tool_turn",
]

logger = logging.getLogger(__name__)


def create_app(config: SimConfig) -> web.Application:
    """The aiohttp application of a simulated engine (its state is ``app[STATE_KEY]``)."""
    app = web.Application(middlewares=[shared.errors_middleware])
    app[STATE_KEY] = SimState.from_config(config)
    sglang_api.add_routes(app)
    openai_api.add_routes(app)
    vllm_api.add_routes(app)
    shared.add_routes(app)
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
