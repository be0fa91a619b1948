"""The inference-engine client: SGLang's native ``/generate`` and OpenAI-compatible servers.

One ``httpx.AsyncClient`` for all engines (connection limits, timeouts) over the aiohttp transport
(``httpx-aiohttp``: httpx's own pool costs 13-24 ms of CPU per request at 256 concurrent requests,
the aiohttp transport ~0.6 ms; see docs/benchmarks.md); tests may pass any ``httpx`` transport
(``httpx.MockTransport``). Replies are read within a byte bound (derived per request from
``max_new_tokens``, ``n`` and log-probs by :func:`reply_byte_bound`, or ``max_reply_bytes``) and
``request_timeout`` seconds in total, and parsed and validated by :mod:`.replies` straight into
packed arrays; an unusable reply raises :class:`EngineReplyInvalid` (an :class:`EngineRejected`,
not retried), so the producer records a FAILED sample. Requests go to the engine with the
fewest samples in flight; connection errors, 5xx and 429 are retried with exponential backoff
and jitter, possibly on another engine; any other 4xx is not retried (:class:`EngineRejected`).
After the retries, :class:`EngineError`.

Engine APIs (``EngineSettings.api``):

* ``sglang``: ``POST /generate`` with ``text`` or ``input_ids``; one request per sample. Works
  against an SGLang server or the SGLang gateway (``sglang-router``), which routes ``/generate``.
* ``openai``: ``POST /v1/completions`` (prompt as text or token ids) and, for chat messages
  without a local tokenizer, ``POST /v1/chat/completions``; vLLM's ``return_tokens_as_token_ids``
  and ``return_token_ids`` bring back token ids and log-probs. :meth:`EngineClient.generate_n`
  asks for the ``n`` samples of a group in one request (``n``).
* ``vllm``: vLLM's token-in/token-out ``POST /inference/v1/generate`` (``--enable-scale-out``):
  prompt token ids in (from ``--tokenizer`` or the engine's ``/tokenize``), ``n`` samples, token
  ids, text, log-probs and the **weight version spans** of each sample out; ``GET /weight_info``
  where a reply has no spans. No per-request ``seed`` is sent unless ``request_seed`` is on: a
  seeded request that vLLM's CPU engine reschedules (a pause with ``keep``, the recompute after
  a reload) kills that engine.

Weight versions come from the reply (SGLang's ``meta_info.weight_version``); when a reply has
none, from a best-effort ``GET /model_info`` then ``GET /get_model_info`` (the gateway only routes
the latter; 2 s timeout, cached for a short TTL) whose failures of any kind keep the last good
value and are logged at debug level, never raised. Servers that answer neither (vLLM's OpenAI
API) report ``None`` and the producer falls back to the trainer's version at admission. vLLM's
own API reports spans per sample, falling back to ``GET /weight_info``.

A gateway is detected by ``GET /workers``; :meth:`EngineClient.abort_all` then aborts on each
worker it lists (the gateway does not route ``/abort_request``), and :meth:`tokenize` falls back
to a worker's ``/tokenize``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from array import array
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import unquote, urlsplit, urlunsplit

import httpx
import msgspec
from httpx_aiohttp import AiohttpTransport
from rollstream.common.errors import ConfigError, EngineError, EngineRejected, PromptNotSupported
from rollstream.common.models import Packed

from . import replies, vllm_replay
from .replies import EngineReplyInvalid
from .tokenizer import PromptTokenizer

logger = logging.getLogger(__name__)

EngineAPI = Literal["sglang", "openai", "vllm"]
ENGINE_APIS = ("sglang", "openai", "vllm")
VLLM_GENERATE = "/inference/v1/generate"
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
JSON_HEADERS = {"content-type": "application/json"}
ERROR_BODY_BYTES = 65536
"""How much of a non-200 body is read (for the error message)."""
WORKERS_TTL = 10.0
"""Seconds a gateway's worker list is cached (workers come and go)."""

