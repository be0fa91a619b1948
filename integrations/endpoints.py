"""Per-episode HTTP endpoints served by the producer: an SGLang ``/generate`` for slime's and
miles' generate functions, an OpenAI ``/v1/chat/completions`` for black-box agents.

Code written against an engine URL (slime's ``args.sglang_router_ip/port``, an OpenAI client's
``base_url``) runs unchanged on a producer because each episode gets its own loopback port whose
handlers call the episode's engine session (:meth:`Episode.complete`, :meth:`Trajectory.generate`):
every engine request still holds one producer engine slot only while it runs, under the
producer's per-request and episode deadlines, retries and abort handling; tool time between two
requests holds nothing.

* ``/generate`` (opened with ``sglang=True``) answers SGLang's reply shape (``text``,
  ``meta_info.finish_reason.type``, ``output_token_logprobs``, ``weight_version``). With partial
  rollout on, an aborted call is continued inside the session and the function sees one reply;
  with it off the reply says ``abort`` (so slime's and miles' code marks the sample ABORTED as it
  would on SGLang) and the episode is recycled whole.
* ``/v1/chat/completions`` (opened with ``chat=True``) answers only ``Authorization: Bearer
  <the episode's key>`` (DESIGN.md §4.11: one episode cannot write into another's trajectory; a
  wrong key is 401). It records token-in/token-out on one trajectory of the episode (model tokens
  loss mask 1 with the engine's log-probs, everything the chat template adds around them mask 0)
  and refuses a conversation that does not extend the recorded one.

A refusal (a request that does not extend the conversation, a malformed body, an engine error)
is answered to the caller *and* remembered: :meth:`Endpoint.run` cancels the user's code and
raises it, so the sample is FAILED with that reason (an abort raises
:class:`~rollstream.common.errors.EpisodeAborted`) even if the caller swallowed the HTTP error.

The endpoints listen on ``127.0.0.1`` unless told otherwise (:class:`EndpointServer` ``host``).
The SGLang route has no key (slime's ``post`` sends none): it is opened only for the adapters,
whose functions run inside the producer process anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import socket
import time
from array import array
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from typing import Any, TypeVar

import msgspec
from aiohttp import web
from rollstream.common.checked import is_int, is_number
from rollstream.common.errors import (  # ConversationDiverged, EndpointRefused: re-exported
    ConfigError,
    ConversationDiverged,
    EndpointRefused,
    EpisodeAborted,
)
from rollstream.producer.episode import Episode, SamplingParams

from .chat import ChatRecorder, normalize_message

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAX_BODY_BYTES = 64 * 2**20
"""Largest request body an endpoint reads (a long agent conversation fits)."""
CANCEL_GRACE = 10.0
"""Seconds the user's code and in-flight handlers get to finish after being cancelled."""
MODEL_NAME = "rollstream"
"""What ``/v1/models`` lists and chat replies name unless the caller asked for a model."""
_SAMPLING_KEYS = ("temperature", "top_p", "max_new_tokens")
_CHAT_PARAMS = {
    "stop": "stop",
    "top_k": "top_k",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "seed": "sampling_seed",
}
"""OpenAI request fields passed to the engine, by their SGLang names; the rest are ignored."""


