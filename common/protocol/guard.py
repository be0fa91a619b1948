"""NOGROUP, NOPERM and OOM replies turned into rollstream's errors, and the base of every namespace client."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import AsyncIterator, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from ..connection import TRANSIENT_ERRORS
from ..errors import NamespaceGone, RedisDataLost
from ..keys import Keys
from ..parse import int_or, text
from ..redis_errors import is_noperm, is_oom, translated

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


async def server_run_id(redis: Redis) -> str:
    """The Redis server's ``run_id`` (changes when it restarts); empty when INFO is not allowed."""
    try:
        info = await redis.info("server")
    except ResponseError:  # an ACL user without INFO
        return ""
    return text(info.get("run_id", ""))


async def server_memory(redis: Redis) -> dict[str, Any] | None:
    """Redis' ``used_memory``, ``maxmemory`` (0: no limit) and ``maxmemory_policy`` (INFO memory);
    None when INFO is not allowed (an ACL user without it) or unreachable."""
    try:
        info = await redis.info("memory")
    except (ResponseError, *TRANSIENT_ERRORS):
        return None
    return {
        "used_memory": int_or(info.get("used_memory")),
        "maxmemory": int_or(info.get("maxmemory")),
        "maxmemory_policy": text(info.get("maxmemory_policy", "")),
    }


async def namespace_gone(redis: Redis, keys: Keys, run_id: str, exc: BaseException) -> NamespaceGone:
    """The error for a NOGROUP reply: ``RedisDataLost`` when Redis restarted since ``run_id`` was
    read and came back without the namespace (no persistence), else ``nogroup_error``."""
    try:
        now_id = await server_run_id(redis)
        config_left = bool(await redis.exists(keys.config))
    except TRANSIENT_ERRORS:
        return nogroup_error(keys.namespace, exc)
    if run_id and now_id and now_id != run_id and not config_left:
        return RedisDataLost(
            f"Redis restarted since this process connected (run_id {run_id[:8]}… -> {now_id[:8]}…) and came back "
            f"without namespace {keys.namespace!r}: it runs without persistence (or lost its data files). "
            "Everything in flight is lost; re-running `init` + `feed` would feed the dataset again from its start. "
            "Turn on AOF (`appendonly yes`, `appendfsync always`), then start over deliberately "
            f"(`rollstream ns delete --ns {keys.namespace}`, `init`, `feed`)"
        )
    return nogroup_error(keys.namespace, exc)


def _guarded(method: Any) -> Any:
    @functools.wraps(method)
    async def call(self: Guarded, *args: Any, **kwargs: Any) -> Any:
        async with self._guard():
            return await method(self, *args, **kwargs)

    call.__rollstream_guarded__ = True  # type: ignore[attr-defined]
    return call


class Guarded:
    """A namespace client whose NOGROUP replies become :class:`NamespaceGone` (or
    :class:`RedisDataLost`), remembering the server's run_id from its first call, and whose NOPERM
    and OOM replies become rollstream's errors. Subclasses get every public coroutine method
    wrapped in :meth:`_guard` automatically."""

    redis: Redis
    keys: Keys
    _run_id: str | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, value in list(vars(cls).items()):
            if not name.startswith("_") and inspect.iscoroutinefunction(value):
                setattr(cls, name, _guarded(value))

    @contextlib.asynccontextmanager
    async def _guard(self) -> AsyncIterator[None]:
        if self._run_id is None:
            self._run_id = await server_run_id(self.redis)
        try:
            with translated(self.redis):
                yield
        except ResponseError as exc:
            if is_nogroup(exc):
                raise await namespace_gone(self.redis, self.keys, self._run_id, exc) from exc
            raise


def raise_if_refused(exc: ResponseError) -> None:
    """For the views that read a missing stream or group as empty: a refusal (NOPERM, OOM) is not
    a missing stream."""
    if is_noperm(exc) or is_oom(exc):
        raise exc


async def ack_or_nogroup(redis: Redis, stream: str, group: str, entry_id: bytes) -> int:
    """XACK, which answers 0 for a missing group: then XPENDING raises its NOGROUP."""
    acked = int(await redis.xack(stream, group, entry_id))
    if not acked:
        await redis.xpending(stream, group)
    return acked


def flat_entries(rows: Sequence[Any]) -> list[Entry]:
    return [(entry_id, dict(fields or {})) for entry_id, fields in rows if entry_id is not None]
