"""The engine client: picks an engine, retries, discovers; the dialect writes and reads.

Requests go to the engine with the fewest samples in flight; connection errors, 5xx and 429 are
retried with :class:`~rollstream.common.backoff.Backoff` (``backoff_base``, ``backoff_max``),
possibly on another engine; any other status is not retried (:class:`EngineRejected`). After the
retries, :class:`EngineError`. An unusable reply raises :class:`EngineReplyInvalid` (an
``EngineRejected``, not retried, the engine named on it), so the producer records a FAILED sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from array import array
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from rollstream.common.errors import EngineError, EngineRejected

from .dialects import DIALECTS
from .discovery import INFO_BYTES, PROBE_ERRORS, gateway_workers, probe_version
from .http11 import Http11Transport
from .parse import json_object
from .settings import EngineSettings, reply_byte_bound
from .transport import HttpxTransport, Transport, split_credentials
from .types import EngineReplyInvalid, Generation, Messages, Request

if TYPE_CHECKING:
    from ..tokenizer import PromptTokenizer
    from .transport import TransportArg

logger = logging.getLogger(__name__)

RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
WORKERS_TTL = 10.0
"""Seconds a gateway's worker list is cached (workers come and go)."""


def _enc_hook(value: Any) -> Any:
    if isinstance(value, array):
        return value.tolist()
    raise NotImplementedError(f"cannot encode {type(value).__name__} as JSON")


_ENCODER = msgspec.json.Encoder(enc_hook=_enc_hook)


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    return None


