"""Namespace-wide limits and rates (``rollstream limits``, ``episode.limit`` / ``episode.rate``):
their sizes in the ``limits`` hash, leased units in a sorted set per limit, a token bucket per rate."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from .. import lua
from ..errors import ConfigError
from ..keys import Keys
from ..redis_values import text
from .guard import Translated

_SIZE = re.compile(r"^\s*([0-9]+)\s*$")
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*(s|sec|second|m|min|minute|h|hour)\s*$")
_PERIOD = {"s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0, "h": 3600.0, "hour": 3600.0}


def _check_name(name: str) -> str:
    if not name or not name.isidentifier():
        raise ConfigError(f"limit name {name!r} must be an identifier (NAME=K, NAME=R/s)")
    return name


def parse_limit(spec: str, flag: str = "--limit") -> tuple[str, int]:
    """``NAME=K`` -> (name, K): NAME an identifier, K a positive integer in decimal digits (no sign,
    no ``_``); the one parser of ``--limit`` (namespace limits and a producer's own)."""
    name, sep, value = spec.partition("=")
    match = _SIZE.match(value) if sep else None
    if match is None or int(match.group(1)) < 1:
        raise ConfigError(f"{flag} {spec!r}: expected NAME=K with K a positive integer (e.g. sandbox=64)")
    return _check_name(name.strip()), int(match.group(1))


def parse_limits(specs: Sequence[str], flag: str = "--limit") -> dict[str, int]:
    """``["sandbox=4", ...]`` -> ``{"sandbox": 4}``; ConfigError on a malformed or repeated one."""
    parsed: dict[str, int] = {}
    for spec in specs:
        name, size = parse_limit(spec, flag)
        _once(flag, name, parsed, spec)
        parsed[name] = size
    return parsed


def parse_rate(spec: str) -> tuple[str, float]:
    """``NAME=R/s`` or ``NAME=R/min`` (``/h`` too) -> (name, tokens per second)."""
    name, sep, value = spec.partition("=")
    match = _RATE.match(value) if sep else None
    if match is None or float(match.group(1)) <= 0:
        raise ConfigError(f"--rate {spec!r}: expected NAME=R/s or NAME=R/min with R > 0 (e.g. judge=600/min)")
    return _check_name(name.strip()), float(match.group(1)) / _PERIOD[match.group(2)]


def parse_limits_and_rates(limits: Sequence[str], rates: Sequence[str]) -> tuple[dict[str, int], dict[str, float]]:
    """``--limit NAME=K`` and ``--rate NAME=R/s`` specs as ``({name: K}, {name: per second})``;
    ConfigError for a name given twice with one flag (the last one would win silently)."""
    parsed_limits = parse_limits(limits)
    parsed_rates: dict[str, float] = {}
    for spec in rates:
        name, per_second = parse_rate(spec)
        _once("--rate", name, parsed_rates, spec)
        parsed_rates[name] = per_second
    return parsed_limits, parsed_rates


def _once(flag: str, name: str, seen: Mapping[str, float], spec: str) -> None:
    if name in seen:
        raise ConfigError(f"{flag} {name!r} is given twice ({name}={seen[name]:g}, then {spec!r}): give it once")


def format_rate(per_second: float) -> str:
    return f"{per_second:g}/s" if per_second >= 1 else f"{per_second * 60:g}/min"


@dataclass(frozen=True, slots=True)
class LimitView:
    """One limit or rate as ``inspect`` and ``limits list`` show it."""

    name: str
    kind: str
    """``limit`` or ``rate``."""
    size: float
    """Units (a limit) or tokens per second (a rate)."""
    holders: int = 0
    waiters: int = 0
    acquired: int = 0
    """Units granted (a limit) or tokens taken (a rate), ever."""
    wait_s: float = 0.0
    """Seconds waited before those, in all."""
    peak: int = 0
    """The most holders seen at once (a limit)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "kind": self.kind,
            "size": format_rate(self.size) if self.kind == "rate" else int(self.size),
            "holders": self.holders, "waiters": self.waiters, "acquired": self.acquired,
            "mean_wait_s": round(self.wait_s / self.acquired, 3) if self.acquired else 0.0, "peak": self.peak,
        }


class NamespaceLimits(Translated):
    """The limits and rates of one namespace: read and set by operators, held by producers."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._limit_acquire = lua.LIMIT_ACQUIRE.bind(redis, keys)
        self._limit_renew = lua.LIMIT_RENEW.bind(redis, keys)
        self._rate_take = lua.RATE_TAKE.bind(redis, keys)

    async def sizes(self) -> tuple[dict[str, int], dict[str, float]]:
        """(limit -> units, rate -> tokens per second) as set; unreadable fields are skipped."""
        limits, rates, _ = await self.read()
        return limits, rates

    async def read(self) -> tuple[dict[str, int], dict[str, float], set[str]]:
        """(limit -> units, rate -> tokens per second, names removed) as set; unreadable fields are
        skipped. A removed name (``limits remove``) leaves ``removed:NAME`` behind: producers
        that still know its size stop applying it (a hash that is gone says nothing of the kind)."""
        raw = await self.redis.hgetall(self.keys.limits)
        limits: dict[str, int] = {}
        rates: dict[str, float] = {}
        removed: set[str] = set()
        for field, value in raw.items():
            kind, _, name = text(field).partition(":")
            try:
                if kind == "limit":
                    limits[name] = int(text(value))
                elif kind == "rate":
                    rates[name] = float(text(value))
                elif kind == "removed":
                    removed.add(name)
            except ValueError:
                continue
        return limits, rates, removed - limits.keys() - rates.keys()

    async def set(self, limits: Mapping[str, int], rates: Mapping[str, float]) -> None:
        fields = {f"limit:{_check_name(n)}": str(k) for n, k in limits.items()}
        fields.update({f"rate:{_check_name(n)}": repr(float(r)) for n, r in rates.items()})
        if fields:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(self.keys.limits, mapping=fields)
                pipe.hdel(self.keys.limits, *{f"removed:{n}" for n in (*limits, *rates)})
                await pipe.execute()

    async def remove(self, names: Sequence[str], now_ms: int) -> int:
        """Delete limits and rates by name, leaving ``removed:NAME`` (``now_ms``) so running
        producers, whose last-read sizes stand in for a lost hash, stop applying them at their next
        try (LIMIT_ACQUIRE, RATE_TAKE); how many limit/rate fields went."""
        if not names:
            return 0
        fields = [f"{kind}:{_check_name(name)}" for name in names for kind in ("limit", "rate")]
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hdel(self.keys.limits, *fields)
            pipe.hset(self.keys.limits, mapping={f"removed:{name}": str(now_ms) for name in names})
            deleted, _ = await pipe.execute()
        return int(deleted)

    async def acquire(
        self, name: str, token: str, lease_ms: int, size_hint: int, waited_ms: int, wait_lease_ms: int | None = None
    ) -> tuple[str, int]:
        """One unit of the limit ``name``: ('ok' | 'wait' | 'unknown' | 'removed', the limit's size).
        Units go to waiters in the order they started waiting (``waited_ms`` ago); a waiter that does
        not ask again within ``wait_lease_ms`` (default ``lease_ms``) loses its place."""
        k = self.keys
        state, size = await self._limit_acquire(
            holders=k.limit_holders(name), waiters=k.limit_waiters(name), queue=k.limit_queue(name), name=name,
            token=token, lease_ms=lease_ms, size_hint=size_hint, waited_ms=waited_ms,
            wait_lease_ms=lease_ms if wait_lease_ms is None else wait_lease_ms,
        )
        return lua.status(state), int(size)

    async def renew(self, name: str, tokens: Sequence[str], lease_ms: int) -> list[str]:
        """Extend the leases of ``tokens``' units; the tokens that lost theirs."""
        if not tokens:
            return []
        lost = await self._limit_renew(holders=self.keys.limit_holders(name), lease_ms=lease_ms, tokens=tokens)
        return [lua.status(t) for t in lost]

    async def release(self, name: str, token: str) -> None:
        """Give a unit back (or stop waiting for one)."""
        await self.redis.zrem(self.keys.limit_holders(name), token)
        await self.redis.zrem(self.keys.limit_waiters(name), token)
        await self.redis.zrem(self.keys.limit_queue(name), token)

    async def take(self, name: str, rate_hint: float, waited_ms: int) -> tuple[str, int]:
        """One token of the rate ``name``: ('ok', 0), ('wait', ms until one is due), ('unknown', 0) or
        ('removed', 0): removed by ``limits remove`` (no longer applied)."""
        state, wait_ms = await self._rate_take(
            bucket=self.keys.rate_bucket(name), name=name, rate_hint=repr(float(rate_hint)), waited_ms=waited_ms,
        )
        return lua.status(state), int(wait_ms)

    async def views(self) -> list[LimitView]:
        """Every limit and rate with its holders and waiters now (leases not expired), the
        units granted and the time waited for them."""
        limits, rates = await self.sizes()
        if not limits and not rates:
            return []
        stats = {text(k): text(v) for k, v in (await self.redis.hgetall(self.keys.limit_stats)).items()}

        def stat(field: str) -> int:
            try:
                return int(float(stats.get(field, "0")))
            except ValueError:
                return 0

        seconds, micros = await self.redis.time()  # the clock the scores were written with
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        out = []
        for name, size in sorted(limits.items()):
            out.append(LimitView(
                name, "limit", size,
                holders=int(await self.redis.zcount(self.keys.limit_holders(name), now_ms, "+inf")),
                waiters=int(await self.redis.zcount(self.keys.limit_waiters(name), now_ms, "+inf")),
                acquired=stat(f"acquired:{name}"), wait_s=stat(f"wait_ms:{name}") / 1000, peak=stat(f"peak:{name}"),
            ))
        for name, rate in sorted(rates.items()):
            out.append(LimitView(name, "rate", rate, acquired=stat(f"taken:{name}"),
                                 wait_s=stat(f"rate_wait_ms:{name}") / 1000))
        return out