class _Answer(Exception):
    """An HTTP error answer, raised inside a handler."""

    def __init__(self, status: int, message: str, code: str, *, fail: BaseException | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.fail = fail


# -- the endpoint of one episode ------------------------------------------------------------------


class Endpoint:
    """One episode's port: its handlers' state and what went wrong."""

    def __init__(self, server: EndpointServer, episode: Episode, port: int, *, sglang: bool, chat: bool) -> None:
        self.server = server
        self.episode = episode
        self.port = port
        self.sglang = sglang
        self.chat = chat
        self.api_key = "rs-" + secrets.token_urlsafe(24)
        self.failure: BaseException | None = None
        self.failed = asyncio.Event()
        self.closed = False
        self.handlers: set[asyncio.Task[Any]] = set()
        self.transports: set[asyncio.BaseTransport] = set()
        """The connections its requests came on: closed with the episode, so clients do not
        keep idle keep-alive connections to a port that is gone (their pools fill up)."""
        self.recorder = ChatRecorder(episode)
        self.requests = 0
        self.versions: list[int] = []
        """The weight versions of every engine call made through this endpoint, in order."""
        self._chat_lock = asyncio.Lock()

    @property
    def url(self) -> str:
        """``http://host:port``: the root an SGLang client is pointed at."""
        return f"http://{self.server.public_host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI ``base_url`` (``http://host:port/v1``)."""
        return f"{self.url}/v1"

    def fail(self, exc: BaseException) -> None:
        """Remember the first refusal: :meth:`run` raises it."""
        if self.failure is None:
            self.failure = exc
            self.failed.set()

    async def run(self, work: Awaitable[T]) -> T:
        """Run the user's code; a refusal recorded meanwhile cancels it and is raised instead."""
        task = asyncio.ensure_future(work)
        waiter = asyncio.ensure_future(self.failed.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if self.failure is not None:  # the refusal, not what the caller made of the HTTP error
                raise self.failure
            return task.result()  # the user's own exception propagates as it is
        finally:
            for pending in (task, waiter):
                if not pending.done():
                    pending.cancel()
            await _settle({task, waiter})

    async def close(self) -> None:
        self.closed = True
        for task in list(self.handlers):
            task.cancel()
        await _settle(self.handlers)
        for transport in self.transports:
            transport.close()
        self.transports.clear()


async def _settle(tasks: set[asyncio.Task[Any]] | set[asyncio.Future[Any]]) -> None:
    """Wait (bounded) for cancelled tasks to end, even while being cancelled ourselves."""
    pending = {t for t in tasks if not t.done()}
    if pending:
        _, still = await asyncio.wait(pending, timeout=CANCEL_GRACE)
        if still:
            logger.warning("%d episode task(s) did not end within %.0f s of being cancelled", len(still), CANCEL_GRACE)
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: no "exception was never retrieved" noise


class EndpointServer:
    """The producer process's endpoint server: one aiohttp runner, one loopback port per open episode."""

    def __init__(self, host: str = "127.0.0.1", public_host: str | None = None) -> None:
        self.host = host
        wildcard = host in ("", "0.0.0.0", "::")
        self.public_host = public_host or (socket.gethostname() if wildcard else host)
        """The host in the URLs handed to the user's code (this machine's name when listening on all)."""
        self._runner: web.AppRunner | None = None
        self._start_lock = asyncio.Lock()
        self._by_port: dict[int, Endpoint] = {}

    @property
    def open_endpoints(self) -> int:
        return len(self._by_port)

    @property
    def running(self) -> bool:
        """Whether the server is set up (from the first episode until :meth:`aclose`)."""
        return self._runner is not None

    async def _ensure_runner(self) -> web.AppRunner:
        async with self._start_lock:
            if self._runner is None:
                app = web.Application(client_max_size=MAX_BODY_BYTES)
                app.router.add_post("/generate", self._generate)
                app.router.add_get("/health", self._health)
                app.router.add_get("/model_info", self._model_info)
                app.router.add_get("/get_model_info", self._model_info)
                app.router.add_post("/v1/chat/completions", self._chat)
                app.router.add_get("/v1/models", self._models)
                runner = web.AppRunner(app, access_log=None, handle_signals=False)
                await runner.setup()
                self._runner = runner
            return self._runner

    async def aclose(self) -> None:
        """Stop listening (the producer's generate adapter calls it on drain or exit); idempotent."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @contextlib.asynccontextmanager
    async def open(self, episode: Episode, *, sglang: bool = False, chat: bool = False) -> AsyncIterator[Endpoint]:
        """A port of ``episode``'s own for the duration of the block; closed (handlers cancelled) after."""
        runner = await self._ensure_runner()
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, 0))
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise ConfigError(f"cannot listen on {self.host!r} for an episode endpoint: {exc}") from exc
        port = sock.getsockname()[1]
        site = web.SockSite(runner, sock)
        await site.start()
        endpoint = Endpoint(self, episode, port, sglang=sglang, chat=chat)
        self._by_port[port] = endpoint
        try:
            yield endpoint
        finally:
            self._by_port.pop(port, None)
            try:
                with contextlib.suppress(RuntimeError):  # the runner was cleaned up first (aclose)
                    await site.stop()
            finally:
                sock.close()
                await endpoint.close()

    # -- request plumbing ------------------------------------------------------------------------

    def _endpoint(self, request: web.Request) -> Endpoint:
        sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
        endpoint = self._by_port.get(sockname[1]) if sockname else None
        if endpoint is None or endpoint.closed:
            raise _Answer(410, "this episode has ended", "episode_ended")
        return endpoint

    @staticmethod
    def _check_key(request: web.Request, endpoint: Endpoint) -> None:
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), endpoint.api_key.encode()):
            raise _Answer(401, "invalid API key: use the key given with this episode's base_url", "invalid_api_key")

    @staticmethod
    async def _body(request: web.Request) -> dict[str, Any]:
        try:
            body = _json_decode(await request.read())
        except (msgspec.DecodeError, ValueError, UnicodeDecodeError) as exc:
            message = f"the request body is not JSON: {exc}"
            raise _Answer(400, message, "invalid_json", fail=EndpointRefused(message)) from None
        except web.HTTPRequestEntityTooLarge:
            message = f"the request body is larger than {MAX_BODY_BYTES} bytes"
            raise _Answer(413, message, "too_large", fail=EndpointRefused(message)) from None
        if not isinstance(body, dict):
            message = "the request body must be a JSON object"
            raise _Answer(400, message, "invalid_request", fail=EndpointRefused(message))
        return body

    async def _serve(self, request: web.Request, handler: Any, *, openai: bool) -> web.Response:
        endpoint: Endpoint | None = None
        task = asyncio.current_task()
        try:
            endpoint = self._endpoint(request)
            if task is not None:
                endpoint.handlers.add(task)
            if request.transport is not None:
                endpoint.transports.add(request.transport)
            endpoint.requests += 1
            result = await handler(request, endpoint)
            return _json_response(result)
        except _Answer as answer:
            if answer.fail is not None and endpoint is not None:
                endpoint.fail(answer.fail)
            if openai:
                error = {"message": str(answer), "type": "invalid_request_error", "code": answer.code}
                payload: dict[str, Any] = {"error": error}
            else:
                payload = {"error": {"message": str(answer), "code": answer.status}}
            return _json_response(payload, status=answer.status)
        finally:
            if endpoint is not None and task is not None:
                endpoint.handlers.discard(task)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _model_info(self, request: web.Request) -> web.Response:
        async def info(request: web.Request, endpoint: Endpoint) -> dict[str, Any]:
            if not endpoint.sglang:
                raise _Answer(404, "not an SGLang endpoint", "not_found")
            version = str(endpoint.episode.admitted_version)
            return {"model_path": MODEL_NAME, "is_generation": True, "weight_version": version}

        return await self._serve(request, info, openai=False)

    async def _models(self, request: web.Request) -> web.Response:
        async def models(request: web.Request, endpoint: Endpoint) -> dict[str, Any]:
            if not endpoint.chat:
                raise _Answer(404, "not an OpenAI endpoint", "not_found")
            self._check_key(request, endpoint)
            return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "rollstream"}]}

        return await self._serve(request, models, openai=True)

    # -- SGLang /generate ------------------------------------------------------------------------

    async def _generate(self, request: web.Request) -> web.Response:
        return await self._serve(request, self._sglang_generate, openai=False)

    async def _sglang_generate(self, request: web.Request, endpoint: Endpoint) -> dict[str, Any]:
        if not endpoint.sglang:
            raise _Answer(404, "not an SGLang endpoint", "not_found")
        body = await self._body(request)
        episode = endpoint.episode
        try:
            ids, sampling, max_new, want_logprob = await _sglang_request(body, episode)
        except EndpointRefused as exc:
            raise _Answer(400, str(exc), "invalid_request", fail=exc) from None
        given = body.get("rid")
        rid = given if isinstance(given, str) else secrets.token_hex(8)
        try:
            turn = await episode.complete(ids, max_new_tokens=max_new, sampling=sampling)
        except EpisodeAborted as exc:
            endpoint.fail(exc)
            return _sglang_reply(rid, "", array("i"), None, "abort", str(episode.admitted_version), len(ids), True)
        except Exception as exc:  # an engine refusal or failure: the sample fails with it
            endpoint.fail(exc)
            raise _Answer(503, f"engine call failed: {type(exc).__name__}: {exc}", "engine_error") from None
        endpoint.versions.extend(turn.weight_versions)
        if want_logprob and turn.log_probs is None and len(turn.token_ids):
            refused = EndpointRefused("the engines returned no log-probs (run the producer with log-probs on)")
            endpoint.fail(refused)
            raise _Answer(503, str(refused), "no_logprobs")
        version = min(turn.weight_versions) if turn.weight_versions else episode.admitted_version
        return _sglang_reply(
            rid, turn.text, turn.token_ids, turn.log_probs if want_logprob else None,
            turn.finish_reason or "stop", str(version), len(ids), want_logprob,
        )

    # -- OpenAI /v1/chat/completions -------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.Response:
        return await self._serve(request, self._chat_completion, openai=True)

    async def _chat_completion(self, request: web.Request, endpoint: Endpoint) -> dict[str, Any]:
        if not endpoint.chat:
            raise _Answer(404, "not an OpenAI endpoint", "not_found")
        self._check_key(request, endpoint)
        body = await self._body(request)
        try:
            messages, tools, params = _chat_request(body, endpoint.episode)
        except EndpointRefused as exc:
            raise _Answer(400, str(exc), "invalid_request", fail=exc) from None
        async with endpoint._chat_lock:  # one conversation: requests are turns, in order
            try:
                turn = await endpoint.recorder.turn(messages, tools, **params)
            except ConversationDiverged as exc:
                raise _Answer(400, str(exc), "conversation_diverged", fail=exc) from None
            except EndpointRefused as exc:
                raise _Answer(400, str(exc), "invalid_request", fail=exc) from None
            except EpisodeAborted as exc:
                raise _Answer(503, f"episode aborted: {exc}", "episode_aborted", fail=exc) from None
            except Exception as exc:
                endpoint.fail(exc)
                raise _Answer(503, f"engine call failed: {type(exc).__name__}: {exc}", "engine_error") from None
        endpoint.versions.extend(turn.weight_versions)
        trajectory = endpoint.recorder.trajectory
        prompt_tokens = len(trajectory.sample.tokens) - len(turn.token_ids) if trajectory is not None else 0
        model = body.get("model") if isinstance(body.get("model"), str) else MODEL_NAME
        return {
            "id": "chatcmpl-" + secrets.token_hex(12),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": turn.text},
                    "finish_reason": "length" if turn.finish_reason == "length" else "stop",
                    "logprobs": None,
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(turn.token_ids),
                "total_tokens": prompt_tokens + len(turn.token_ids),
            },
        }


