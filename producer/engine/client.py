"""The engine client's request path: routes through the fleet, retries, blames; the dialect writes and reads.

Requests go to the engine :class:`~.fleet.Fleet` picks (the group's engine on the hash ring within
a bounded load, else the least loaded); connection errors, 5xx and 429 are retried with
:class:`~rollstream.common.backoff.Backoff` (``backoff_base``, ``backoff_max``), on another engine
when the failure took the engine out of routing (then not counted as a retry); any other status is
not retried (:class:`EngineRejected`). After the retries, :class:`EngineError`. An unusable reply
raises :class:`EngineReplyInvalid` (an ``EngineRejected``, not retried, the engine named on it), so
the producer records a FAILED sample. The client owns the fleet's monitor (:mod:`.monitor`, started
with the first request to a fleet of several: probes, loads, stalls, the registry) and its weight
versions (:mod:`.weights`), and passes the producer's calls on to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rollstream.common.checked import is_int
from rollstream.common.errors import EngineError, EngineRejected, EngineReplyInvalid, PromptNotSupported

from .dialects import DIALECTS
from .discovery import INFO_BYTES, PROBE_ERRORS
from .engine_state import Engine, EngineState
from .engine_state import attempt as attempt_on
from .fleet import Fleet
from .http11 import Http11Transport
from .ids_json import ENCODER as _ENCODER
from .monitor import FleetMonitor
from .parse import json_object
from .settings import EngineSettings, reply_byte_bound
from .transport import HttpxTransport, Transport, split_credentials
from .types import Generation, Messages, Request
from .weights import Versions

if TYPE_CHECKING:
    from ..tokenizer import PromptTokenizer
    from .transport import TransportArg

logger = logging.getLogger(__name__)

RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
"""The routing key of a request (its group's): what the SGLang gateway's consistent-hashing
policy reads (slime sends its session id in it); engines ignore it."""
ROUND_TRIP_WEIGHT = 0.1
"""Weight of the newest request in an engine's mean request time."""


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(is_int(t) for t in value):
        return list(value)
    return None


class _Blame:
    """:meth:`EngineClient.blame` as a plain class (twice per request: no generator to set up)."""

    __slots__ = ("_engine",)

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, EngineRejected) and not exc.engine:
            exc.engine = self._engine.url
        # returning None: the exception propagates as it is


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Read a cancelled call's outcome (no "exception never retrieved" warning)."""
    if not task.cancelled():
        task.exception()