class Engine:
    """One engine URL (credentials stripped) and what the client knows of it."""

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
        transport: TransportArg | None = None,
        tokenizer: PromptTokenizer | None = None,
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.dialect = DIALECTS[settings.api]
        if transport is None:
            transport = Http11Transport(
                max_connections=settings.max_connections, connect_timeout=settings.connect_timeout
            )
        elif not isinstance(transport, Transport):
            transport = HttpxTransport(transport, connect_timeout=settings.connect_timeout)
        self.transport: Transport = transport
        self._engines: list[Engine] = []
        for url in settings.urls:
            bare, auth = split_credentials(url)
            self._engines.append(Engine(bare))
            if auth is not None:
                transport.add_credentials(bare, auth)
        self._backoff = settings.backoff
        self.retries = 0
        self.errors: dict[str, int] = {}

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.transport.aclose()

    @property
    def in_flight(self) -> int:
        """Samples being generated (a request for ``n`` samples counts ``n``)."""
        return sum(e.in_flight for e in self._engines)

    @property
    def accepts_messages(self) -> bool:
        """Whether chat messages can be sent as they are (OpenAI chat completions)."""
        return self.dialect.accepts_messages

    @property
    def batches_samples(self) -> bool:
        """Whether :meth:`generate_n` asks for a group's samples in one request."""
        return self.dialect.batches_samples

    async def prepare(self) -> None:
        """Load what a first prompt needs (the tokenizer) before the producer says ``running``."""
        if self.tokenizer is not None:
            await asyncio.to_thread(self.tokenizer.load)

    def _pick(self) -> Engine:
        engines = self._engines
        if len(engines) == 1:
            return engines[0]
        least = min(e.in_flight for e in engines)
        return random.choice([e for e in engines if e.in_flight == least])

    def _count_error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    @staticmethod
    @contextlib.contextmanager
    def blame(engine: Engine) -> Iterator[None]:
        """Name ``engine`` on the refusals and unusable replies raised inside (``EngineRejected.engine``)."""
        try:
            yield
        except EngineRejected as exc:
            if not exc.engine:
                exc.engine = engine.url
            raise

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

    # -- the request path -----------------------------------------------------------------

    async def request(
        self, path: str, body: Mapping[str, Any], weight: int = 1, *, limit: int
    ) -> tuple[Engine, bytes]:
        """POST ``body`` to the least-loaded engine with retries; the engine and the reply's body
        (HTTP 200), at most ``limit`` bytes, within ``request_timeout`` seconds in total (else
        ``EngineReplyInvalid`` ``deadline``). ``weight``: the samples the request asks for."""
        content = _ENCODER.encode(body)
        settings = self.settings
        attempt = 0
        while True:
            engine = self._pick()
            url = engine.url + path
            engine.in_flight += weight
            try:
                with self.blame(engine):
                    status, raw = await self.transport.request("POST", url, content, limit=limit,
                                                               seconds=settings.request_timeout)
                    if status != 200 and status not in RETRY_STATUS:
                        self._count_error(f"http_{status}")
                        raise EngineRejected(status, raw.decode("utf-8", "replace"))
            except ConnectionError as exc:  # the transport's: no HTTP answer
                failure = str(exc)
                self._count_error("connection")
            except TimeoutError:
                deadline = EngineReplyInvalid("deadline", f"no complete reply within {settings.request_timeout:g} s",
                                              url)
                deadline.engine = engine.url
                raise deadline from None
            else:
                if status == 200:
                    return engine, raw
                self._count_error(f"http_{status}")
                failure = f"HTTP {status}"
            finally:
                engine.in_flight -= weight
            if attempt >= settings.max_retries:
                raise EngineError(f"{url} failed after {attempt + 1} attempts; last error: {failure}")
            delay = self._backoff.delay(attempt)
            attempt += 1
            self.retries += 1
            logger.info("engine %s: %s; retry %d in %.2f s", url, failure, attempt, delay)
            await asyncio.sleep(delay)

    async def post(self, path: str, body: Mapping[str, Any]) -> tuple[str, bytes]:
        """POST ``body`` to the least-loaded engine with the retries, deadline and reply bound
        of a generation (a teacher's scoring request); the engine URL and the reply body."""
        # The teacher scores every input token: bound as that many output tokens with log-probs.
        tokens = len(body.get("input_ids") or ())
        engine, raw = await self.request(path, body, limit=self.reply_limit(max(1, tokens), log_probs=True))
        return engine.url, raw

    # -- generation ---------------------------------------------------------------------

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
        """``n`` samples of one prompt: one request with ``n`` (OpenAI, vLLM), else ``n`` requests."""
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
        if sum(x is not None for x in (text, input_ids, messages)) != 1:
            raise ValueError("give exactly one of text, input_ids and messages")
        settings = self.settings
        if sampling is None:
            sampling = {"temperature": settings.temperature, "top_p": settings.top_p, **settings.sampling_params}
        request = Request(
            n, text, input_ids, messages, settings.max_new_tokens if max_new_tokens is None else max_new_tokens,
            sampling, rid, image_data,
        )
        try:
            engine, generations = await self.dialect.generate(self, request)
        except EngineReplyInvalid:
            self._count_error("bad_reply")
            raise
        asked: int | None = None
        missing = False
        for generation in generations:
            generation.engine = engine.url
            if generation.weight_version is None:
                if not missing:  # once per reply
                    asked, missing = await self.weight_version(engine), True
                generation.weight_version = asked
        return generations

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
        content = _ENCODER.encode(body)
        limit = INFO_BYTES + 12 * len(text.encode("utf-8"))
        urls = [engine.url]
        workers = await self._workers(engine)
        if workers:
            urls += workers
        for url in urls:
            try:
                status, raw = await self.transport.request("POST", url + "/tokenize", content, limit=limit,
                                                           seconds=10.0)
            except PROBE_ERRORS as exc:
                logger.debug("tokenize on %s failed: %s", url, exc)
                continue
            if status != 200:
                logger.debug("tokenize on %s answered HTTP %d", url, status)
                continue
            reply = json_object(raw)
            tokens = _int_list(reply.get("tokens")) if reply is not None else None
            if tokens is not None:
                return tokens
        return None

    async def chat_ids(self, messages: Messages) -> list[int] | None:
        """Prompt ids of chat messages rendered with the chat template; None without a tokenizer."""
        if self.tokenizer is None:
            return None
        return await asyncio.to_thread(self.tokenizer.render_chat, messages)

    # -- weight version, gateway, abort -------------------------------------------------

    async def weight_version(self, engine: Engine | None = None) -> int | None:
        """Best-effort weight version of an engine: cached for ``model_info_ttl`` seconds,
        refreshed from the dialect's model-info endpoints; a failure keeps the last good value."""
        engine = engine or self._engines[0]
        now = time.monotonic()
        if not engine.has_model_info or now - engine.version_checked < self.settings.model_info_ttl:
            return engine.version
        engine.version_checked = now
        version, exists = await probe_version(
            self.transport, engine.url, self.dialect.version_paths, self.settings.model_info_timeout
        )
        if not exists:
            engine.has_model_info = False  # vLLM's OpenAI server: none exists; stop asking
            logger.info("%s has no model-info endpoint; weight versions come from the trainer", engine.url)
        elif version is not None:
            engine.version = version
        return engine.version

    async def _workers(self, engine: Engine) -> list[str] | None:
        """Worker URLs if ``engine`` is an SGLang gateway, else None; cached for :data:`WORKERS_TTL`."""
        now = time.monotonic()
        if now - engine.workers_checked < WORKERS_TTL:
            return engine.workers
        engine.workers_checked = now
        answered, workers = await gateway_workers(self.transport, engine.url, self.settings.model_info_timeout)
        if not answered:
            return engine.workers  # keep what we knew
        if workers is not None and engine.workers is None:
            logger.info("%s is a gateway with workers %s", engine.url, ", ".join(workers) or "(none)")
        engine.workers = workers
        return engine.workers

    async def abort_all(self) -> None:
        """Ask every engine to abort its in-flight requests (best effort); behind a gateway,
        every worker it lists (the gateway does not route the abort)."""
        urls: list[str] = []
        for engine in self._engines:
            engine.workers_checked = -float("inf")  # the freshest list
            workers = await self._workers(engine)
            urls.extend(workers if workers is not None else [engine.url])
        content = _ENCODER.encode(self.dialect.abort_body)
        path = self.dialect.abort_path

        async def abort(url: str) -> None:
            try:
                status, _ = await self.transport.request("POST", url + path, content, limit=INFO_BYTES, seconds=5.0)
            except PROBE_ERRORS as exc:
                logger.warning("abort on %s failed: %s", url, exc)
                return
            if status != 200:
                logger.warning("abort on %s answered HTTP %d", url, status)

        await asyncio.gather(*(abort(url) for url in dict.fromkeys(urls)))
