"""NOGROUP, NOPERM and OOM replies turned into rollstream's errors, the base of every namespace client
(:class:`Guarded`), and what is asked of the server itself (:class:`Server`)."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from ..connection import TRANSIENT_ERRORS
from ..errors import NamespaceGone, RedisDataLost
from ..keys import NAMESPACE_SCAN_PATTERN, Keys, namespace_of
from ..redis_errors import is_noperm, is_oom, translated
from ..redis_values import int_or, text

Entry = tuple[bytes, dict[bytes, bytes]]
"""A stream entry: its id and its raw fields (empty for an entry deleted meanwhile)."""

# -- NOGROUP ---------------------------------------------------------------------------------


def is_nogroup(exc: BaseException) -> bool:
    """Redis' NOGROUP reply, also when a Lua script's call raised it (then it is inside the message)."""
    return isinstance(exc, ResponseError) and "NOGROUP" in str(exc)


def nogroup_error(namespace: str, exc: BaseException) -> NamespaceGone:
    return NamespaceGone(
        f"the streams of namespace {namespace!r} are gone ({str(exc)[:300]}); was the namespace deleted, or "
        f"a consumer group destroyed? Run `rollstream init --ns {namespace} ...` (the same config) to create "
        "them again"
    )


def _guarded(method: Any) -> Any:
    @functools.wraps(method)
    async def call(self: Translated, *args: Any, **kwargs: Any) -> Any:
        async with self._guard():
            return await method(self, *args, **kwargs)

    call.__rollstream_guarded__ = True  # type: ignore[attr-defined]
    return call


class Translated:
    """A client whose NOPERM and OOM replies become rollstream's errors (:mod:`..redis_errors`):
    subclasses get every public coroutine method wrapped in :meth:`_guard` automatically."""

    redis: Redis

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, value in list(vars(cls).items()):
            if not name.startswith("_") and inspect.iscoroutinefunction(value):
                setattr(cls, name, _guarded(value))

    @contextlib.asynccontextmanager
    async def _guard(self) -> AsyncIterator[None]:
        with translated(self.redis):
            yield


class Guarded(Translated):
    """A namespace client on consumer groups: NOPERM and OOM translated, and NOGROUP replies become
    :class:`NamespaceGone` (or :class:`RedisDataLost`), for which it remembers the server's run_id
    from its first call. (A client that never meets a consumer group is :class:`Translated`: no
    INFO before its first command.)"""

    keys: Keys
    _run_id: str | None = None

    @contextlib.asynccontextmanager
    async def _guard(self) -> AsyncIterator[None]:
        if self._run_id is None:
            self._run_id = await Server(self.redis).run_id()
        try:
            with translated(self.redis):
                yield
        except ResponseError as exc:
            if is_nogroup(exc):
                raise await self._gone(exc) from exc
            raise

    async def _gone(self, exc: BaseException) -> NamespaceGone:
        """The error for a NOGROUP reply: ``RedisDataLost`` when Redis restarted since the first
        call and came back without the namespace (no persistence), else ``nogroup_error``."""
        keys = self.keys
        try:
            now_id = await Server(self.redis).run_id()
            config_left = bool(await self.redis.exists(keys.config))
        except TRANSIENT_ERRORS:
            return nogroup_error(keys.namespace, exc)
        run_id = self._run_id or ""
        if run_id and now_id and now_id != run_id and not config_left:
            return RedisDataLost(
                f"Redis restarted since this process connected (run_id {run_id[:8]}… -> {now_id[:8]}…) and came "
                f"back without namespace {keys.namespace!r}: it runs without persistence (or lost its data files). "
                "Everything in flight is lost; re-running `init` + `feed` would feed the dataset again from its "
                "start. Turn on AOF (`appendonly yes`, `appendfsync always`), then start over deliberately "
                f"(`rollstream ns delete --ns {keys.namespace}`, `init`, `feed`)"
            )
        return nogroup_error(keys.namespace, exc)

    async def _ack_or_nogroup(self, stream: str, group: str, entry_id: bytes) -> int:
        """XACK, which answers 0 for a missing group: then XPENDING raises its NOGROUP."""
        acked = int(await self.redis.xack(stream, group, entry_id))
        if not acked:
            await self.redis.xpending(stream, group)
        return acked


def memory_figures(info: Mapping[str, Any]) -> dict[str, Any]:
    """``used_memory``, ``maxmemory`` (0: no limit) and ``maxmemory_policy`` of an INFO memory reply."""
    return {
        "used_memory": int_or(info.get("used_memory")),
        "maxmemory": int_or(info.get("maxmemory")),
        "maxmemory_policy": text(info.get("maxmemory_policy", "")),
    }


class Server(Translated):
    """What a namespace client asks the Redis server itself (INFO, SCAN over every namespace)."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    async def run_id(self) -> str:
        """The server's ``run_id`` (changes when it restarts); empty when INFO is not allowed."""
        try:
            info = await self.redis.info("server")
        except ResponseError:  # an ACL user without INFO
            return ""
        return text(info.get("run_id", ""))

    async def memory(self) -> dict[str, Any] | None:
        """``used_memory``, ``maxmemory`` (0: no limit) and ``maxmemory_policy`` (INFO memory);
        None when INFO is not allowed (an ACL user without it) or unreachable."""
        try:
            info = await self.redis.info("memory")
        except (ResponseError, *TRANSIENT_ERRORS):
            return None
        return memory_figures(info)

    async def scan(self, match: str) -> list[bytes]:
        """Keys matching ``match``, found with SCAN (never KEYS: it blocks the server)."""
        return [key async for key in self.redis.scan_iter(match=match, count=1000)]

    async def namespaces(self) -> list[str]:
        """Namespaces with at least one key."""
        found = {namespace_of(text(key)) for key in await self.scan(NAMESPACE_SCAN_PATTERN)}
        return sorted(ns for ns in found if ns is not None)


def raise_if_refused(exc: ResponseError) -> None:
    """For the views that read a missing stream or group as empty: a refusal (NOPERM, OOM) is not
    a missing stream."""
    if is_noperm(exc) or is_oom(exc):
        raise exc


def flat_entries(rows: Sequence[Any]) -> list[Entry]:
    return [(entry_id, dict(fields or {})) for entry_id, fields in rows if entry_id is not None]
