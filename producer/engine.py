"""The inference-engine client: SGLang's native ``/generate`` and OpenAI-compatible servers.

One ``httpx.AsyncClient`` for all engines (connection limits, timeouts) over the aiohttp transport
(``httpx-aiohttp``: httpx's own pool costs 13-24 ms of CPU per request at 256 concurrent requests,
the aiohttp transport ~0.6 ms; see docs/benchmarks.md); tests may pass any ``httpx`` transport
(``httpx.MockTransport``). Replies are read within ``max_reply_bytes`` and ``request_timeout``
seconds in total, and parsed and validated by :mod:`.replies` straight into packed arrays; an
unusable reply raises :class:`EngineReplyInvalid` (an :class:`EngineRejected`, not retried), so
the producer records a FAILED sample. Requests go to the engine
with the fewest samples in flight; connection errors, 5xx and 429 are retried with exponential
backoff and jitter, possibly on another engine; any other 4xx is not retried
(:class:`EngineRejected`). After the retries, :class:`EngineError`.

Engine APIs (``EngineSettings.api``):

* ``sglang``: ``POST /generate`` with ``text`` or ``input_ids``; one request per sample. Works
  against an SGLang server or the SGLang gateway (``sglang-router``), which routes ``/generate``.
* ``openai``: ``POST /v1/completions`` (prompt as text or token ids) and, for chat messages
  without a local tokenizer, ``POST /v1/chat/completions``; vLLM's ``return_tokens_as_token_ids``
  and ``return_token_ids`` bring back token ids and log-probs. :meth:`EngineClient.generate_n`
  asks for the ``n`` samples of a group in one request (``n``).

Weight versions come from the reply (SGLang's ``meta_info.weight_version``); when a reply has
none, from a best-effort ``GET /model_info`` then ``GET /get_model_info`` (the gateway only routes
the latter; 2 s timeout, cached for a short TTL) whose failures of any kind keep the last good
value and are logged at debug level, never raised. Servers that answer neither (vLLM) report
``None`` and the producer falls back to the trainer's version at admission.

A gateway is detected by ``GET /workers``; :meth:`EngineClient.abort_all` then aborts on each
worker it lists (the gateway does not route ``/abort_request``), and :meth:`tokenize` falls back
to a worker's ``/tokenize``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from array import array
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import unquote, urlsplit, urlunsplit

import httpx
import msgspec
from httpx_aiohttp import AiohttpTransport
from rollstream.common.errors import ConfigError, EngineError, EngineRejected, PromptNotSupported
from rollstream.common.models import Packed

from . import replies
from .replies import EngineReplyInvalid
from .tokenizer import PromptTokenizer

logger = logging.getLogger(__name__)

EngineAPI = Literal["sglang", "openai"]
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
JSON_HEADERS = {"content-type": "application/json"}
ERROR_BODY_BYTES = 65536
"""How much of a non-200 body is read (for the error message)."""
WORKERS_TTL = 10.0
"""Seconds a gateway's worker list is cached (workers come and go)."""

