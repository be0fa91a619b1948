"""Weight version and pause/resume: the ``state`` hash and the ``control`` channel."""

from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.client import PubSub

from .. import lua
from ..checked import is_int
from ..errors import ConfigError
from ..events import now_ms
from ..keys import Keys, StateField
from ..redis_values import int_or, text
from .guard import Guarded

# -- control ---------------------------------------------------------------------------------


def _check_version(version: int) -> None:
    if not is_int(version) or version < 0:
        raise ConfigError(f"weight version must be a non-negative integer, got {version!r}")


TAKEN_MESSAGE = "taken"
"""The control message of a ``take()``: the ready backlog went down, refused producers retry."""


class Control(Guarded):
    """Weight version and pause/resume: written to ``state``, then announced on ``control``.

    The write comes first and the message second, as two commands: PUBLISH cannot sit in a Redis
    Cluster transaction, and the message only wakes producers early (ADMIT reads the state)."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._set_version = lua.SET_VERSION.bind(redis, keys)

    async def weight_version(self) -> int:
        """The trainer's weight version; 0 when unset or damaged (``inspect`` reports the damage)."""
        return max(0, int_or(await self.redis.hget(self.keys.state, StateField.WEIGHT_VERSION)))

    async def paused(self) -> bool:
        return bool(await self.redis.hget(self.keys.state, StateField.PAUSED) == b"1")

    async def updated_since(self, version: int) -> bool:
        """Whether the pipeline is paused or its weight version is no longer ``version``: a
        weight update began or ended since then (an abort seen now is the pipeline's doing)."""
        paused, current = await self.redis.hmget(self.keys.state, [StateField.PAUSED, StateField.WEIGHT_VERSION])
        return paused == b"1" or max(0, int_or(current)) != version

    async def set_weight_version(self, version: int) -> None:
        """Record a new version; a change also records where it began in the consumption count
        (the terms of staleness-aware admission), in the same script."""
        _check_version(version)
        await self._set_version(version=version, paused="", channel=self.keys.control, message=f"version {version}")

    async def record_weights(self, path: str, version: int) -> None:
        """Where the weights of ``version`` are (a path every engine can load from)."""
        _check_version(version)
        if not path or len(path) > 4096:
            raise ConfigError(f"a weights path must be 1 to 4096 characters, got {len(path)}")
        await self.redis.hset(self.keys.weights, mapping={"path": path, "version": version, "since_ms": now_ms()})

    async def weights(self) -> tuple[str, int] | None:
        """The recorded ``(path, version)``, or None (none recorded, or damaged)."""
        raw = await self.redis.hmget(self.keys.weights, ["path", "version"])
        path, version = (text(v) if v is not None else None for v in raw)
        if not path or version is None or not version.isdigit():
            return None
        return path, int(version)

    async def pause(self) -> None:
        await self.redis.hset(self.keys.state, StateField.PAUSED, 1)
        await self.redis.publish(self.keys.control, "pause")

    async def resume(self, version: int | None = None) -> None:
        if version is not None:
            _check_version(version)
        await self._set_version(
            version="" if version is None else version, paused=0, channel=self.keys.control,
            message="resume" if version is None else f"resume {version}",
        )

    async def subscribe(self, blocking: Redis) -> PubSub:
        """A pub/sub subscription to the control channel, on a client that may block; the caller
        closes it (``await pubsub.aclose()``)."""
        pubsub = blocking.pubsub()
        try:
            await pubsub.subscribe(self.keys.control)
        except BaseException:
            await pubsub.aclose()
            raise
        return pubsub
