"""Weight sync for the trainer: one call that moves every engine to new weights, with rollstream.

``await WeightSync(urls, kind="vllm").update(consumer, path, version)`` does what each trainer
used to write by hand, in the order that keeps versions honest:

1. ``consumer.pause()``: producers stop admitting (rollstream's pause);
2. pause every engine (vLLM ``POST /pause?mode=...&clear_cache=true``; SGLang ``POST /pause_generation``);
3. reload the weights from ``path`` (a folder written by ``save_pretrained``) on every engine
   (vLLM ``POST /collective_rpc {"method": "reload_weights"}``; SGLang
   ``POST /update_weights_from_disk``, which also takes the version);
4. set the version on every engine (vLLM ``POST /update_weight_version``): samples generated from
   now on carry it in their weight-version spans;
5. resume every engine (``/resume``; ``/continue_generation``), then ``consumer.resume(version)``.

``mode`` says what happens to requests in flight at the pause: ``abort`` (they end at once with
``finish_reason: abort``; rollstream recycles the groups, with their partial tokens under partial
rollout), ``wait`` (the pause waits for them to finish on the old weights) or ``keep`` (they are
frozen and continue on the new weights after the resume: their samples span two versions, and
say so). SGLang: ``abort`` and ``keep`` pause with ``abort`` / ``retract``; ``wait`` does not
pause (its ``/update_weights_from_disk`` waits for the requests in flight).

Those endpoints are not written here: each engine server's are one
:class:`~rollstream.common.weight_apis.WeightAPI` in :data:`~rollstream.common.weight_apis.WEIGHT_APIS`
(``kind`` is its key), which the producer's catch-up of an engine found behind reads too. A new
server is a declaration there; this module needs no edit.

Engines are driven concurrently, each stage within its timeout. A failure raises
:class:`WeightSyncError` naming the engine, the stage and the reply, and leaves producers paused
(engines may hold different weights: the trainer retries :meth:`WeightSync.update`, which is
safe to repeat, or stops). The consumer is anything with ``pause()`` and ``resume(version)``
(a :class:`~rollstream.consumer.GroupConsumer`), so this module depends on nothing but aiohttp's
client and ``rollstream.common``. It was the package ``rollstream.engines`` until issue 31; users import
``from rollstream import WeightSync``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rollstream.common.checked import is_int
from rollstream.common.errors import ConfigError, WeightSyncError  # WeightSyncError: re-exported
from rollstream.common.versions import version_of
from rollstream.common.weight_apis import PAUSE_MODES, WEIGHT_APIS, Call, PauseMode, WeightAPI

if TYPE_CHECKING:
    import aiohttp

logger = logging.getLogger(__name__)

EngineKind = str
"""A key of :data:`~rollstream.common.weight_apis.WEIGHT_APIS` (``"vllm"``, ``"sglang"``)."""


class Pausable(Protocol):
    """What the sync needs of rollstream: a :class:`~rollstream.consumer.GroupConsumer` has it."""

    async def pause(self) -> None: ...

    async def resume(self, version: int | None = None) -> None: ...

    async def record_weights(self, path: str, version: int) -> None: ...


@dataclass(slots=True)
class UpdateReport:
    """How long each stage took (seconds), for the trainer's log."""

    version: int
    mode: str
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


