"""The engine registry of a namespace: engines an operator adds, drains and removes at runtime
(``rollstream engines``), read by producers started with ``--engines-from-registry`` every
heartbeat. Plain data an operator can read: ``redis-cli HGETALL rollstream:{ns}:engines``."""

from __future__ import annotations

import getpass
import json
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from redis.asyncio import Redis

from ..errors import ConfigError
from ..keys import Keys
from ..redis_values import text
from ..urls import check_url
from .guard import Translated

STATES = ("active", "draining")


def check_engine_url(url: str) -> str:
    """``url`` normalised when it can be registered: it passes :func:`~rollstream.common.urls.check_url`
    (the producers' own check) and holds no credentials (every operator can read the registry:
    keep secrets in ``--engine`` URLs or the environment)."""
    checked = check_url(url)
    parts = urlsplit(checked)
    if parts.username is not None or parts.password is not None:
        raise ConfigError(
            f"engine URL {parts.hostname}: credentials in a registry URL would be readable by every operator; "
            "give that engine to the producers with --engine instead"
        )
    return checked


@dataclass(frozen=True, slots=True)
class RegistryEntry:
    """One registered engine; ``damage`` says why its stored value could not be read."""

    url: str
    state: str
    since_ms: int = 0
    by: str = ""
    damage: str = ""

    @classmethod
    def parse(cls, url: str, raw: bytes | str) -> RegistryEntry:
        try:
            obj = json.loads(raw)
        except ValueError:
            return cls(url, "", damage="not JSON")
        if not isinstance(obj, dict) or obj.get("state") not in STATES:
            return cls(url, "", damage=f"no state of {STATES}")
        since = obj.get("since_ms")
        return cls(url, obj["state"], since if isinstance(since, int) else 0, str(obj.get("by", "")))

    @property
    def usable(self) -> bool:
        """Readable, with a URL a producer may send requests to."""
        return not self.problem

    @property
    def problem(self) -> str:
        """Why a producer cannot use it (``""``: it can): its damage, else what the URL check says."""
        if self.damage:
            return self.damage
        try:
            check_engine_url(self.url)
        except ConfigError as exc:
            return str(exc)
        return ""


def _who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "?"
    return f"{user}@{socket.gethostname()}"


class EngineRegistry(Translated):
    """The ``engines`` hash of a namespace."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    async def _set(self, urls: Iterable[str], state: str) -> None:
        value = json.dumps({"state": state, "since_ms": int(time.time() * 1000), "by": _who()})
        mapping = {check_engine_url(u): value for u in urls}
        if mapping:
            await self.redis.hset(self.keys.engines, mapping=mapping)

    async def add(self, urls: Iterable[str]) -> None:
        """Register ``urls`` as active (or active again)."""
        await self._set(urls, "active")

    async def drain(self, urls: Iterable[str]) -> list[str]:
        """Mark ``urls`` draining; the ones not registered are returned (and not written)."""
        urls = [check_engine_url(u) for u in urls]
        known = await self.redis.hmget(self.keys.engines, urls) if urls else []
        missing = [u for u, v in zip(urls, known, strict=True) if v is None]
        await self._set([u for u in urls if u not in missing], "draining")
        return missing

    async def remove(self, urls: Iterable[str]) -> int:
        """Forget ``urls`` (producers drain them, then drop them); how many were registered."""
        urls = [u.rstrip("/") for u in urls]
        return int(await self.redis.hdel(self.keys.engines, *urls)) if urls else 0

    async def entries(self) -> dict[str, RegistryEntry]:
        """Every registered engine, damaged values named, never raised on."""
        raw = await self.redis.hgetall(self.keys.engines)
        out = {}
        for key, value in raw.items():
            url = text(key)
            out[url] = RegistryEntry.parse(url, value)
        return out