# -- request and reply shapes ---------------------------------------------------------------------

_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode


def _json_response(payload: Any, status: int = 200) -> web.Response:
    """JSON with msgspec (token-id and log-prob lists are most of a reply)."""
    return web.Response(body=_json_encode(payload), status=status, content_type="application/json")


def _int_ids(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(is_int(t) for t in value):
        raise EndpointRefused(f"{what} must be a list of token ids")
    return value


async def _sglang_request(body: Mapping[str, Any], episode: Episode) -> tuple[list[int], SamplingParams, int, bool]:
    """(prompt ids, sampling, max_new_tokens, return_logprob) of an SGLang ``/generate`` body."""
    if body.get("image_data") or body.get("audio_data") or body.get("video_data"):
        raise EndpointRefused("multimodal inputs are not supported through the producer's endpoint")
    if "input_ids" in body and body["input_ids"] is not None:
        ids = _int_ids(body["input_ids"], "input_ids (one prompt per request)")
    elif isinstance(body.get("text"), str):
        ids = await episode.tokenize(body["text"])
    else:
        raise EndpointRefused("give input_ids (a list of token ids) or text")
    raw = body.get("sampling_params") or {}
    if not isinstance(raw, Mapping):
        raise EndpointRefused("sampling_params must be an object")
    base = episode.sampling
    max_new = raw.get("max_new_tokens", base.max_new_tokens)
    if not is_int(max_new) or max_new < 0:
        raise EndpointRefused(f"sampling_params.max_new_tokens must be a non-negative integer, got {max_new!r}")
    temperature = raw.get("temperature", base.temperature)
    top_p = raw.get("top_p", base.top_p)
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if not is_number(value):
            raise EndpointRefused(f"sampling_params.{name} must be a number, got {value!r}")
    extra = {k: v for k, v in raw.items() if k not in _SAMPLING_KEYS and v is not None}
    sampling = SamplingParams(max_new_tokens=max_new, temperature=float(temperature), top_p=float(top_p), extra=extra)
    return ids, sampling, max_new, bool(body.get("return_logprob", False))


def _sglang_reply(
    rid: str, text: str, ids: Sequence[int], log_probs: Sequence[float] | None, finish: str,
    version: str, prompt_tokens: int, want_logprob: bool,
) -> dict[str, Any]:
    finish_reason: dict[str, Any] = {"type": finish}
    if finish == "length":
        finish_reason["length"] = len(ids)
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(ids),
        "cached_tokens": 0,
        "weight_version": version,
    }
    if want_logprob:
        lps = log_probs if log_probs is not None else [0.0] * len(ids)
        meta["output_token_logprobs"] = [[float(lp), int(t), None] for lp, t in zip(lps, ids, strict=True)]
    return {"text": text, "output_ids": list(ids), "meta_info": meta}