def route_key(index: int, epoch: int) -> str:
    """The routing key of a group: its samples and every turn of its episodes share it."""
    return f"{index}:{epoch}"


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
        bare_urls = []
        for url in settings.urls:
            bare, auth = split_credentials(url)
            bare_urls.append(bare)
            if auth is not None:
                transport.add_credentials(bare, auth)
        self.fleet = Fleet(bare_urls, eject_after=settings.eject_after, balance=settings.balance,
                           concurrency_floor=settings.concurrency_floor if settings.adaptive_concurrency else None,
                           registered=settings.registry_urls,
                           joining=len(bare_urls) + len(settings.registry_urls) > 1)
        self._backoff = settings.backoff
        self.retries = 0
        self.errors: dict[str, int] = {}
        self.versions = Versions(self.fleet, transport, self.dialect, settings)
        self.monitor = FleetMonitor(self.fleet, transport, self.dialect, settings, self.versions, self.errors)

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.monitor.aclose()
        await self.versions.aclose()
        await self.transport.aclose()

    @property
    def _engines(self) -> list[Engine]:
        return list(self.fleet.engines.values())

    @property
    def in_flight(self) -> int:
        """Samples being generated (a request for ``n`` samples counts ``n``)."""
        return sum(e.in_flight for e in self.fleet.engines.values())

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
        if any(e.state is EngineState.JOINING for e in self.fleet.engines.values()):
            self.monitor.ensure()  # the first probes go out now, not with the first request

    def _pick(self, key: str | None = None, weight: int = 1) -> Engine:
        """The engine for a request now (any engine when none is routed: tokenize, probes)."""
        engine = self.fleet.pick(key, weight)
        return engine if engine is not None else next(iter(self.fleet.engines.values()))

    def _count_error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    @staticmethod
    def blame(engine: Engine) -> contextlib.AbstractContextManager[None]:
        """Name ``engine`` on the refusals and unusable replies raised inside (``EngineRejected.engine``)."""
        return _Blame(engine)

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
        self, path: str, body: Mapping[str, Any], weight: int = 1, *, limit: int, key: str | None = None
    ) -> tuple[Engine, bytes]:
        """POST ``body`` to an engine of the fleet (``key``: the group's, for cache-aware routing)
        with retries; the engine and the reply's body (HTTP 200), at most ``limit`` bytes, within
        ``request_timeout`` seconds in total (else ``EngineReplyInvalid`` ``deadline``).
        ``weight``: the samples the request asks for. A request whose engine is taken out of
        routing while it runs (ejected, wedged, drained past its timeout) is sent again to
        another engine, not counted as a retry."""
        content = _ENCODER.encode(body)
        settings = self.settings
        fleet = self.fleet
        headers = {ROUTING_KEY_HEADER: key} if key is not None else None
        if self.monitor.task is None and (len(fleet.engines) > 1 or settings.adaptive_concurrency):
            self.monitor.ensure()
        if not self.versions.settled.is_set():
            await self.versions.settled.wait()  # bounded: each read by model_info_timeout
        attempt = 0
        while True:
            engine = fleet.pick(key, weight)
            if engine is None:  # none routed, or all at their limits: wait (and have them probed)
                self.monitor.ensure()
                engine = await fleet.wait_engine(key, weight, no_engine=settings.no_engine_timeout,
                                                 room=settings.health_interval)
            url = engine.url + path
            engine.in_flight += weight
            sent = time.monotonic()
            try:
                with self.blame(engine):
                    answer = await self._unless_lost(engine, self.transport.request(
                        "POST", url, content, limit=limit, seconds=settings.request_timeout, headers=headers))
                    if answer is None:
                        self._count_error("engine_lost")
                        logger.info("engine %s taken out (%s): request sent again elsewhere", engine.url,
                                    engine.state)
                        continue
                    status, raw = answer
                    if status != 200 and status not in RETRY_STATUS:
                        self._count_error(f"http_{status}")
                        engine.last_reply = time.monotonic()
                        raise EngineRejected(status, raw.decode("utf-8", "replace"))
            except ConnectionError as exc:  # the transport's: no HTTP answer
                failure = str(exc)
                self._count_error("connection")
                if fleet.failed(engine, f"connection: {failure}", at_once=True):
                    continue  # another engine is routed: not the request's fault
            except TimeoutError:
                fleet.failed(engine, f"no reply within {settings.request_timeout:g} s")
                deadline = EngineReplyInvalid("deadline", f"no complete reply within {settings.request_timeout:g} s",
                                              url)
                deadline.engine = engine.url
                raise deadline from None
            else:
                if status == 200:
                    took, mean = time.monotonic() - sent, engine.round_trip
                    engine.round_trip = took if mean is None else mean + ROUND_TRIP_WEIGHT * (took - mean)
                    return engine, raw
                self._count_error(f"http_{status}")
                failure = f"HTTP {status}"
                if status != 429 and fleet.failed(engine, failure):  # 429: busy, not sick
                    continue
            finally:
                engine.in_flight -= weight
                if fleet.waiting_for_room:
                    fleet.room_freed()
            if attempt >= settings.max_retries:
                raise EngineError(f"{url} failed after {attempt + 1} attempts; last error: {failure}")
            delay = self._backoff.delay(attempt)
            attempt += 1
            self.retries += 1
            logger.info("engine %s: %s; retry %d in %.2f s", url, failure, attempt, delay)
            await asyncio.sleep(delay)

    @staticmethod
    async def _unless_lost(engine: Engine, call: Coroutine[Any, Any, tuple[int, bytes]]) -> tuple[int, bytes] | None:
        """``call``'s answer, or None when ``engine`` is taken out first (``call``, its own task, is
        then cancelled): the request learns it through its own await, nobody cancels it."""
        lost = engine.lost_signal()
        running = asyncio.ensure_future(call)
        try:
            with attempt_on(engine, running):
                await asyncio.wait((running, lost), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not running.done():
                running.cancel()
                running.add_done_callback(_retrieved)
        if running.done() and not running.cancelled():
            return running.result()
        return None

    async def post(self, path: str, body: Mapping[str, Any]) -> tuple[str, bytes]:
        """POST ``body`` to the least-loaded engine with the retries, deadline and reply bound
        of a generation (a teacher's scoring request); the engine URL and the reply body."""
        # The teacher scores every input token: bound as that many output tokens with log-probs.
        tokens = len(body.get("input_ids") or ())
        engine, raw = await self.request(path, body, limit=self.reply_limit(max(1, tokens), log_probs=True))
        return engine.url, raw

    # -- generation ---------------------------------------------------------------------

    async def generate(
        self, *, text: str | None = None, input_ids: Sequence[int] | None = None, messages: Messages | None = None,
        max_new_tokens: int | None = None, rid: str | None = None, sampling: Mapping[str, Any] | None = None,
        image_data: Sequence[str] | None = None, key: str | None = None,
    ) -> Generation:
        """One sample for a prompt given as text, token ids or (OpenAI API) chat messages.

        ``sampling`` (temperature, top_p and engine extras, without the length limit) replaces
        the settings' sampling parameters for this request (an episode's own copy);
        ``image_data`` (URLs or data URIs) goes to SGLang's ``/generate`` beside the prompt;
        ``key`` (the group's) routes the request to its engine (:mod:`.fleet`)."""
        return (await self._generate(1, text, input_ids, messages, max_new_tokens, rid, sampling, image_data, key))[0]

    async def generate_n(
        self, n: int, *, text: str | None = None, input_ids: Sequence[int] | None = None,
        messages: Messages | None = None, max_new_tokens: int | None = None, image_data: Sequence[str] | None = None,
        key: str | None = None, sampling: Mapping[str, Any] | None = None,
    ) -> list[Generation]:
        """``n`` samples of one prompt: one request with ``n`` (OpenAI, vLLM), else ``n`` requests
        (``sampling`` as :meth:`generate` takes it)."""
        if n < 1:
            raise ValueError("n must be at least 1")
        if self.batches_samples:
            return await self._generate(n, text, input_ids, messages, max_new_tokens, None, sampling, image_data, key)
        return list(await asyncio.gather(*(
            self.generate(text=text, input_ids=input_ids, messages=messages, max_new_tokens=max_new_tokens,
                          sampling=sampling, image_data=image_data, key=key)
            for _ in range(n)
        )))

    async def _generate(
        self, n: int, text: str | None, input_ids: Sequence[int] | None, messages: Messages | None,
        max_new_tokens: int | None, rid: str | None, sampling: Mapping[str, Any] | None,
        image_data: Sequence[str] | None = None, key: str | None = None,
    ) -> list[Generation]:
        if (text is not None) + (input_ids is not None) + (messages is not None) != 1:
            raise ValueError("give exactly one of text, input_ids and messages")
        settings = self.settings
        if sampling is None:
            sampling = {"temperature": settings.temperature, "top_p": settings.top_p, **settings.sampling_params}
        request = Request(
            n, text, input_ids, messages, settings.max_new_tokens if max_new_tokens is None else max_new_tokens,
            sampling, rid, image_data, key,
        )
        dialect = self.dialect
        if dialect.needs_token_ids and request.input_ids is None:
            found = await (self.chat_ids(messages) if messages is not None else self.tokenize(text or ""))
            if found is None:
                raise PromptNotSupported(
                    f"--engine-api {dialect.name} sends token ids: give a tokenizer (--tokenizer) or an engine "
                    "with /tokenize"
                )
            request.input_ids = found
        encoded = dialect.encode(request, settings)
        limit = self.reply_limit(request.max_new_tokens, encoded.weight, encoded.prompt_tokens, encoded.prompt_copies,
                                 replay_prompt_tokens=encoded.replay_prompt_tokens)
        if not self.versions.settled.is_set():
            await self.versions.settled.wait()
        sent = time.monotonic()
        before = self.versions.before_send()
        try:
            engine, raw = await self.request(encoded.path, encoded.body, encoded.weight, limit=limit, key=request.key)
            with self.blame(engine):
                generations = dialect.decode(encoded, raw, settings, engine.url + encoded.path)
        except EngineReplyInvalid as exc:
            self._count_error("bad_reply")
            bad = self.fleet.engines.get(exc.engine) if exc.engine else None
            if bad is not None and exc.reason != "deadline":  # the deadline was counted where it struck
                self.fleet.failed(bad, f"unusable reply: {exc.reason}: {exc.detail[:200]}")
            raise
        newest: int | None = None
        for generation in generations:
            generation.engine = engine.url
            if generation.weight_version is not None:
                newest = generation.weight_version if newest is None else max(newest, generation.weight_version)
            cache = generation.prefix_cache
            if cache is not None:
                engine.prompt_tokens += cache[0]
                engine.cached_tokens += cache[1]
            engine.tokens += len(generation.output_ids)
        self.fleet.answered(engine, newest)
        await self.versions.label(engine, generations, sent, before)
        return generations

    # -- tokenization -------------------------------------------------------------------

    async def tokenize(self, text: str) -> list[int] | None:
        """Prompt ids: from the local tokenizer, else the engine's (or a gateway worker's)
        ``/tokenize``; None where there is none."""
        if self.tokenizer is not None:
            return await asyncio.to_thread(self.tokenizer.encode, text)
        body: dict[str, Any] = {"prompt": text}
        if self.settings.model:
            body["model"] = self.settings.model
        content = _ENCODER.encode(body)
        limit = INFO_BYTES + 12 * len(text.encode("utf-8"))
        seconds = min(10.0, self.settings.health_timeout)  # a tokenization takes milliseconds
        for _ in range(len(self.fleet.engines)):
            engine = self._pick()
            tokens, unreachable = await self._tokenize_on(engine, content, limit, seconds)
            if tokens is not None or not unreachable or not self.fleet.failed(engine, unreachable, at_once=True):
                return tokens  # taken out of routing when unreachable: ask the next engine
            self.monitor.ensure()
        return None

    async def _tokenize_on(
        self, engine: Engine, content: bytes, limit: int, seconds: float
    ) -> tuple[list[int] | None, str]:
        """Ids from ``engine`` (or a worker of a gateway), and why the engine itself could not be
        reached (``""`` when it answered)."""
        urls = [engine.url]
        workers = await self.monitor.workers(engine)
        if workers:
            urls += workers
        unreachable = ""
        for url in urls:
            try:
                status, raw = await self.transport.request("POST", url + "/tokenize", content, limit=limit,
                                                           seconds=seconds)
            except PROBE_ERRORS as exc:
                logger.debug("tokenize on %s failed: %s", url, exc)
                if url == engine.url:
                    unreachable = f"/tokenize failed: {type(exc).__name__}: {exc}"
                continue
            if status != 200:
                logger.debug("tokenize on %s answered HTTP %d", url, status)
                continue
            reply = json_object(raw)
            tokens = _int_list(reply.get("tokens")) if reply is not None else None
            if tokens is not None:
                return tokens, ""
        return None, unreachable

    async def chat_ids(self, messages: Messages) -> list[int] | None:
        """Prompt ids of chat messages rendered with the chat template; None without a tokenizer."""
        if self.tokenizer is None:
            return None
        return await asyncio.to_thread(self.tokenizer.render_chat, messages)

    # -- weight version, gateway, abort -------------------------------------------------

    async def weight_version(self, engine: Engine | None = None) -> int | None:
        """:meth:`.weights.Versions.read` of ``engine`` (the first engine by default)."""
        return await self.versions.read(engine or self._engines[0])

    def versions_moved(self, *, paused: bool = False) -> None:
        """News of a weight update: :meth:`.weights.Versions.moved`."""
        self.versions.moved(paused=paused)

    @property
    def versions_from(self) -> str:
        """The heartbeat's ``weight_versions_from``: :attr:`.weights.Versions.sources`."""
        return self.versions.sources

    async def check_versions(self) -> None:
        """Once at start: :meth:`.weights.Versions.check`."""
        await self.versions.check()

    # -- the fleet monitor's (:mod:`.monitor`) --------------------------------------------

    def set_trainer_version(self, version: int, max_staleness: int) -> None:
        """The trainer's version: :meth:`.monitor.FleetMonitor.set_trainer_version`."""
        self.monitor.set_trainer_version(version, max_staleness)

    def apply_registry(self, entries: Mapping[str, str]) -> None:
        """The engine registry's entries: :meth:`.monitor.FleetMonitor.apply_registry`."""
        self.monitor.apply_registry(entries)

    def set_weights_source(self, weights: tuple[str, int] | None) -> None:
        """Where the trainer's weights are: :meth:`.monitor.FleetMonitor.set_weights_source`."""
        self.monitor.set_weights_source(weights)

    def take_out(self, url: str, why: str) -> bool:
        """Take the engine at ``url`` out of routing: :meth:`.monitor.FleetMonitor.take_out`."""
        return self.monitor.take_out(url, why)

    def fleet_status(self) -> list[dict[str, Any]]:
        """Each engine's state, load, version, errors and prefix hit rate (heartbeat, inspect)."""
        return self.fleet.status()

    async def abort_all(self) -> None:
        """Abort every engine's requests in flight: :meth:`.monitor.FleetMonitor.abort_all`."""
        await self.monitor.abort_all()
