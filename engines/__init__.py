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
say so). SGLang: ``abort`` and ``keep`` pause with ``abort`` / ``in_place``; ``wait`` does not
pause (its ``/update_weights_from_disk`` waits for the requests in flight).

Engines are driven concurrently, each stage within its timeout. A failure raises
:class:`WeightSyncError` naming the engine, the stage and the reply, and leaves producers paused
(engines may hold different weights: the trainer retries :meth:`WeightSync.update`, which is
safe to repeat, or stops). The consumer is anything with ``pause()`` and ``resume(version)``
(a :class:`~rollstream.consumer.GroupConsumer`), so this module depends on nothing but httpx.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import httpx
from rollstream.common.errors import ConfigError, WeightSyncError  # WeightSyncError: re-exported
from rollstream.common.versions import version_of

logger = logging.getLogger(__name__)

EngineKind = Literal["vllm", "sglang"]
PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES = ("abort", "wait", "keep")
_SGLANG_PAUSE = {"abort": "abort", "keep": "in_place"}


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
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not urls:
            raise ConfigError("WeightSync needs at least one engine URL")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"engine URL must start with http:// or https://, got {url!r}")
        if kind not in ("vllm", "sglang"):
            raise ConfigError(f"engine kind must be 'vllm' or 'sglang', got {kind!r}")
        if timeout <= 0 or pause_timeout <= 0:
            raise ConfigError("timeout and pause_timeout must be positive")
        self.urls = tuple(u.rstrip("/") for u in urls)
        self.kind = kind
        self.timeout = timeout
        self.pause_timeout = pause_timeout
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(pause_timeout, connect=10.0), transport=transport)

    async def __aenter__(self) -> WeightSync:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # -- one call ---------------------------------------------------------------------

    async def update(
        self, consumer: Pausable | None, weights_path: str, version: int, *, mode: PauseMode = "abort"
    ) -> UpdateReport:
        """Pause producers and engines, reload ``weights_path`` everywhere, set ``version`` on the
        engines and in rollstream, resume. ``consumer`` None: the engines only."""
        if mode not in PAUSE_MODES:
            raise ConfigError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ConfigError(f"version must be a non-negative integer, got {version!r}")
        report = UpdateReport(version=version, mode=mode)
        if consumer is not None:
            await self._timed(report, "pause producers", consumer.pause())
        await self._timed(report, "pause", self._each("pause", lambda url: self._pause(url, mode), self.pause_timeout))
        await self._timed(report, "reload", self._each("reload", lambda url: self._reload(url, weights_path, version)))
        if self.kind == "vllm":
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
        if self.kind == "vllm":
            await self._each(
                "set version",
                lambda url: self._post(url, "/update_weight_version", {"new_version": str(version)}, "set version"),
            )
        if rollstream is not None:
            await rollstream.resume(version)

    async def versions(self) -> dict[str, int | None]:
        """Each engine's weight version as it reports it (None: not an integer)."""
        path = "/weight_info" if self.kind == "vllm" else "/get_model_info"

        async def one(url: str) -> int | None:
            return version_of(await self._request(url, "GET", path, None, "read version", self.timeout))

        results = await asyncio.gather(*(one(url) for url in self.urls))
        return dict(zip(self.urls, results, strict=True))

    # -- per kind ---------------------------------------------------------------------

    async def _pause(self, url: str, mode: PauseMode) -> None:
        if self.kind == "vllm":
            # clear_cache (vLLM's default, said explicitly): with keep it preempts the frozen
            # requests and recomputes their KV with the new weights at the resume, so every token
            # after the split is the new weights'; without it they run on the old KV and match
            # neither version (docs/engines.md, "keep")
            await self._post(url, f"/pause?mode={mode}&clear_cache=true", None, "pause", self.pause_timeout)
        elif mode in _SGLANG_PAUSE:
            await self._post(url, "/pause_generation", {"mode": _SGLANG_PAUSE[mode]}, "pause", self.pause_timeout)

    async def _reload(self, url: str, path: str, version: int) -> None:
        if self.kind == "vllm":
            body: dict[str, Any] = {"method": "reload_weights", "kwargs": {"weights_path": path}}
            await self._post(url, "/collective_rpc", body, "reload")
        else:
            body = {"model_path": path, "weight_version": str(version)}
            reply = await self._post(url, "/update_weights_from_disk", body, "reload")
            if isinstance(reply, dict) and reply.get("success") is False:
                raise WeightSyncError(url, "reload", str(reply.get("message", reply))[:500])

    async def _resume(self, url: str, mode: PauseMode) -> None:
        if self.kind == "vllm":
            await self._post(url, "/resume", None, "resume")
        elif mode in _SGLANG_PAUSE:
            await self._post(url, "/continue_generation", {}, "resume")

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
        try:
            response = await self._http.request(method, url + path, json=body, timeout=seconds)
        except httpx.HTTPError as exc:
            raise WeightSyncError(url, stage, f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            detail = f"{method} {path} answered HTTP {response.status_code}: {response.text[:500]}"
            raise WeightSyncError(url, stage, detail)
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            return None


__all__ = ["PAUSE_MODES", "EngineKind", "Pausable", "PauseMode", "UpdateReport", "WeightSync", "WeightSyncError"]
