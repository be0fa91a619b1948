"""The inference-engine client: SGLang's native ``/generate`` and OpenAI-compatible servers.

One ``httpx.AsyncClient`` for all engines (connection limits, timeouts); requests go to the engine
with the fewest requests in flight; connection errors, 5xx and 429 are retried with exponential
backoff and jitter, possibly on another engine; any other 4xx is not retried
(:class:`EngineRejected`). After the retries, :class:`EngineError`.

Weight versions come from the reply (SGLang's ``meta_info.weight_version``); when a reply has
none, from a best-effort ``GET /model_info`` (2 s timeout, cached for a short TTL) whose
failures of any kind keep the last good value and are logged at debug level, never raised.
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
from rollstream.common.errors import EngineError, EngineRejected

logger = logging.getLogger(__name__)

EngineAPI = Literal["sglang", "openai"]
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


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
            raise ValueError("at least one engine URL is needed (--engine URL)")
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine URL must start with http:// or https://, got {url!r}")
        if self.api not in ("sglang", "openai"):
            raise ValueError(f"engine api must be 'sglang' or 'openai', got {self.api!r}")
        if self.api == "openai" and not self.model:
            raise ValueError("--engine-api openai needs --model NAME")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be non-negative")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.max_retries < 0:
            raise ValueError("max_retries must be non-negative")
        for name in ("request_timeout", "connect_timeout", "model_info_timeout", "backoff_max"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")


@dataclass(slots=True)
class Generation:
    """One engine reply, normalised across APIs."""

    text: str
    output_ids: list[int]
    log_probs: list[float] | None
    finish_reason: str | None
    weight_version: int | None
    engine: str
    metadata: dict[str, Any] = field(default_factory=dict)


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


class _Engine:
    __slots__ = ("in_flight", "url", "version", "version_checked")

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.in_flight = 0
        self.version: int | None = None
        self.version_checked = 0.0


class EngineClient:
    """Generates against one or more engines; use as ``async with`` or call ``aclose()``."""

    def __init__(self, settings: EngineSettings, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.settings = settings
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
        return sum(e.in_flight for e in self._engines)

    def _pick(self) -> _Engine:
        least = min(e.in_flight for e in self._engines)
        return random.choice([e for e in self._engines if e.in_flight == least])

    def _count_error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    async def _post(self, path: str, body: Mapping[str, Any]) -> tuple[_Engine, Any]:
        """POST to the least-loaded engine with retries; the decoded JSON reply."""
        attempt = 0
        while True:
            engine = self._pick()
            engine.in_flight += 1
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
                engine.in_flight -= 1
            if attempt >= self.settings.max_retries:
                raise EngineError(
                    f"{engine.url}{path} failed after {attempt + 1} attempts; last error: {failure}"
                )
            delay = min(self.settings.backoff_max, self.settings.backoff_base * 2**attempt)
            delay *= 0.5 + random.random() / 2
            attempt += 1
            self.retries += 1
            logger.info("engine %s%s: %s; retry %d in %.2f s", engine.url, path, failure, attempt, delay)
            await asyncio.sleep(delay)

    async def generate(
        self,
        *,
        text: str | None = None,
        input_ids: Sequence[int] | None = None,
        max_new_tokens: int | None = None,
        rid: str | None = None,
    ) -> Generation:
        """One sample for a prompt given as text or as token ids."""
        if (text is None) == (input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        max_new = self.settings.max_new_tokens if max_new_tokens is None else max_new_tokens
        if self.settings.api == "openai":
            return await self._generate_openai(text, input_ids, max_new)
        return await self._generate_sglang(text, input_ids, max_new, rid)

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

    async def _generate_openai(
        self, text: str | None, input_ids: Sequence[int] | None, max_new: int
    ) -> Generation:
        body: dict[str, Any] = {
            "model": self.settings.model,
            "prompt": text if text is not None else list(input_ids or ()),
            "n": 1,
            "max_tokens": max_new,
            "temperature": self.settings.temperature,
            "top_p": self.settings.top_p,
            "logprobs": 0 if self.settings.return_logprob else None,
            "return_tokens_as_token_ids": True,
            **self.settings.sampling_params,
        }
        engine, reply = await self._post("/v1/completions", body)
        choices = reply.get("choices") if isinstance(reply, dict) else None
        if not isinstance(choices, list) or not choices:
            raise EngineError(f"{engine.url}/v1/completions answered without choices")
        choice = choices[0]
        logprobs = choice.get("logprobs") or {}
        tokens = logprobs.get("tokens") or []
        output_ids: list[int] = []
        if isinstance(choice.get("token_ids"), list):
            output_ids = [int(t) for t in choice["token_ids"]]
        else:
            for token in tokens:
                if isinstance(token, str) and token.startswith("token_id:"):
                    output_ids.append(int(token.split(":", 1)[1]))
        token_logprobs = logprobs.get("token_logprobs")
        log_probs = [float(x) if x is not None else 0.0 for x in token_logprobs] if token_logprobs else None
        return Generation(
            text=str(choice.get("text", "")),
            output_ids=output_ids,
            log_probs=log_probs,
            finish_reason=choice.get("finish_reason"),
            weight_version=None,
            engine=engine.url,
        )

    async def tokenize(self, text: str) -> list[int] | None:
        """Prompt ids from the engine's ``/tokenize``; None where the engine has none."""
        engine = self._pick()
        try:
            response = await self._http.post(engine.url + "/tokenize", json={"prompt": text}, timeout=10.0)
            if response.status_code != 200:
                return None
            tokens = response.json().get("tokens")
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            logger.debug("tokenize on %s failed: %s", engine.url, exc)
            return None
        if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
            return tokens
        return None

    async def weight_version(self, engine: _Engine | None = None) -> int | None:
        """Best-effort weight version of an engine: cached, refreshed from ``/model_info``."""
        engine = engine or self._engines[0]
        now = time.monotonic()
        if now - engine.version_checked < self.settings.model_info_ttl:
            return engine.version
        engine.version_checked = now
        for path in ("/model_info", "/get_model_info"):
            try:
                response = await self._http.get(engine.url + path, timeout=self.settings.model_info_timeout)
                if response.status_code == 404:
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

    async def abort_all(self) -> None:
        """Ask every engine to abort its in-flight requests (best effort)."""
        for engine in self._engines:
            try:
                await self._http.post(engine.url + "/abort_request", json={"abort_all": True}, timeout=5.0)
            except httpx.HTTPError as exc:
                logger.warning("abort on %s failed: %s", engine.url, exc)