REPLY_BASE_BYTES = 256 * 2**10
"""Reply bound, per request: the envelope and metadata (usage, ids, finish reasons; < 2 KiB
in practice), and the margin of short replies."""
REPLY_TOKEN_BYTES = 96
"""Per output token: its id (``output_ids`` / ``token_ids``, <= 11 bytes) and its text,
JSON-escaped (typically 1-8 bytes; a long whitespace or code token more)."""
REPLY_LOGPROB_BYTES = 256
"""Per output token with log-probs asked for: SGLang's ``[logprob, id, null]`` (~25 bytes), vLLM's
``"token_id:N"`` token, log-prob, offset and top-log-prob entry (~80), or a chat log-prob object
with the token's ``bytes`` (~100, more for long tokens)."""
REPLY_PROMPT_TOKEN_BYTES = 12
"""Per prompt token echoed back (vLLM ``return_token_ids``: the reply's and each choice's
``prompt_token_ids``)."""


def reply_byte_bound(
    *, max_new_tokens: int, n: int, log_probs: bool, prompt_tokens: int = 0, prompt_copies: int = 0,
    extra_bytes_per_token: int = 0,
) -> int:
    """The most bytes a legitimate reply to one request can hold, with a margin (about 3x what
    SGLang and vLLM send for typical tokens): ``n`` samples of ``max_new_tokens`` each, their
    log-probs when asked for, ``prompt_copies`` echoes of a ``prompt_tokens`` prompt. The one
    place the default bound is derived: per-token data asked for beside the tokens (routed
    experts, teacher log-probs) adds ``extra_bytes_per_token``."""
    per_token = REPLY_TOKEN_BYTES + (REPLY_LOGPROB_BYTES if log_probs else 0) + extra_bytes_per_token
    return REPLY_BASE_BYTES + n * max_new_tokens * per_token + prompt_copies * prompt_tokens * REPLY_PROMPT_TOKEN_BYTES

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
    max_reply_bytes: int | None = None
    """Largest reply body accepted (bytes, checked while reading); larger fails the sample.
    None (the default): derived per request from what it can legitimately return
    (:func:`reply_byte_bound`), so the replies in flight take at most about ``concurrency`` x
    the bound of one sample."""
    max_retries: int = 5
    backoff_base: float = 0.2
    backoff_max: float = 10.0
    max_connections: int = 512
    model_info_timeout: float = 2.0
    model_info_ttl: float = 5.0
    return_logprob: bool = True
    request_seed: bool = False
    """Send a random per-request ``seed`` (vLLM API only). Off: a seeded request that the CPU
    engine reschedules (pause ``keep``, the recompute after a weight reload) kills it."""
    routed_experts: tuple[int, int, int] | None = None
    """``(layers, topk, experts)``: ask for the routing replay (SGLang ``return_routed_experts``;
    vLLM sends ``choices[].routed_experts`` unasked, see producer/vllm_replay.py; both servers run
    with ``--enable-return-routed-experts``) and check it against this shape."""
    engine_stats: bool = False
    """Record SGLang's prefix-cache and speculative-decoding counters per sample (``spec_info``,
    ``prefix_cache_info``: wire format v3)."""

    def __post_init__(self) -> None:
        if not self.urls:
            raise ConfigError("at least one engine URL is needed (--engine URL)")
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"engine URL must start with http:// or https://, got {url!r}")
        if self.api not in ENGINE_APIS:
            raise ConfigError(f"engine api must be one of {', '.join(ENGINE_APIS)}, got {self.api!r}")
        if self.api == "vllm" and "seed" in self.sampling_params:
            raise ConfigError(
                "a per-request seed kills vLLM's CPU engine when the request is rescheduled (pause keep, "
                "a weight reload): drop 'seed' from sampling_params (or use request_seed=True knowingly)"
            )
        if self.api == "openai" and not self.model:
            raise ConfigError("--engine-api openai needs --model NAME")
        if self.max_new_tokens < 1:
            raise ConfigError("max_new_tokens must be at least 1")
        if self.temperature < 0:
            raise ConfigError("temperature must be non-negative")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p must be in (0, 1]")
        if self.max_reply_bytes is not None and self.max_reply_bytes < 1024:
            raise ConfigError("max_reply_bytes must be at least 1024")
        if self.max_retries < 0:
            raise ConfigError("max_retries must be non-negative")
        for name in ("request_timeout", "connect_timeout", "model_info_timeout", "backoff_max"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.routed_experts is not None:
            if len(self.routed_experts) != 3 or any(not isinstance(v, int) or v < 1 for v in self.routed_experts):
                raise ConfigError(f"routed_experts must be (layers, topk, experts) >= 1, got {self.routed_experts!r}")
            if self.api == "openai":
                raise ConfigError("--routed-experts needs --engine-api sglang or vllm (the replay's endpoints)")


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
    weight_version_spans: list[tuple[int, int, int]] | None = None
    """``(version, start, end)`` over the output tokens, from the engine (vLLM API); None when it
    did not say. ``weight_version`` is then the last span's version."""
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


def _int_spans(spans: list[tuple[Any, int, int]] | None) -> list[tuple[int, int, int]] | None:
    """Spans with integer versions; None when there are none or a version is not an integer
    (vLLM's ``"default"`` before the first ``/update_weight_version``)."""
    if not spans:
        return None
    out = []
    for version, start, end in spans:
        parsed = parse_version(version)
        if parsed is None:
            return None
        out.append((parsed, start, end))
    return out


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


@contextlib.contextmanager
def _blame(engine: _Engine) -> Iterator[None]:
    """Name ``engine`` on the refusals and unusable replies raised inside (``EngineRejected.engine``)."""
    try:
        yield
    except EngineRejected as exc:
        if not exc.engine:
            exc.engine = engine.url
        raise


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
        return self.settings.api in ("openai", "vllm")

    async def prepare(self) -> None:
        """Load what a first prompt needs (the tokenizer) before the producer says ``running``."""
        if self.tokenizer is not None:
            await asyncio.to_thread(self.tokenizer.load)

    def _pick(self) -> _Engine:
        least = min(e.in_flight for e in self._engines)
        return random.choice([e for e in self._engines if e.in_flight == least])

    def _count_error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def reply_limit(
        self, max_new_tokens: int, n: int = 1, prompt_tokens: int = 0, prompt_copies: int = 0, *,
        replay_prompt_tokens: int = 0, log_probs: bool | None = None,
    ) -> int:
        """The reply bound of one request: ``max_reply_bytes`` when set, else derived from
        what the request asks for (:func:`reply_byte_bound`); with ``routed_experts``, the
        replay's base64 int32 rows (one per output token and per ``replay_prompt_tokens``)."""
        if self.settings.max_reply_bytes is not None:
            return self.settings.max_reply_bytes
        replay = 0
        if self.settings.routed_experts is not None:
            layers, topk, _ = self.settings.routed_experts
            replay = math.ceil(4 * layers * topk * 4 / 3) + 4  # base64 of int32 ids, with padding
        return reply_byte_bound(
            max_new_tokens=max_new_tokens, n=n,
            log_probs=self.settings.return_logprob if log_probs is None else log_probs,
            prompt_tokens=prompt_tokens, prompt_copies=prompt_copies, extra_bytes_per_token=replay,
        ) + replay * replay_prompt_tokens

    async def _post(
        self, path: str, body: Mapping[str, Any], weight: int = 1, *, limit: int
    ) -> tuple[_Engine, bytes]:
        """POST to the least-loaded engine with retries; the reply's body (HTTP 200), at most
        ``limit`` bytes.

        ``weight`` is the number of samples the request asks for (its in-flight count)."""
        content = _encode(body)
        attempt = 0
        while True:
            engine = self._pick()
            engine.in_flight += weight
            try:
                with _blame(engine):
                    status, raw = await self._send(engine.url + path, content, limit)
                    if status != 200 and status not in RETRY_STATUS:
                        self._count_error(f"http_{status}")
                        raise EngineRejected(status, raw.decode("utf-8", "replace"))
            except httpx.TransportError as exc:
                failure = f"{type(exc).__name__}: {exc}"
                self._count_error("connection")
            else:
                if status == 200:
                    return engine, raw
                self._count_error(f"http_{status}")
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

    async def _send(self, url: str, content: bytes, limit: int) -> tuple[int, bytes]:
        """One POST: the status and the body, read within ``limit`` bytes (error bodies: their
        first 64 KiB) and ``request_timeout`` seconds in total."""
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
        sampling: Mapping[str, Any] | None = None,
        image_data: Sequence[str] | None = None,
    ) -> Generation:
        """One sample for a prompt given as text, token ids or (OpenAI API) chat messages.

        ``sampling`` (temperature, top_p and engine extras, without the length limit) replaces
        the settings' sampling parameters for this request (an episode's own copy);
        ``image_data`` (URLs or data URIs) goes to SGLang's ``/generate`` beside the prompt."""
        return (await self._generate(1, text, input_ids, messages, max_new_tokens, rid, sampling, image_data))[0]

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
            return await self._generate(n, text, input_ids, messages, max_new_tokens, None, None, image_data)
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
        sampling: Mapping[str, Any] | None,
        image_data: Sequence[str] | None = None,
    ) -> list[Generation]:
        self._check_prompt(text, input_ids, messages)
        try:
            return await self._generate_api(n, text, input_ids, messages, max_new_tokens, rid, sampling, image_data)
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
        sampling: Mapping[str, Any] | None,
        image_data: Sequence[str] | None = None,
    ) -> list[Generation]:
        max_new = self.settings.max_new_tokens if max_new_tokens is None else max_new_tokens
        params = self._sampling(sampling)
        if self.settings.api == "openai":
            if messages is not None:
                return await self._chat_openai(messages, max_new, n, params)
            return await self._complete_openai(text, input_ids, max_new, n, params)
        if self.settings.api == "vllm":
            return await self._generate_vllm(text, input_ids, messages, max_new, n, params)
        if messages is not None:
            raise PromptNotSupported(
                "SGLang's /generate does not take chat messages: configure a tokenizer with a chat "
                "template (--tokenizer) or use --engine-api openai",
            )
        return [await self._generate_sglang(text, input_ids, max_new, rid, params, image_data)]

    def _sampling(self, sampling: Mapping[str, Any] | None) -> Mapping[str, Any]:
        """The request's sampling parameters (without the length limit): given, else the settings'."""
        if sampling is not None:
            return sampling
        return {"temperature": self.settings.temperature, "top_p": self.settings.top_p, **self.settings.sampling_params}

    async def _generate_sglang(
        self, text: str | None, input_ids: Sequence[int] | None, max_new: int, rid: str | None,
        sampling: Mapping[str, Any], image_data: Sequence[str] | None = None,
    ) -> Generation:
        params = {"max_new_tokens": max_new, **sampling}
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
        # SGLang echoes no prompt ids; a routing replay has a row per prompt and output token.
        prompt_tokens = len(input_ids or ()) if text is None else len(text.encode("utf-8")) + 16
        limit = self.reply_limit(max_new, replay_prompt_tokens=prompt_tokens if shape is not None else 0)
        engine, raw = await self._post("/generate", body, limit=limit)
        want = self.settings.return_logprob
        where = engine.url + "/generate"
        with _blame(engine):
            parsed = replies.parse_sglang(raw, want_logprobs=want, where=where)[0]
            experts = None
            if shape is not None and parsed.routed_experts is not None:
                experts = replies.decode_routed_experts(parsed.routed_experts, *shape, where=where)
            elif shape is not None and parsed.finish_reason != "abort":
                raise replies.EngineReplyInvalid(
                    "routed_experts",
                    "asked for but meta_info has none (start SGLang with --enable-return-routed-experts)", where,
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
        # The teacher scores every input token: bound as that many output tokens with log-probs.
        tokens = len(body.get("input_ids") or ())
        engine, raw = await self._post(path, body, limit=self.reply_limit(max(1, tokens), log_probs=True))
        return engine.url, raw

    def _openai_body(self, max_new: int, n: int, sampling: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "model": self.settings.model,
            "n": n,
            "max_tokens": max_new,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            **sampling,
        }

    async def _complete_openai(
        self, text: str | None, input_ids: Sequence[int] | None, max_new: int, n: int, sampling: Mapping[str, Any]
    ) -> list[Generation]:
        body = self._openai_body(max_new, n, sampling)
        body["prompt"] = text if text is not None else list(input_ids or ())
        if self.settings.return_logprob:
            body["logprobs"] = 0  # the sampled token's log-prob only
        # A prompt has at most one token per UTF-8 byte (+ special tokens); vLLM echoes its ids
        # on the reply and on each choice.
        prompt_tokens = len(input_ids or ()) if text is None else len(text.encode("utf-8")) + 16
        limit = self.reply_limit(max_new, n, prompt_tokens, prompt_copies=n + 1)
        engine, raw = await self._post("/v1/completions", body, weight=n, limit=limit)
        where = engine.url + "/v1/completions"
        with _blame(engine):
            parsed = replies.parse_completions(raw, n, want_logprobs=self.settings.return_logprob, where=where)
        version = await self.weight_version(engine)
        return [_generation(p, engine, version) for p in parsed]

    async def _chat_openai(
        self, messages: Messages, max_new: int, n: int, sampling: Mapping[str, Any]
    ) -> list[Generation]:
        body = self._openai_body(max_new, n, sampling)
        body["messages"] = [dict(m) for m in messages]
        if self.settings.return_logprob:
            body["logprobs"] = True
        prompt_tokens = len(_encode({"messages": body["messages"]})) + 256  # the template adds some
        limit = self.reply_limit(max_new, n, prompt_tokens, prompt_copies=n + 1)
        engine, raw = await self._post("/v1/chat/completions", body, weight=n, limit=limit)
        where = engine.url + "/v1/chat/completions"
        with _blame(engine):
            parsed = replies.parse_chat(raw, n, want_logprobs=self.settings.return_logprob, where=where)
        version = await self.weight_version(engine)
        return [_generation(p, engine, version) for p in parsed]

    async def _generate_vllm(
        self, text: str | None, input_ids: Sequence[int] | None, messages: Messages | None, max_new: int, n: int,
        sampling: Mapping[str, Any],
    ) -> list[Generation]:
        if input_ids is None:
            ids = await self.chat_ids(messages) if messages is not None else await self.tokenize(text or "")
            if ids is None:
                raise PromptNotSupported(
                    "--engine-api vllm sends token ids: give a tokenizer (--tokenizer) or an engine with /tokenize"
                )
            input_ids = ids
        params: dict[str, Any] = {"n": n, "max_tokens": max_new, **sampling}
        if self.settings.return_logprob:
            params["logprobs"] = 0  # the sampled token's log-prob only
        if self.settings.request_seed:
            params["seed"] = random.getrandbits(31)
        body = {
            "token_ids": input_ids if isinstance(input_ids, list | array) else list(input_ids),
            "sampling_params": params,
            "output_mode": "text",
        }
        # The reply may echo the prompt ids (on the reply and on each choice), like the completions API.
        replay = n * len(input_ids) if self.settings.routed_experts is not None else 0
        limit = self.reply_limit(max_new, n, len(input_ids), prompt_copies=n + 1, replay_prompt_tokens=replay)
        engine, raw = await self._post(VLLM_GENERATE, body, weight=n, limit=limit)
        parsed = replies.parse_vllm_generate(
            raw, n, want_logprobs=self.settings.return_logprob, where=engine.url + VLLM_GENERATE
        )
        out = []
        for p in parsed:
            with _blame(engine):
                experts = vllm_replay.routed_experts_of(p, self.settings.routed_experts, engine.url + VLLM_GENERATE)
            spans = _int_spans(p.weight_version_spans)
            version = spans[-1][0] if spans else await self.weight_version(engine)
            generation = _generation(p, engine, version, experts)
            generation.weight_version_spans = spans
            out.append(generation)
        return out

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
        paths = ("/weight_info",) if self.settings.api == "vllm" else ("/model_info", "/get_model_info")
        for path in paths:
            try:
                timeout = self.settings.model_info_timeout
                async with asyncio.timeout(timeout):  # in total, not per read
                    response = await self._http.get(engine.url + path, timeout=timeout)
                if response.status_code == 404:
                    if path == paths[-1]:
                        engine.has_model_info = False  # vLLM's OpenAI server: none exists; stop asking
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

        vllm = self.settings.api == "vllm"

        async def abort(url: str) -> None:
            try:
                if vllm:  # vLLM (dev mode): an empty list aborts everything in flight
                    response = await self._http.post(url + "/abort_requests", json={}, timeout=5.0)
                else:
                    response = await self._http.post(url + "/abort_request", json={"abort_all": True}, timeout=5.0)
                if response.status_code != 200:
                    logger.warning("abort on %s answered HTTP %d", url, response.status_code)
            except httpx.HTTPError as exc:
                logger.warning("abort on %s failed: %s", url, exc)

        await asyncio.gather(*(abort(url) for url in dict.fromkeys(urls)))