class WeightSync:
    """Drives the weight update on a set of engines of one kind; use as ``async with`` or
    call :meth:`aclose`. ``timeout`` bounds each stage (``wait`` pauses: ``pause_timeout``)."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        kind: EngineKind = "vllm",
        timeout: float = 120.0,
        pause_timeout: float = 600.0,
    ) -> None:
        if not urls:
            raise ConfigError("WeightSync needs at least one engine URL")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"engine URL must start with http:// or https://, got {url!r}")
        if kind not in WEIGHT_APIS:
            raise ConfigError(f"engine kind must be one of {', '.join(WEIGHT_APIS)}, got {kind!r}")
        if timeout <= 0 or pause_timeout <= 0:
            raise ConfigError("timeout and pause_timeout must be positive")
        self.urls = tuple(u.rstrip("/") for u in urls)
        self.kind = kind
        self.api: WeightAPI = WEIGHT_APIS[kind]
        self.timeout = timeout
        self.pause_timeout = pause_timeout
        self._http: aiohttp.ClientSession | None = None  # made on first use, on the loop that uses it

    async def __aenter__(self) -> WeightSync:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._http is not None:
            http, self._http = self._http, None
            await http.close()

    # -- one call ---------------------------------------------------------------------

    async def update(
        self, consumer: Pausable | None, weights_path: str, version: int, *, mode: PauseMode = "abort"
    ) -> UpdateReport:
        """Pause producers and engines, reload ``weights_path`` everywhere, set ``version`` on the
        engines and in rollstream, resume. ``consumer`` None: the engines only."""
        if mode not in PAUSE_MODES:
            raise ConfigError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        if not is_int(version) or version < 0:
            raise ConfigError(f"version must be a non-negative integer, got {version!r}")
        report = UpdateReport(version=version, mode=mode)
        if consumer is not None:
            await self._timed(report, "pause producers", consumer.pause())
        await self._timed(report, "pause", self._each("pause", lambda url: self._pause(url, mode), self.pause_timeout))
        await self._timed(report, "reload", self._each("reload", lambda url: self._reload(url, weights_path, version)))
        if self.api.set_version is not None:
            await self._timed(report, "set version", self.set_version(version, rollstream=None))
        await self._timed(report, "resume", self._each("resume", lambda url: self._resume(url, mode)))
        if consumer is not None:
            await self._timed(report, "record weights", consumer.record_weights(weights_path, version))
            await self._timed(report, "resume producers", consumer.resume(version))
        logger.info(
            "weights %s loaded as version %d on %d %s engines (%s) in %.3f s",
            weights_path, version, len(self.urls), self.kind, mode, report.total,
        )
        return report

    async def set_version(self, version: int, *, rollstream: Pausable | None = None) -> None:
        """Label the engines' current weights ``version`` (vLLM starts as ``"default"``, which
        is no version: call this once at the start), and rollstream's if given."""
        call = self.api.set_version
        if call is not None:
            await self._each("set version", lambda url: self._call(url, call, "set version", version=version))
        if rollstream is not None:
            await rollstream.resume(version)

    async def versions(self) -> dict[str, int | None]:
        """Each engine's weight version as it reports it (None: not an integer)."""
        path = self.api.version_path

        async def one(url: str) -> int | None:
            return version_of(await self._request(url, "GET", path, None, "read version", self.timeout))

        results = await asyncio.gather(*(one(url) for url in self.urls))
        return dict(zip(self.urls, results, strict=True))

    # -- the declared calls ------------------------------------------------------------

    async def _pause(self, url: str, mode: PauseMode) -> None:
        call = self.api.pause[mode]
        if call is not None:
            await self._call(url, call, "pause", self.pause_timeout)

    async def _reload(self, url: str, path: str, version: int) -> None:
        for call in self.api.reload:
            reply = await self._call(url, call, "reload", path=path, version=version)
            if isinstance(reply, dict) and reply.get("success") is False:
                raise WeightSyncError(url, "reload", str(reply.get("message", reply))[:500])

    async def _resume(self, url: str, mode: PauseMode) -> None:
        if self.api.pause[mode] is not None:  # a mode that did not pause does not resume
            await self._call(url, self.api.resume, "resume")

    async def _call(
        self, url: str, call: Call, stage: str, seconds: float | None = None, *, path: str = "", version: int = 0
    ) -> Any:
        step, body = call.filled(path, version)
        return await self._post(url, step, body, stage, seconds)

    # -- plumbing ---------------------------------------------------------------------

    async def _timed(self, report: UpdateReport, stage: str, work: Awaitable[Any]) -> None:
        started = time.monotonic()
        await work
        report.seconds[stage] = round(time.monotonic() - started, 4)

    async def _each(self, stage: str, call: Callable[[str], Awaitable[Any]], seconds: float | None = None) -> None:
        """``call`` on every engine at once, within ``seconds``; the first failure raised."""
        limit = seconds if seconds is not None else self.timeout

        async def one(url: str) -> None:
            try:
                async with asyncio.timeout(limit):
                    await call(url)
            except TimeoutError:
                raise WeightSyncError(url, stage, f"no answer within {limit:g} s") from None

        results = await asyncio.gather(*(one(url) for url in self.urls), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        for error in errors[1:]:
            logger.error("weight update: %s", error)
        if errors:
            raise errors[0]

    async def _post(self, url: str, path: str, body: Any, stage: str, seconds: float | None = None) -> Any:
        return await self._request(url, "POST", path, body, stage, seconds if seconds is not None else self.timeout)

    async def _request(self, url: str, method: str, path: str, body: Any, stage: str, seconds: float) -> Any:
        import aiohttp  # here: a trainer that never syncs weights does not pay for importing it

        if self._http is None:
            self._http = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar(), raise_for_status=False)
        timeout = aiohttp.ClientTimeout(total=seconds, connect=min(seconds, 10.0))
        try:
            async with self._http.request(
                method, url + path, json=body, timeout=timeout, allow_redirects=False
            ) as response:
                status, content = response.status, await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise WeightSyncError(url, stage, f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        if status != 200:
            text = content.decode("utf-8", "replace")
            raise WeightSyncError(url, stage, f"{method} {path} answered HTTP {status}: {text[:500]}")
        if not content:
            return None
        try:
            return json.loads(content)
        except ValueError:
            return None

__all__ = ["PAUSE_MODES", "EngineKind", "Pausable", "PauseMode", "UpdateReport", "WeightSync", "WeightSyncError"]