def _chat_request(body: Mapping[str, Any], episode: Episode) -> tuple[list[dict[str, Any]], Any, dict[str, Any]]:
    """(messages, tools, generate() keywords) of an OpenAI chat completions body."""
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise EndpointRefused("messages must be a non-empty list")
    messages = [normalize_message(m, i) for i, m in enumerate(raw_messages)]
    if body.get("stream"):
        raise EndpointRefused("stream=true is not supported by the producer's endpoint")
    n = body.get("n", 1)
    if n not in (1, None):
        raise EndpointRefused("n must be 1: one episode records one conversation")
    tools = body.get("tools") or None
    if tools is not None and not isinstance(tools, list):
        raise EndpointRefused("tools must be a list")
    params: dict[str, Any] = {}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        if not is_int(max_tokens) or max_tokens < 1:
            raise EndpointRefused(f"max_tokens must be a positive integer, got {max_tokens!r}")
        params["max_new_tokens"] = max_tokens
    changes: dict[str, Any] = {}
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is not None:
            if not is_number(value):
                raise EndpointRefused(f"{name} must be a number, got {value!r}")
            changes[name] = float(value)
    for openai_name, engine_name in _CHAT_PARAMS.items():
        if body.get(openai_name) is not None:
            changes[engine_name] = body[openai_name]
    if changes:
        params["sampling"] = episode.sampling.replace(**changes)
    return messages, tools, params