Messages = Sequence[Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """How to reach the engines and what to ask them for."""

    urls: tuple[str, ...]
    api: EngineAPI = "sglang"
    model: str | None = None
    """Model name for OpenAI-compatible servers (required there)."""
    max_new_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    sampling_params: Mapping[str, Any] = field(default_factory=dict)
    """Extra sampling parameters passed through as they are."""
    request_timeout: float = 3600.0
    """Seconds one generation request may take in total, body included (not per read); past
    it the sample fails with :class:`EngineReplyInvalid` ``deadline``."""
    connect_timeout: float = 5.0
    max_reply_bytes: int = 64 * 2**20
    """Largest reply body accepted (bytes, checked while reading); larger fails the sample."""
    max_retries: int = 5
    backoff_base: float = 0.2
    backoff_max: float = 10.0
    max_connections: int = 512
    model_info_timeout: float = 2.0
    model_info_ttl: float = 5.0
    return_logprob: bool = True
    routed_experts: tuple[int, int, int] | None = None
    """``(layers, topk, experts)``: ask SGLang for the routing replay (``return_routed_experts``;
    the server runs with ``--enable-return-routed-experts``) and check it against this shape."""
    engine_stats: bool = False
    """Record SGLang's prefix-cache and speculative-decoding counters per sample (``spec_info``,
    ``prefix_cache_info``: wire format v3)."""

    def __post_init__(self) -> None:
        if not self.urls:
            raise ConfigError("at least one engine URL is needed (--engine URL)")
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"engine URL must start with http:// or https://, got {url!r}")
        if self.api not in ("sglang", "openai"):
            raise ConfigError(f"engine api must be 'sglang' or 'openai', got {self.api!r}")
        if self.api == "openai" and not self.model:
            raise ConfigError("--engine-api openai needs --model NAME")
        if self.max_new_tokens < 1:
            raise ConfigError("max_new_tokens must be at least 1")
        if self.temperature < 0:
            raise ConfigError("temperature must be non-negative")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p must be in (0, 1]")
        if self.max_reply_bytes < 1024:
            raise ConfigError("max_reply_bytes must be at least 1024")
        if self.max_retries < 0:
            raise ConfigError("max_retries must be non-negative")
        for name in ("request_timeout", "connect_timeout", "model_info_timeout", "backoff_max"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.routed_experts is not None:
            if len(self.routed_experts) != 3 or any(not isinstance(v, int) or v < 1 for v in self.routed_experts):
                raise ConfigError(f"routed_experts must be (layers, topk, experts) >= 1, got {self.routed_experts!r}")
            if self.api != "sglang":
                raise ConfigError("--routed-experts needs --engine-api sglang (meta_info.routed_experts)")


@dataclass(slots=True)
class Generation:
    """One engine reply (one sample), normalised across APIs."""

    text: str
    output_ids: array[int]
    """Packed ``array('i')`` (a sequence: ``len``, indexing and iteration work as on a list)."""
    log_probs: array[float] | None
    """Packed ``array('f')`` of the sampled tokens' log-probs; None when not asked for."""
    finish_reason: str | None
    weight_version: int | None
    engine: str
    metadata: dict[str, Any] = field(default_factory=dict)
    prompt_ids: array[int] | None = None
    """Prompt token ids as the engine saw them, when it says (vLLM ``return_token_ids``)."""
    routed_experts: Packed | None = None
    """The routing replay of the request's whole sequence (input + output - 1 rows) after
    ``routed_experts_start`` rows, when asked for (``EngineSettings.routed_experts``)."""
    routed_experts_start: int = 0
    counters: dict[str, int] | None = None
    """The engine's prefix-cache / speculative-decoding counters of this request (SGLang)."""


def parse_version(value: Any) -> int | None:
    """An integer weight version from an int or an integer string; None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    return None


def _generation(
    parsed: replies.ParsedReply, engine: _Engine, version: int | None, routed_experts: Packed | None = None
) -> Generation:
    return Generation(
        text=parsed.text,
        output_ids=parsed.output_ids,
        log_probs=parsed.log_probs,
        finish_reason=parsed.finish_reason,
        weight_version=version,
        engine=engine.url,
        prompt_ids=parsed.prompt_ids,
        routed_experts=routed_experts,
        routed_experts_start=parsed.routed_experts_start,
        counters=parsed.counters,
    )


def _encode(body: Mapping[str, Any]) -> bytes:
    """A request body as JSON bytes (msgspec; token-id arrays as lists)."""
    return msgspec.json.encode(body, enc_hook=_enc_hook)


def _enc_hook(value: Any) -> Any:
    if isinstance(value, array):
        return value.tolist()
    raise NotImplementedError(f"cannot encode {type(value).__name__} as JSON")


def _origin(url: httpx.URL) -> str:
    return f"{url.scheme}://{url.host}:{url.port or (443 if url.scheme == 'https' else 80)}"


def _split_credentials(url: str) -> tuple[str, httpx.BasicAuth | None]:
    """``url`` without its ``user:password@``, and those credentials (None when there are none)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None
    bare = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    return bare, httpx.BasicAuth(unquote(parts.username or ""), unquote(parts.password or ""))


class _OriginCredentials(httpx.Auth):
    """Basic auth for the requests to the engines whose URL carried credentials (by origin)."""

    def __init__(self, credentials: dict[str, httpx.BasicAuth]) -> None:
        self._credentials = credentials

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        auth = self._credentials.get(_origin(request.url))
        if auth is None or "authorization" in request.headers:
            yield request
            return
        yield from auth.auth_flow(request)


class _Engine:
    __slots__ = ("has_model_info", "in_flight", "url", "version", "version_checked", "workers", "workers_checked")

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.in_flight = 0
        self.version: int | None = None
        self.version_checked = -float("inf")
        self.has_model_info = True
        self.workers: list[str] | None = None
        """Worker URLs when this URL is a gateway, else None."""
        self.workers_checked = -float("inf")


class EngineClient:
    """Generates against one or more engines; use as ``async with`` or call ``aclose()``."""

    def __init__(
        self,
        settings: EngineSettings,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        tokenizer: PromptTokenizer | None = None,
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        # Credentials in an engine URL (user:password@) travel as an Authorization header only:
        # the engines' URLs (logs, errors, the heartbeat) never hold them.
        credentials: dict[str, httpx.BasicAuth] = {}
        self._engines = []
        for url in settings.urls:
            bare, auth = _split_credentials(url)
            self._engines.append(_Engine(bare))
            if auth is not None:
                credentials[_origin(httpx.URL(bare))] = auth
        limits = httpx.Limits(
            max_connections=settings.max_connections, max_keepalive_connections=settings.max_connections
        )
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.request_timeout, connect=settings.connect_timeout),
            limits=limits,
            transport=transport if transport is not None else AiohttpTransport(limits=limits),
            auth=_OriginCredentials(credentials) if credentials else None,
        )
        self.retries = 0
        self.errors: dict[str, int] = {}

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    @property
    def in_flight(self) -> int:
        """Samples being generated (a request for ``n`` samples counts ``n``)."""
        return sum(e.in_flight for e in self._engines)

    @property
    def accepts_messages(self) -> bool:
        """Whether chat messages can be sent as they are (OpenAI chat completions)."""
        return self.settings.api == "openai"

    @property
    def batches_samples(self) -> bool:
        """Whether :meth:`generate_n` asks for a group's samples in one request."""
        return self.settings.api == "openai"

    def _pick(self) -> _Engine:
        least = min(e.in_flight for e in self._engines)
        return random.choice([e for e in self._engines if e.in_flight == least])

    def _count_error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    async def _post(self, path: str, body: Mapping[str, Any], weight: int = 1) -> tuple[_Engine, bytes]:
        """POST to the least-loaded engine with retries; the reply's body (HTTP 200).

        ``weight`` is the number of samples the request asks for (its in-flight count)."""
        content = _encode(body)
        attempt = 0
        while True:
            engine = self._pick()
            engine.in_flight += weight
            try:
                status, raw = await self._send(engine.url + path, content)
            except httpx.TransportError as exc:
                failure = f"{type(exc).__name__}: {exc}"
                self._count_error("connection")
            else:
                if status == 200:
                    return engine, raw
                self._count_error(f"http_{status}")
                if status not in RETRY_STATUS:
                    raise EngineRejected(status, raw.decode("utf-8", "replace"))
                failure = f"HTTP {status}"
            finally:
                engine.in_flight -= weight
            if attempt >= self.settings.max_retries:
                raise EngineError(f"{engine.url}{path} failed after {attempt + 1} attempts; last error: {failure}")
            delay = min(self.settings.backoff_max, self.settings.backoff_base * 2**attempt)
            delay *= 0.5 + random.random() / 2
            attempt += 1
            self.retries += 1
            logger.info("engine %s%s: %s; retry %d in %.2f s", engine.url, path, failure, attempt, delay)
            await asyncio.sleep(delay)

    async def _send(self, url: str, content: bytes) -> tuple[int, bytes]:
        """One POST: the status and the body, read within ``max_reply_bytes`` (error bodies:
        their first 64 KiB) and ``request_timeout`` seconds in total."""
        limit = self.settings.max_reply_bytes
        try:
            async with asyncio.timeout(self.settings.request_timeout):
                async with self._http.stream("POST", url, content=content, headers=JSON_HEADERS) as response:
                    status = response.status_code
                    if status != 200:
                        limit = ERROR_BODY_BYTES
                    length = response.headers.get("content-length", "")
                    if status == 200 and length.isdigit() and int(length) > limit:
                        raise EngineReplyInvalid("too_large", f"Content-Length {length} > {limit} bytes", url)
                    chunks: list[bytes] = []
                    size = 0
                    async for chunk in response.aiter_bytes():
                        size += len(chunk)
                        if size > limit:
                            if status != 200:
                                chunks.append(chunk[: limit - size])
                                break
                            raise EngineReplyInvalid("too_large", f"more than {limit} bytes", url)
                        chunks.append(chunk)
        except TimeoutError:
            raise EngineReplyInvalid(
                "deadline", f"no complete reply within {self.settings.request_timeout:g} s", url
            ) from None
        return status, chunks[0] if len(chunks) == 1 else b"".join(chunks)

    # -- generation ---------------------------------------------------------------------

    @staticmethod
    def _check_prompt(text: str | None, input_ids: Sequence[int] | None, messages: Messages | None) -> None:
        if sum(x is not None for x in (text, input_ids, messages)) != 1:
            raise ValueError("give exactly one of text, input_ids and messages")

    async def generate(
        self,
        *,
        text: str | None = None,
        input_ids: Sequence[int] | None = None,
        messages: Messages | None = None,
        max_new_tokens: int | None = None,
        rid: str | None = None,
        image_data: Sequence[str] | None = None,
    ) -> Generation:
        """One sample for a prompt given as text, token ids or (OpenAI API) chat messages;
        ``image_data`` (URLs or data URIs) goes to SGLang's ``/generate`` beside them."""
        return (await self._generate(1, text, input_ids, messages, max_new_tokens, rid, image_data))[0]

    async def generate_n(
        self,
        n: int,
        *,
        text: str | None = None,
        input_ids: Sequence[int] | None = None,
        messages: Messages | None = None,
        max_new_tokens: int | None = None,
        image_data: Sequence[str] | None = None,
    ) -> list[Generation]:
        """``n`` samples of one prompt: one request with ``n`` (OpenAI API), else ``n`` requests."""
        if n < 1:
            raise ValueError("n must be at least 1")
        if self.batches_samples:
            return await self._generate(n, text, input_ids, messages, max_new_tokens, None, image_data)
        return list(
            await asyncio.gather(
                *(
                    self.generate(text=text, input_ids=input_ids, messages=messages, max_new_tokens=max_new_tokens,
                                  image_data=image_data)
                    for _ in range(n)
                )
            )
        )

    async def _generate(
        self,
        n: int,
        text: str | None,
        input_ids: Sequence[int] | None,
        messages: Messages | None,
        max_new_tokens: int | None,
        rid: str | None,
        image_data: Sequence[str] | None = None,
    ) -> list[Generation]:
        self._check_prompt(text, input_ids, messages)
        try:
            return await self._generate_api(n, text, input_ids, messages, max_new_tokens, rid, image_data)
        except EngineReplyInvalid:
            self._count_error("bad_reply")
            raise

    async def _generate_api(
        self,
        n: int,
        text: str | None,
        input_ids: Sequence[int] | None,
        messages: Messages | None,
        max_new_tokens: int | None,
        rid: str | None,
        image_data: Sequence[str] | None = None,
    ) -> list[Generation]:
        max_new = self.settings.max_new_tokens if max_new_tokens is None else max_new_tokens
        if self.settings.api == "openai":
            if messages is not None:
                return await self._chat_openai(messages, max_new, n)
            return await self._complete_openai(text, input_ids, max_new, n)
        if messages is not None:
            raise PromptNotSupported(
                "SGLang's /generate does not take chat messages: configure a tokenizer with a chat "
                "template (--tokenizer) or use --engine-api openai",
            )
        return [await self._generate_sglang(text, input_ids, max_new, rid, image_data)]

    async def _generate_sglang(
        self,
        text: str | None,
        input_ids: Sequence[int] | None,
        max_new: int,
        rid: str | None,
        image_data: Sequence[str] | None = None,
    ) -> Generation:
        params = {
            "max_new_tokens": max_new,
            "temperature": self.settings.temperature,
            "top_p": self.settings.top_p,
            **self.settings.sampling_params,
        }
        body: dict[str, Any] = {"sampling_params": params, "return_logprob": self.settings.return_logprob}
        if text is not None:
            body["text"] = text
        else:
            body["input_ids"] = input_ids if isinstance(input_ids, list | array) else list(input_ids or ())
        if rid is not None:
            body["rid"] = rid
        if image_data:
            body["image_data"] = list(image_data)
        shape = self.settings.routed_experts
        if shape is not None:
            body["return_routed_experts"] = True
        engine, raw = await self._post("/generate", body)
        want = self.settings.return_logprob
        where = engine.url + "/generate"
        parsed = replies.parse_sglang(raw, want_logprobs=want, where=where)[0]
        experts = None
        if shape is not None and parsed.routed_experts is not None:
            experts = replies.decode_routed_experts(parsed.routed_experts, *shape, where=where)
        elif shape is not None and parsed.finish_reason != "abort":
            raise replies.EngineReplyInvalid(
                "routed_experts", "asked for but meta_info has none (start SGLang with --enable-return-routed-experts)",
                where,
            )
        version = parse_version(parsed.weight_version)
        if version is None:
            version = await self.weight_version(engine)
        else:
            engine.version = version
        generation = _generation(parsed, engine, version, experts)
        if not self.settings.engine_stats:
            generation.counters = None
        return generation

    async def post(self, path: str, body: Mapping[str, Any]) -> tuple[str, bytes]:
        """POST ``body`` to the least-loaded engine with the retries, deadline and reply bound
        of a generation (a teacher's scoring request); the engine URL and the reply body."""
        engine, raw = await self._post(path, body)
        return engine.url, raw

    def _openai_body(self, max_new: int, n: int) -> dict[str, Any]:
        return {
            "model": self.settings.model,
            "n": n,
            "max_tokens": max_new,
            "temperature": self.settings.temperature,
            "top_p": self.settings.top_p,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            **self.settings.sampling_params,
        }

    async def _complete_openai(
        self, text: str | None, input_ids: Sequence[int] | None, max_new: int, n: int
    ) -> list[Generation]:
        body = self._openai_body(max_new, n)
        body["prompt"] = text if text is not None else list(input_ids or ())
        if self.settings.return_logprob:
            body["logprobs"] = 0  # the sampled token's log-prob only
        engine, raw = await self._post("/v1/completions", body, weight=n)
        where = engine.url + "/v1/completions"
        parsed = replies.parse_completions(raw, n, want_logprobs=self.settings.return_logprob, where=where)
        version = await self.weight_version(engine)
        return [_generation(p, engine, version) for p in parsed]

    async def _chat_openai(self, messages: Messages, max_new: int, n: int) -> list[Generation]:
        body = self._openai_body(max_new, n)
        body["messages"] = [dict(m) for m in messages]
        if self.settings.return_logprob:
            body["logprobs"] = True
        engine, raw = await self._post("/v1/chat/completions", body, weight=n)
        where = engine.url + "/v1/chat/completions"
        parsed = replies.parse_chat(raw, n, want_logprobs=self.settings.return_logprob, where=where)
        version = await self.weight_version(engine)
        return [_generation(p, engine, version) for p in parsed]

    # -- tokenization -------------------------------------------------------------------

    async def tokenize(self, text: str) -> list[int] | None:
        """Prompt ids: from the local tokenizer, else the engine's (or a gateway worker's)
        ``/tokenize``; None where there is none."""
        if self.tokenizer is not None:
            return await asyncio.to_thread(self.tokenizer.encode, text)
        engine = self._pick()
        body: dict[str, Any] = {"prompt": text}
        if self.settings.model:
            body["model"] = self.settings.model
        urls = [engine.url]
        workers = await self._workers(engine)
        if workers:
            urls += workers
        for url in urls:
            try:
                response = await self._http.post(url + "/tokenize", json=body, timeout=10.0)
                if response.status_code != 200:
                    logger.debug("tokenize on %s answered HTTP %d", url, response.status_code)
                    continue
                tokens = _int_list(response.json().get("tokens"))
            except (httpx.HTTPError, ValueError, AttributeError) as exc:
                logger.debug("tokenize on %s failed: %s", url, exc)
                continue
            if tokens is not None:
                return tokens
        return None

    async def chat_ids(self, messages: Messages) -> list[int] | None:
        """Prompt ids of chat messages rendered with the chat template; None without a tokenizer."""
        if self.tokenizer is None:
            return None
        return await asyncio.to_thread(self.tokenizer.render_chat, messages)

    # -- weight version, gateway, abort -------------------------------------------------

    async def weight_version(self, engine: _Engine | None = None) -> int | None:
        """Best-effort weight version of an engine: cached, refreshed from the model-info endpoint."""
        engine = engine or self._engines[0]
        now = time.monotonic()
        if not engine.has_model_info or now - engine.version_checked < self.settings.model_info_ttl:
            return engine.version
        engine.version_checked = now
        for path in ("/model_info", "/get_model_info"):
            try:
                timeout = self.settings.model_info_timeout
                async with asyncio.timeout(timeout):  # in total, not per read
                    response = await self._http.get(engine.url + path, timeout=timeout)
                if response.status_code == 404:
                    if path == "/get_model_info":
                        engine.has_model_info = False  # vLLM: neither exists; stop asking
                        logger.info("%s has no model-info endpoint; weight versions come from the trainer", engine.url)
                    continue
                if response.status_code != 200:
                    logger.debug("%s%s answered HTTP %d", engine.url, path, response.status_code)
                    break
                version = parse_version(response.json().get("weight_version"))
            except (httpx.HTTPError, ValueError, AttributeError, TimeoutError) as exc:
                logger.debug("%s%s failed: %s: %s", engine.url, path, type(exc).__name__, exc)
                break
            if version is None:
                logger.debug("%s%s has no integer weight_version", engine.url, path)
            else:
                engine.version = version
            break
        return engine.version

    async def _workers(self, engine: _Engine) -> list[str] | None:
        """Worker URLs if ``engine`` is an SGLang gateway (``GET /workers``), else None; cached."""
        now = time.monotonic()
        if now - engine.workers_checked < WORKERS_TTL:
            return engine.workers
        engine.workers_checked = now
        try:
            response = await self._http.get(engine.url + "/workers", timeout=self.settings.model_info_timeout)
            workers = response.json().get("workers") if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            logger.debug("%s/workers failed: %s: %s", engine.url, type(exc).__name__, exc)
            return engine.workers  # keep what we knew
        if isinstance(workers, list):
            urls = [str(w["url"]).rstrip("/") for w in workers if isinstance(w, dict) and w.get("url")]
            if engine.workers is None:
                logger.info("%s is a gateway with workers %s", engine.url, ", ".join(urls) or "(none)")
            engine.workers = urls
        else:
            engine.workers = None
        return engine.workers

    async def abort_all(self) -> None:
        """Ask every engine to abort its in-flight requests (best effort); behind a gateway,
        every worker it lists (the gateway does not route ``/abort_request``)."""
        urls: list[str] = []
        for engine in self._engines:
            engine.workers_checked = -float("inf")  # the freshest list
            workers = await self._workers(engine)
            urls.extend(workers if workers is not None else [engine.url])

        async def abort(url: str) -> None:
            try:
                response = await self._http.post(url + "/abort_request", json={"abort_all": True}, timeout=5.0)
                if response.status_code != 200:
                    logger.warning("abort on %s answered HTTP %d", url, response.status_code)
            except httpx.HTTPError as exc:
                logger.warning("abort on %s failed: %s", url, exc)

        await asyncio.gather(*(abort(url) for url in dict.fromkeys(urls)))
