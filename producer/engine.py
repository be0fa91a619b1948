"""The inference-engine client: SGLang's native ``/generate`` and OpenAI-compatible servers.

One ``httpx.AsyncClient`` for all engines (connection limits, timeouts); requests go to the engine
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from rollstream.common.errors import ConfigError, EngineError, EngineRejected, PromptNotSupported

from .tokenizer import PromptTokenizer

logger = logging.getLogger(__name__)

EngineAPI = Literal["sglang", "openai"]
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
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
    connect_timeout: float = 5.0
    max_retries: int = 5
    backoff_base: float = 0.2
    backoff_max: float = 10.0
    max_connections: int = 512
    model_info_timeout: float = 2.0
    model_info_ttl: float = 5.0
    return_logprob: bool = True

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
        if self.max_retries < 0:
            raise ConfigError("max_retries must be non-negative")
        for name in ("request_timeout", "connect_timeout", "model_info_timeout", "backoff_max"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")


@dataclass(slots=True)
class Generation:
    """One engine reply (one sample), normalised across APIs."""

    text: str
    output_ids: list[int]
    log_probs: list[float] | None
    finish_reason: str | None
    weight_version: int | None
    engine: str
    metadata: dict[str, Any] = field(default_factory=dict)
    prompt_ids: list[int] | None = None
    """Prompt token ids as the engine saw them, when it says (vLLM ``return_token_ids``)."""


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


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _token_id(token: Any) -> int | None:
    """The id in vLLM's ``return_tokens_as_token_ids`` form ``"token_id:N"``."""
    if isinstance(token, str) and token.startswith("token_id:"):
        try:
            return int(token.split(":", 1)[1])
        except ValueError:
            return None
    return None


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
        self._engines = [_Engine(url) for url in settings.urls]
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.request_timeout, connect=settings.connect_timeout),
            limits=httpx.Limits(
                max_connections=settings.max_connections,
                max_keepalive_connections=settings.max_connections,
            ),
            transport=transport,
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

    async def _post(self, path: str, body: Mapping[str, Any], weight: int = 1) -> tuple[_Engine, Any]:
        """POST to the least-loaded engine with retries; the decoded JSON reply.

        ``weight`` is the number of samples the request asks for (its in-flight count)."""
        attempt = 0
        while True:
            engine = self._pick()
            engine.in_flight += weight
            try:
                response = await self._http.post(engine.url + path, json=body)
            except httpx.TransportError as exc:
                failure = f"{type(exc).__name__}: {exc}"
                self._count_error("connection")
            else:
                if response.status_code == 200:
                    try:
                        return engine, response.json()
                    except ValueError:
                        failure = "reply is not JSON"
                        self._count_error("bad_reply")
                elif response.status_code in RETRY_STATUS:
                    failure = f"HTTP {response.status_code}"
                    self._count_error(f"http_{response.status_code}")
                else:
                    self._count_error(f"http_{response.status_code}")
                    raise EngineRejected(response.status_code, response.text)
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
    ) -> Generation:
        """One sample for a prompt given as text, token ids or (OpenAI API) chat messages."""
        return (await self._generate(1, text, input_ids, messages, max_new_tokens, rid))[0]

    async def generate_n(
        self,
        n: int,
        *,
        text: str | None = None,
        input_ids: Sequence[int] | None = None,
        messages: Messages | None = None,
        max_new_tokens: int | None = None,
    ) -> list[Generation]:
        """``n`` samples of one prompt: one request with ``n`` (OpenAI API), else ``n`` requests."""
        if n < 1:
            raise ValueError("n must be at least 1")
        if self.batches_samples:
            return await self._generate(n, text, input_ids, messages, max_new_tokens, None)
        return list(
            await asyncio.gather(
                *(
                    self.generate(text=text, input_ids=input_ids, messages=messages, max_new_tokens=max_new_tokens)
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
    ) -> list[Generation]:
        self._check_prompt(text, input_ids, messages)
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
        return [await self._generate_sglang(text, input_ids, max_new, rid)]

    async def _generate_sglang(
        self, text: str | None, input_ids: Sequence[int] | None, max_new: int, rid: str | None
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
            body["input_ids"] = list(input_ids or ())
        if rid is not None:
            body["rid"] = rid
        engine, reply = await self._post("/generate", body)
        if not isinstance(reply, dict):
            raise EngineError(f"{engine.url}/generate answered {type(reply).__name__}, not an object")
        meta = reply.get("meta_info") or {}
        finish = meta.get("finish_reason")
        finish_type = finish.get("type") if isinstance(finish, dict) else finish
        logprob_pairs = meta.get("output_token_logprobs")
        output_ids = reply.get("output_ids")
        log_probs: list[float] | None = None
        if isinstance(logprob_pairs, list):
            log_probs = [float(p[0]) if p[0] is not None else 0.0 for p in logprob_pairs]
            if not isinstance(output_ids, list):
                output_ids = [int(p[1]) for p in logprob_pairs]
        if not isinstance(output_ids, list):
            output_ids = []
        version = parse_version(meta.get("weight_version"))
        if version is None:
            version = await self.weight_version(engine)
        else:
            engine.version = version
        return Generation(
            text=str(reply.get("text", "")),
            output_ids=[int(t) for t in output_ids],
            log_probs=log_probs,
            finish_reason=finish_type,
            weight_version=version,
            engine=engine.url,
        )

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
        engine, reply = await self._post("/v1/completions", body, weight=n)
        choices = self._choices(engine, "/v1/completions", reply, n)
        version = await self.weight_version(engine)
        out = []
        for choice in choices:
            logprobs = _dict(choice.get("logprobs"))
            tokens = logprobs.get("tokens") or []
            token_logprobs = logprobs.get("token_logprobs")
            log_probs = [float(x) if x is not None else 0.0 for x in token_logprobs] if token_logprobs else None
            out.append(
                self._openai_generation(engine, reply, choice, str(choice.get("text", "")), tokens, log_probs, version)
            )
        return out

    async def _chat_openai(self, messages: Messages, max_new: int, n: int) -> list[Generation]:
        body = self._openai_body(max_new, n)
        body["messages"] = [dict(m) for m in messages]
        if self.settings.return_logprob:
            body["logprobs"] = True
        engine, reply = await self._post("/v1/chat/completions", body, weight=n)
        choices = self._choices(engine, "/v1/chat/completions", reply, n)
        version = await self.weight_version(engine)
        out = []
        for choice in choices:
            message = _dict(choice.get("message"))
            logprobs = _dict(choice.get("logprobs"))
            content = logprobs.get("content") if isinstance(logprobs.get("content"), list) else None
            tokens = [c.get("token") for c in content or () if isinstance(c, dict)]
            log_probs = [float(c.get("logprob") or 0.0) for c in content if isinstance(c, dict)] if content else None
            out.append(
                self._openai_generation(
                    engine, reply, choice, str(message.get("content") or ""), tokens, log_probs, version
                )
            )
        return out

    @staticmethod
    def _choices(engine: _Engine, path: str, reply: Any, n: int) -> list[dict[str, Any]]:
        choices = reply.get("choices") if isinstance(reply, dict) else None
        if not isinstance(choices, list) or len(choices) != n or not all(isinstance(c, dict) for c in choices):
            got = len(choices) if isinstance(choices, list) else "no"
            raise EngineError(f"{engine.url}{path} answered {got} choices, expected {n}")
        return sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c.get("index"), int) else 0)

    @staticmethod
    def _openai_generation(
        engine: _Engine,
        reply: dict[str, Any],
        choice: dict[str, Any],
        text: str,
        tokens: list[Any],
        log_probs: list[float] | None,
        version: int | None,
    ) -> Generation:
        output_ids = _int_list(choice.get("token_ids"))
        if output_ids is None:
            parsed = [_token_id(t) for t in tokens]
            output_ids = [t for t in parsed if t is not None] if all(t is not None for t in parsed) else []
        prompt_ids = _int_list(choice.get("prompt_token_ids"))
        if prompt_ids is None:
            prompt_ids = _int_list(reply.get("prompt_token_ids"))
        return Generation(
            text=text,
            output_ids=output_ids,
            log_probs=log_probs,
            finish_reason=choice.get("finish_reason"),
            weight_version=version,
            engine=engine.url,
            prompt_ids=prompt_ids,
        )

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
                response = await self._http.get(engine.url + path, timeout=self.settings.model_info_timeout)
                if response.status_code == 404:
                    if path == "/get_model_info":
                        engine.has_model_info = False  # vLLM: neither exists; stop asking
                        logger.info("%s has no model-info endpoint; weight versions come from the trainer", engine.url)
                    continue
                if response.status_code != 200:
                    logger.debug("%s%s answered HTTP %d", engine.url, path, response.status_code)
                    break
                version = parse_version(response.json().get("weight_version"))
            except (httpx.HTTPError, ValueError, AttributeError) as exc:
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
