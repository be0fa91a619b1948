"""The Redis protocol of one namespace: the commands on its keys and the shapes of its payloads.

The producer, the consumer and the operator tools talk to Redis through these typed operations;
the atomic hand-overs themselves are the Lua scripts of :mod:`.lua`, which this module calls.

* :class:`PromptQueue`: a producer's side of the prompt streams (retry first): admit, renew leases, take over
  idle prompts with XAUTOCLAIM (keeping its cursor), adopt its own pending prompts, publish a
  group, return or dead-letter a prompt.
* :class:`GroupQueue`: the trainer's side of the group stream: read, own pending, orphans,
  recycle, dead-letter, drop, commit.
* :class:`Control`: weight version and pause/resume in the ``state`` hash, announced on the
  ``control`` channel so waiting producers wake at once.
* :class:`Heartbeat`: the producers' heartbeat, written and parsed here only, with the one
  liveness rule (:meth:`Heartbeat.alive`).
* :class:`Feed` (the feeder's cursor and prompt window), :class:`DeadLetters`, namespace keys; :func:`mark_take` and
  :func:`stream_lengths` (what ``take()`` reports).
* NOGROUP (the namespace was deleted, a consumer group destroyed; also raised inside a Lua
  script) becomes :class:`~.errors.NamespaceGone` naming the namespace, or
  :class:`~.errors.RedisDataLost` when Redis restarted without persistence since the first call;
  NOPERM becomes :class:`~.errors.RedisPermissionDenied` and OOM :class:`~.errors.RedisOutOfMemory`
  (:mod:`.redis_errors`). Every public coroutine method of a namespace client (:class:`_Guarded`)
  is wrapped in that guard when its class is made, so no method can forget it; the module's
  functions are decorated with :func:`~.redis_errors.translate_errors`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import math
from collections.abc import AsyncIterator, Container, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import ResponseError

from .admission import AdmissionTerms, admission_capacity
from .config import PipelineConfig
from .connection import TRANSIENT_ERRORS
from .errors import ConfigError, NamespaceGone, RedisDataLost
from .events import now_ms
from .keys import ALIVE_STATES, PRODUCERS_GROUP, TRAINER_GROUP, Keys, StateField
from .lua import Scripts
from .parse import int_or, text
from .redis_errors import is_noperm, is_oom, translate_errors, translated

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
    async def call(self: _Guarded, *args: Any, **kwargs: Any) -> Any:
        async with self._guard():
            return await method(self, *args, **kwargs)

    call.__rollstream_guarded__ = True  # type: ignore[attr-defined]
    return call


class _Guarded:
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


def _raise_if_refused(exc: ResponseError) -> None:
    """For the views that read a missing stream or group as empty: a refusal (NOPERM, OOM) is not
    a missing stream."""
    if is_noperm(exc) or is_oom(exc):
        raise exc


# -- heartbeats ------------------------------------------------------------------------------

_HEARTBEAT_INTS = (
    "pid", "in_flight_samples", "in_flight_prompts", "concurrency", "published", "groups_last_minute",
    "duplicates", "reclaimed", "engine_retries", "started_ms", "last_seen_ms", "long_requests",
    "admission_since_ms", "episodes", "episodes_peak", "engine_requests", "engine_requests_peak",
    "episodes_failed", "aborts_continued",
)
_HEARTBEAT_FLOATS = ("oldest_request_s", "long_request_s")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _heartbeat_object(raw: bytes | str) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except ValueError:  # UnicodeDecodeError included
        raise ValueError("heartbeat is not JSON") from None
    if not isinstance(obj, dict):
        raise ValueError("heartbeat is not a JSON object")
    return obj


@dataclass(slots=True)
class Heartbeat:
    """What a producer reports every ``heartbeat_interval`` in the ``producers`` hash (JSON)."""

    host: str = ""
    pid: int = 0
    state: str = "unknown"
    in_flight_samples: int = 0
    in_flight_prompts: int = 0
    concurrency: int = 0
    published: int = 0
    groups_last_minute: int = 0
    duplicates: int = 0
    reclaimed: int = 0
    engine_retries: int = 0
    engines: list[str] = field(default_factory=list)
    started_ms: int = 0
    last_seen_ms: int = 0
    admission: str = ""
    """The last ADMIT refusal (``paused``, ``backlog``, ``staleness``) while it lasts, else ``""``
    (admitting, or waiting for prompts: ``empty``)."""
    admission_since_ms: int = 0
    """When the refusal in ``admission`` began."""
    long_requests: int = 0
    """Samples whose engine request has been in flight longer than ``long_request_s``."""
    oldest_request_s: float = 0.0
    """Age of the oldest engine request in flight (0 when none)."""
    long_request_s: float = 0.0
    """The producer's threshold for ``long_requests`` (``--long-request-after``)."""
    episodes: int = 0
    """Episodes running now (inside the generate function), engine call or tool time."""
    episodes_peak: int = 0
    engine_requests: int = 0
    """Engine requests in flight now: tool time holds none (``--engine-concurrency`` caps it)."""
    engine_requests_peak: int = 0
    episodes_failed: int = 0
    """Episodes whose generate function raised, timed out or returned an invalid result."""
    aborts_continued: int = 0
    """Aborted engine calls continued inside their episode (partial rollout on)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def parse(cls, raw: bytes | str) -> Heartbeat:
        """The heartbeat in ``raw``; ValueError when it is not a JSON object. Unknown keys are
        ignored and missing or damaged ones take their defaults (older and newer producers both
        parse); :meth:`damage` says what was damaged."""
        obj = _heartbeat_object(raw)
        beat = cls()
        for name in _HEARTBEAT_INTS:
            value = obj.get(name)
            if isinstance(value, int | float) and _is_number(value):
                setattr(beat, name, int(value))
        for name in _HEARTBEAT_FLOATS:
            value = obj.get(name)
            if isinstance(value, int | float) and _is_number(value):
                setattr(beat, name, float(value))
        for name in ("host", "state", "admission"):
            if isinstance(obj.get(name), str):
                setattr(beat, name, obj[name])
        if isinstance(obj.get("engines"), list):
            beat.engines = [str(e) for e in obj["engines"]]
        return beat

    @staticmethod
    def damage(raw: bytes | str) -> str | None:
        """What is wrong with a raw heartbeat (for ``inspect``), or None."""
        try:
            obj = _heartbeat_object(raw)
        except ValueError as exc:
            return str(exc)
        bad = [n for n in (*_HEARTBEAT_INTS, *_HEARTBEAT_FLOATS) if n in obj and not _is_number(obj[n])]
        bad += [n for n in ("host", "state", "admission") if n in obj and not isinstance(obj[n], str)]
        return f"fields {', '.join(bad)} have the wrong type" if bad else None

    def fresh(self, now: int, timeout_s: float) -> bool:
        """Seen within ``timeout_s`` seconds before ``now`` (ms)."""
        return self.last_seen_ms >= now - timeout_s * 1000

    def alive(self, now: int, timeout_s: float) -> bool:
        """The liveness rule: a fresh heartbeat of a live state (starting, running, draining)."""
        return self.fresh(now, timeout_s) and self.state in ALIVE_STATES


def live_producers(raw: Mapping[bytes, bytes], now: int, timeout_s: float) -> tuple[int, int]:
    """(producers alive, in-flight samples of the alive ones) from the raw ``producers`` hash."""
    alive = in_flight = 0
    for value in raw.values():
        try:
            beat = Heartbeat.parse(value)
        except ValueError:
            continue
        if beat.alive(now, timeout_s):
            alive += 1
            in_flight += beat.in_flight_samples
    return alive, in_flight


def admission_refusals(raw: Mapping[bytes, bytes], now: int, timeout_s: float) -> dict[str, float]:
    """ADMIT refusal -> the longest time (s) a live producer has been getting it, from the raw
    ``producers`` hash."""
    out: dict[str, float] = {}
    for value in raw.values():
        try:
            beat = Heartbeat.parse(value)
        except ValueError:
            continue
        if beat.alive(now, timeout_s) and beat.admission and beat.admission_since_ms:
            age = max(0.0, (now - beat.admission_since_ms) / 1000)
            out[beat.admission] = max(out.get(beat.admission, 0.0), age)
    return out


@translate_errors
async def write_heartbeat(redis: Redis, keys: Keys, name: str, beat: Heartbeat, blocked_ms: int) -> None:
    """Write ``beat`` and add ``blocked_ms`` of refused admission to the namespace's total."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hset(keys.producers, name, beat.to_json())
        if blocked_ms > 0:
            pipe.hincrby(keys.state, StateField.ADMISSION_BLOCKED_MS, blocked_ms)
        await pipe.execute()


@translate_errors
async def read_heartbeats(redis: Redis, keys: Keys) -> dict[bytes, bytes]:
    """The raw ``producers`` hash: producer name -> heartbeat JSON (parse with :meth:`Heartbeat.parse`)."""
    return dict(await redis.hgetall(keys.producers))


# -- control ---------------------------------------------------------------------------------


def _check_version(version: int) -> None:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ConfigError(f"weight version must be a non-negative integer, got {version!r}")


TAKEN_MESSAGE = "taken"
"""The control message of a ``take()``: the ready backlog went down, refused producers retry."""


class Control(_Guarded):
    """Weight version and pause/resume: written to ``state``, then announced on ``control``.

    The write comes first and the message second, as two commands: PUBLISH cannot sit in a Redis
    Cluster transaction, and the message only wakes producers early (ADMIT reads the state)."""

    def __init__(self, redis: Redis, keys: Keys, scripts: Scripts | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.scripts = scripts if scripts is not None else Scripts(redis, keys)

    async def weight_version(self) -> int:
        """The trainer's weight version; 0 when unset or damaged (``inspect`` reports the damage)."""
        return max(0, int_or(await self.redis.hget(self.keys.state, StateField.WEIGHT_VERSION)))

    async def paused(self) -> bool:
        return await self.redis.hget(self.keys.state, StateField.PAUSED) == b"1"

    async def set_weight_version(self, version: int) -> None:
        """Record a new version; a change also records where it began in the consumption count
        (the terms of staleness-aware admission), in the same script."""
        _check_version(version)
        await self.scripts.set_version(version=version, paused=None, message=f"version {version}")

    async def pause(self) -> None:
        await self.redis.hset(self.keys.state, StateField.PAUSED, 1)
        await self.redis.publish(self.keys.control, "pause")

    async def resume(self, version: int | None = None) -> None:
        if version is not None:
            _check_version(version)
        await self.scripts.set_version(
            version=version, paused=False, message="resume" if version is None else f"resume {version}"
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


# -- prompt queue (producers) ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Admitted:
    """A prompt entry handed to a producer, with the stream it came from (``prompts`` or
    ``retry``): every later operation on it (publish, renew, return, dead-letter) names it."""

    stream: str
    entry_id: bytes
    fields: dict[bytes, bytes]


@dataclass(frozen=True, slots=True)
class Admission:
    """The ADMIT script's answer: ``ok`` with prompt entries, else why nothing was read."""

    status: str
    """``ok``, ``empty``, ``paused``, ``backlog``, ``backlog_bytes`` or ``staleness``."""
    entries: list[Admitted] = field(default_factory=list)
    weight_version: int = 0
    terms: list[int] = field(default_factory=list)
    """A refusal's numbers: ``backlog``: [ready]; ``backlog_bytes``: [projected bytes, budget];
    ``staleness``: [outstanding, capacity, c, G]."""


async def _ack_or_nogroup(redis: Redis, stream: str, group: str, entry_id: bytes) -> int:
    """XACK, which answers 0 for a missing group: then XPENDING raises its NOGROUP."""
    acked = int(await redis.xack(stream, group, entry_id))
    if not acked:
        await redis.xpending(stream, group)
    return acked


def _flat_entries(rows: Sequence[Any]) -> list[Entry]:
    return [(entry_id, dict(fields or {})) for entry_id, fields in rows if entry_id is not None]


class PromptQueue(_Guarded):
    """One producer's operations on the prompt streams (``retry`` and ``prompts``, consumer
    group ``producers``); every operation on an admitted entry names its stream."""

    def __init__(self, redis: Redis, keys: Keys, consumer: str, scripts: Scripts | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.consumer = consumer
        self.scripts = scripts if scripts is not None else Scripts(redis, keys)
        self._reclaim_cursors = {keys.retry: "0-0", keys.prompts: "0-0"}

    @property
    def streams(self) -> tuple[str, str]:
        """The prompt streams in admission order: retry first."""
        return (self.keys.retry, self.keys.prompts)

    async def admit(
        self,
        *,
        max_backlog: int,
        admission: bool,
        max_staleness: int,
        batch_size: int,
        steps_per_version: int = 1,
        count: int = 1,
        max_backlog_bytes: int = 0,
    ) -> Admission:
        """Read up to ``count`` prompts (retry stream first) if the pipeline is not paused, the
        ready backlog has room and staleness-aware admission allows it (one atomic script)."""
        reply = await self.scripts.admit(
            consumer=self.consumer, max_backlog=max_backlog, admission=admission,
            max_staleness=max_staleness, batch_size=batch_size, steps_per_version=steps_per_version,
            count=count, now_ms=now_ms(), max_backlog_bytes=max_backlog_bytes,
        )
        entries = [Admitted(stream, entry_id, fields) for stream, entry_id, fields in reply.entries]
        return Admission(reply.status, entries, reply.weight_version, reply.terms)

    async def wait_for_new(self, blocking: Redis, block_ms: int) -> None:
        """Block (on a client made for blocking) until a prompt is added, or ``block_ms`` pass."""
        await blocking.xread({stream: "$" for stream in self.streams}, count=1, block=block_ms)

    async def renew(self, stream: str, ids: Sequence[bytes]) -> list[bytes]:
        """Renew the leases of ``ids`` (entries of ``stream``); the ids this producer no longer owns."""
        return await self.scripts.renew(stream, self.consumer, list(ids))

    async def own_pending(self, count: int = 1000) -> list[Admitted]:
        """Claim back the prompts pending under this producer's name (a restart with the same name)."""
        out: list[Admitted] = []
        for stream in self.streams:
            pending = await self.redis.xpending_range(
                stream, PRODUCERS_GROUP, min="-", max="+", count=count, consumername=self.consumer
            )
            if not pending:
                continue
            ids = [p["message_id"] for p in pending]
            claimed = await self.redis.xclaim(stream, PRODUCERS_GROUP, self.consumer, 0, ids)
            out.extend(Admitted(stream, eid, fields) for eid, fields in _flat_entries(claimed))
        return out

    async def reclaim_turn(self, interval_ms: int) -> tuple[bool, int]:
        """(whether this producer looks for idle prompts this interval, when idle prompts were
        last found): one look per interval for the fleet instead of one per producer, since it
        walks the whole pending list (docs/scale.md)."""
        async with self._guard():
            return await self.scripts.reclaim_turn(now_ms(), max(1, interval_ms))

    async def announce_reclaim(self) -> None:
        """Record that prompts sit idle past the lease: every producer takes over what it has
        room for at its next turn."""
        await self.redis.hset(self.keys.state, StateField.RECLAIM_DUE_MS, now_ms())

    async def any_idle(self, lease_ms: int) -> bool:
        """Whether some prompt sits idle past the lease (its producer is gone)."""
        for stream in self.streams:
            if await self.redis.xpending_range(stream, PRODUCERS_GROUP, min="-", max="+", count=1, idle=lease_ms):
                return True
        return False

    async def reclaim(self, lease_ms: int, count: int, held: Container[bytes] = ()) -> list[Admitted]:
        """Take over up to ``count`` prompts idle past the lease (XAUTOCLAIM from the cursor kept
        per stream, retry first). Entries deleted meanwhile come back with empty fields (see
        :meth:`ack_deleted`) or, on Redis 6.2, as nil without their ids: those are found among this
        consumer's own pending entries (except the ``held`` ones it works on) and acknowledged."""
        out: list[Admitted] = []
        for stream in self.streams:
            want = max(1, count) - len(out)
            if want <= 0:
                break
            reply = await self.redis.xautoclaim(
                stream, PRODUCERS_GROUP, self.consumer, lease_ms, start_id=self._reclaim_cursors[stream], count=want,
            )
            cursor, rows = reply[0], reply[1]
            self._reclaim_cursors[stream] = cursor.decode() if isinstance(cursor, bytes) else str(cursor)
            if any(row[0] is None for row in rows):
                await self._ack_claimed_deleted(stream, held)
            out.extend(Admitted(stream, eid, fields) for eid, fields in _flat_entries(rows))
        return out

    async def _ack_claimed_deleted(self, stream: str, held: Container[bytes]) -> None:
        rows = await self.redis.xpending_range(
            stream, PRODUCERS_GROUP, min="-", max="+", count=1000, consumername=self.consumer
        )
        for row in rows:
            entry_id = row["message_id"]
            if entry_id not in held and not await self.redis.xrange(stream, entry_id, entry_id):
                await self.redis.xack(stream, PRODUCERS_GROUP, entry_id)

    @property
    def reclaim_scanned(self) -> bool:
        """Whether the last :meth:`reclaim` reached the end of both streams."""
        return all(cursor in ("0-0", "0") for cursor in self._reclaim_cursors.values())

    async def ack_deleted(self, stream: str, entry_id: bytes) -> None:
        """Acknowledge (and delete) an entry that came back without fields."""
        await _ack_or_nogroup(self.redis, stream, PRODUCERS_GROUP, entry_id)
        await self.redis.xdel(stream, entry_id)

    async def count_reclaimed(self) -> None:
        await self.redis.hincrby(self.keys.state, StateField.RECLAIMED, 1)

    async def publish(self, stream: str, entry_id: bytes, group_fields: Mapping[str, Any]) -> bytes | None:
        """Publish a group and acknowledge its prompt atomically; None for a duplicate (the prompt
        was taken over and acknowledged by another producer)."""
        return await self.scripts.publish(stream, entry_id, group_fields, now_ms())

    async def give_back(self, stream: str, entry_id: bytes, fields: Mapping[Any, Any]) -> bool:
        """Put an unfinished prompt into the retry stream, attempt unchanged."""
        return await self.scripts.return_prompt(stream, entry_id, fields)

    async def dead_letter(self, stream: str, entry_id: bytes, fields: Mapping[Any, Any], reason: str) -> bool:
        return await self.scripts.dead_letter(
            source=stream, group=PRODUCERS_GROUP, entry_id=entry_id,
            reason=reason, fields=fields, now_ms=now_ms(),
        )


# -- trainer consumer name lease -------------------------------------------------------------


class NameLease(_Guarded):
    """A trainer consumer name held by one live process: its token in a key with a TTL, renewed
    while it is connected and deleted on close (a crashed holder's lease just expires)."""

    def __init__(self, redis: Redis, keys: Keys, consumer: str, token: str, scripts: Scripts | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.key = keys.consumer_lease(consumer)
        self.token = token
        self.scripts = scripts if scripts is not None else Scripts(redis, keys)

    async def hold(self, ttl_ms: int) -> bool:
        """Take the name if free or renew it if ours; False while another process holds it."""
        return await self.scripts.lease(self.key, self.token, ttl_ms)

    async def holder(self) -> str | None:
        raw = await self.redis.get(self.key)
        return None if raw is None else raw.decode("utf-8", "replace")

    async def release(self) -> bool:
        return await self.scripts.release(self.key, self.token)


@translate_errors
async def held_consumer_names(redis: Redis, keys: Keys) -> list[str]:
    """The trainer consumer names held by a live trainer now."""
    prefix = keys.consumer_lease("")
    return sorted(text(k)[len(prefix):] for k in await scan_namespace_keys(redis, keys.lease_pattern))


# -- group queue (trainer) -------------------------------------------------------------------


class GroupQueue(_Guarded):
    """One trainer consumer's operations on the group stream (consumer group ``trainer``)."""

    def __init__(self, redis: Redis, keys: Keys, consumer: str, scripts: Scripts | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.consumer = consumer
        self.scripts = scripts if scripts is not None else Scripts(redis, keys)

    async def read(self, blocking: Redis, count: int, block_ms: int) -> list[Entry]:
        """New groups, up to ``count``, waiting up to ``block_ms`` (on a client made for blocking)."""
        reply = await blocking.xreadgroup(
            TRAINER_GROUP, self.consumer, {self.keys.groups: ">"}, count=count, block=block_ms
        )
        return _flat_entries(reply[0][1] if reply else [])

    async def own_pending_page(self, after: str, count: int = 1000) -> list[Entry]:
        """Groups delivered to this consumer and not committed, after entry id ``after``."""
        reply = await self.redis.xreadgroup(TRAINER_GROUP, self.consumer, {self.keys.groups: after}, count=count)
        return _flat_entries(reply[0][1] if reply else [])

    async def pending_ids(self, count: int = 10_000) -> list[bytes]:
        """Ids pending under this consumer (including those of reads whose reply was lost)."""
        pending = await self.redis.xpending_range(
            self.keys.groups, TRAINER_GROUP, min="-", max="+", count=count, consumername=self.consumer
        )
        return [p["message_id"] for p in pending]

    async def fetch(self, entry_id: bytes) -> dict[bytes, bytes]:
        """The fields of one entry; empty when it was deleted meanwhile."""
        rows = await self.redis.xrange(self.keys.groups, entry_id, entry_id)
        return dict(rows[0][1]) if rows else {}

    async def ack_deleted(self, entry_id: bytes) -> None:
        """Acknowledge a delivered entry that is gone from the stream (and forget its bytes)."""
        await self.scripts.forget_group(entry_id)

    async def recycle(self, entry_id: bytes, counter: str, prompt_fields: Mapping[str, Any]) -> bool:
        return await self.scripts.recycle(entry_id, counter, prompt_fields)

    async def dead_letter(self, entry_id: bytes, fields: Mapping[Any, Any], reason: str) -> bool:
        return await self.scripts.dead_letter(
            source=self.keys.groups, group=TRAINER_GROUP, entry_id=entry_id,
            reason=reason, fields=fields, now_ms=now_ms(),
        )

    async def drop_filtered(self, entry_id: bytes, reason: str) -> int:
        return await self.scripts.ack_delete(
            stream=self.keys.groups, group=TRAINER_GROUP, ids=[entry_id],
            counter=StateField.FILTERED, second_counter=StateField.filtered(reason),
        )

    async def release(self) -> int:
        """Give this (gone) consumer's pending groups back to the stream as new entries, then
        delete the consumer; the number moved back. Each move is atomic (ack + delete + re-add),
        and the consumer is deleted only when nothing is pending (XGROUP DELCONSUMER would
        discard pending entries)."""
        moved = 0
        while True:
            pending = await self.pending_ids(count=500)
            if not pending:
                break
            for entry_id in pending:
                fields = await self.fetch(entry_id)
                if not fields:
                    await self.ack_deleted(entry_id)
                    continue
                if await self.scripts.move(
                    source=self.keys.groups, group=TRAINER_GROUP, entry_id=entry_id,
                    target=self.keys.groups, counter=StateField.RELEASED,
                    fields=fields,
                ):
                    moved += 1
        await self.redis.xgroup_delconsumer(self.keys.groups, TRAINER_GROUP, self.consumer)
        return moved

    async def commit(self, ids: Sequence[bytes]) -> int:
        """Acknowledge and delete ``ids``; the number acknowledged now."""
        return await self.scripts.ack_delete(
            stream=self.keys.groups, group=TRAINER_GROUP, ids=ids,
            counter=StateField.COMMITTED, time_field=StateField.LAST_COMMIT_MS, now_ms=now_ms(),
        )


# -- feed ------------------------------------------------------------------------------------


def state_mismatch(keys: Keys, config_id: bytes | str | None, state_id: bytes | str | None) -> str | None:
    """Why the state hash is not this namespace's (its id differs from the config's), or None.
    A namespace made before ids existed (no id in its config) is never flagged."""
    if not config_id or text(config_id) == text(state_id):
        return None
    return (
        f"the state hash {keys.state} does not belong to namespace {keys.namespace!r} any more (its "
        f"{StateField.NAMESPACE_ID} is {text(state_id)[:40]!r}, the config's {text(config_id)[:40]!r}): it was "
        "deleted (DEL) or replaced, or Redis lost its data; its counters and the feeder cursor are gone"
    )


@dataclass(frozen=True, slots=True)
class FeedCursor:
    """Where the feeder stands: the next prompt index, epoch, position and the dataset id."""

    next_index: int
    epoch: int
    position: int
    dataset: str | None


class Feed(_Guarded):
    """The feeder's operations: its cursor in ``state`` and the prompt stream it fills."""

    def __init__(self, redis: Redis, keys: Keys, scripts: Scripts | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.scripts = scripts if scripts is not None else Scripts(redis, keys)

    async def cursor(self) -> FeedCursor:
        """Where the feeder stands; ConfigError when the state hash is not this namespace's any
        more (deleted, Redis lost data) or the cursor is damaged: never feed again from 0."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hget(self.keys.config, StateField.NAMESPACE_ID)
            pipe.hget(self.keys.state, StateField.NAMESPACE_ID)
            config_id, state_id = await pipe.execute()
        if (why := state_mismatch(self.keys, config_id, state_id)) is not None:
            raise ConfigError(
                f"{why}. The feeder cursor went with it: feeding now would feed the dataset again from its "
                f"start (every prompt trained twice). Restore the state hash, or start over with "
                f"`rollstream ns delete --ns {self.keys.namespace}` then `init` and `feed`"
            )
        raw = await self.redis.hmget(
            self.keys.state,
            [StateField.FEED_NEXT_INDEX, StateField.FEED_EPOCH, StateField.FEED_POSITION, StateField.FEED_DATASET],
        )
        names = (StateField.FEED_NEXT_INDEX, StateField.FEED_EPOCH, StateField.FEED_POSITION)
        values = []
        for name, value in zip(names, raw[:3], strict=True):
            number = 0 if value is None else int_or(value, -1)
            if number < 0:  # never guess a cursor: feeding again from 0 would double the dataset
                raise ConfigError(
                    f"the feeder cursor is damaged: {self.keys.state} field {name!r} = {text(value)[:60]!r} is "
                    "not a non-negative integer; fix it (HSET) or re-create the namespace"
                )
            values.append(number)
        return FeedCursor(values[0], values[1], values[2], text(raw[3]) if raw[3] else None)

    async def queued(self) -> int:
        """Entries in the prompt stream (waiting or in flight)."""
        return int(await self.redis.xlen(self.keys.prompts))

    async def add(
        self, *, expected_next: int, next_after: int, epoch: int, position: int, dataset: str,
        entries: Sequence[Mapping[str, Any]],
    ) -> int | None:
        """Add prompt entries and move the cursor atomically, only from ``expected_next``; None
        when the cursor moved meanwhile (a re-sent call that went through, another feeder)."""
        return await self.scripts.feed(
            expected_next=expected_next, next_after=next_after, epoch=epoch, position=position,
            dataset=dataset, entries=entries,
        )


# -- dead letters, namespaces ----------------------------------------------------------------


class DeadLetters(_Guarded):
    """The dead-letter stream of a namespace (no consumer group: operators read and remove)."""

    def __init__(self, redis: Redis, keys: Keys, scripts: Scripts | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.scripts = scripts if scripts is not None else Scripts(redis, keys)

    async def entries(self, *, ids: Sequence[str] | None = None, count: int | None = None) -> list[Entry]:
        """The given entries (missing ones skipped), else the first ``count``, oldest first."""
        if ids:
            rows: list[Any] = []
            for entry_id in ids:
                rows.extend(await self.redis.xrange(self.keys.dead, min=entry_id, max=entry_id))
        else:
            rows = await self.redis.xrange(self.keys.dead, count=count)
        return _flat_entries(rows)

    async def requeue(self, entry_id: str, prompt_fields: Mapping[str, Any]) -> bytes | None:
        """Delete a dead entry and add its prompt to the retry stream, atomically; None when the
        entry was already gone."""
        return await self.scripts.requeue(entry_id, prompt_fields)

    async def drop(self, ids: Sequence[str]) -> int:
        return int(await self.redis.xdel(self.keys.dead, *ids)) if ids else 0


@translate_errors
async def scan_namespace_keys(redis: Redis, match: str) -> list[bytes]:
    """Keys matching ``match``, found with SCAN (never KEYS: it blocks the server)."""
    return [key async for key in redis.scan_iter(match=match, count=1000)]


@translate_errors
async def _per_consumer_keys(redis: Redis, keys: Keys) -> list[bytes]:
    return [key for pattern in keys.per_consumer_patterns for key in await scan_namespace_keys(redis, pattern)]


@translate_errors
async def existing_keys(redis: Redis, keys: Keys) -> list[str]:
    fixed = [key for key in keys.all_keys() if await redis.exists(key)]
    return fixed + sorted(k.decode() for k in await _per_consumer_keys(redis, keys))


@translate_errors
async def delete_namespace(redis: Redis, keys: Keys) -> int:
    """Delete exactly this namespace's keys (journals and name leases included); the number of
    keys that existed."""
    return int(await redis.delete(*keys.all_keys(), *await _per_consumer_keys(redis, keys)))


class JournalHash(_Guarded):
    """The raw hash behind the integrations' checkpoint journal (one per trainer consumer);
    what its fields hold is the journal's business (``rollstream.integrations.journal``)."""

    def __init__(self, redis: Redis, keys: Keys, consumer: str) -> None:
        self.redis = redis
        self.keys = keys
        self.key = keys.journal(consumer)

    async def field_names(self) -> list[str]:
        return [raw.decode() if isinstance(raw, bytes) else str(raw) for raw in await self.redis.hkeys(self.key)]

    async def get(self, *fields: str) -> list[bytes | None]:
        return list(await self.redis.hmget(self.key, list(fields))) if fields else []

    async def put(self, mapping: Mapping[str, bytes | str]) -> None:
        await self.redis.hset(self.key, mapping=dict(mapping))

    async def delete(self, *fields: str) -> int:
        return int(await self.redis.hdel(self.key, *fields)) if fields else 0


class RolloutFlagsHash:
    """The stored copy of a run's rollout flags (``Keys.rollout_flags``): plain string fields, so
    ``HGETALL`` reads like the command line; what they mean is ``rollstream produce``'s business."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.key = keys.rollout_flags

    async def read(self) -> dict[str, str]:
        raw = await self.redis.hgetall(self.key)
        return {
            (k.decode() if isinstance(k, bytes) else str(k)): (v.decode() if isinstance(v, bytes) else str(v))
            for k, v in raw.items()
        }

    async def replace(self, fields: Mapping[str, str]) -> None:
        """The run's flags, whole: fields it no longer sets disappear (one MULTI/EXEC)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.key)
            if fields:
                pipe.hset(self.key, mapping=dict(fields))
            await pipe.execute()


# -- read-only views (operators) ------------------------------------------------------------


class StreamView(_Guarded):
    """Read-only looks at a namespace's streams and hashes (XINFO, XPENDING, XLEN, XRANGE, HGETALL);
    a stream or consumer group that does not exist yet reads as empty."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    async def length(self, stream: str) -> int:
        return int(await self.redis.xlen(stream))

    async def consumers(self, stream: str, group: str) -> list[dict[str, Any]]:
        """XINFO CONSUMERS rows (name, pending, idle, inactive on Redis >= 7.2)."""
        try:
            return list(await self.redis.xinfo_consumers(stream, group))
        except ResponseError as exc:  # no stream or no group yet
            _raise_if_refused(exc)
            return []

    async def group_info(self, stream: str, group: str) -> dict[str, Any] | None:
        """The XINFO GROUPS row of ``group``, or None."""
        try:
            groups = await self.redis.xinfo_groups(stream)
        except ResponseError as exc:
            _raise_if_refused(exc)
            return None
        for row in groups:
            name = row["name"]
            if (name.decode() if isinstance(name, bytes) else name) == group:
                return dict(row)
        return None

    async def pending_summary(self, stream: str, group: str) -> dict[str, Any] | None:
        """XPENDING's summary (``pending``, ``min``, ``max``, ``consumers``), or None without the group."""
        try:
            return dict(await self.redis.xpending(stream, group))
        except ResponseError as exc:
            _raise_if_refused(exc)
            return None

    async def pending_idle_ms(self, stream: str, group: str, count: int) -> list[int]:
        """Milliseconds since delivery of up to ``count`` pending entries, oldest entries first."""
        rows = await self.redis.xpending_range(stream, group, min="-", max="+", count=count)
        return [int(r["time_since_delivered"]) for r in rows]

    async def first_after(self, stream: str, entry_id: str) -> bytes | None:
        """The id of the first entry after ``entry_id``, or None."""
        rows = await self.redis.xrange(stream, min=f"({entry_id}", max="+", count=1)
        return rows[0][0] if rows else None

    async def ledger(self) -> tuple[dict[bytes, bytes], int]:
        """The state hash and the entries in the work streams, read atomically (MULTI), so the
        counters and the stream lengths describe the same instant."""
        try:
            state, lengths = await self._ledger_reads(transaction=True)
        except ResponseError as exc:
            if not is_oom(exc):
                raise
            # At maxmemory Redis refuses every command queued in a MULTI, reads too: read the same
            # things without it (a hand-over between the reads can show as one entry off).
            state, lengths = await self._ledger_reads(transaction=False)
        return dict(state), sum(int(n) for n in lengths)

    async def _ledger_reads(self, *, transaction: bool) -> tuple[Any, list[Any]]:
        async with self.redis.pipeline(transaction=transaction) as pipe:
            pipe.hgetall(self.keys.state)
            for stream in self.keys.work_streams:
                pipe.xlen(stream)
            state, *lengths = await pipe.execute()
        return state, lengths

    async def config_hash(self) -> dict[bytes, bytes]:
        return dict(await self.redis.hgetall(self.keys.config))

    async def state_hash(self) -> dict[bytes, bytes]:
        return dict(await self.redis.hgetall(self.keys.state))


# -- views -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TakeStats:
    """What a ``take()`` reports beside its groups, read in one round trip."""

    groups_length: int
    groups_pending: int
    prompts_pending: int
    """In flight: pending in the prompt and retry streams."""
    admission_blocked_ms: int
    heartbeats: dict[bytes, bytes]


@translate_errors
async def mark_take(redis: Redis, keys: Keys) -> TakeStats:
    """Record the time of a ``take()`` (not when Redis is out of memory) and read its statistics
    (one round trip), then announce it: producers refused for a full backlog retry at once instead
    of polling ADMIT every 0.2 s (docs/scale.md). The PUBLISH is a command of its own: a Redis
    Cluster pipeline cannot route it."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hset(keys.state, StateField.LAST_TAKE_MS, now_ms())
        pipe.xlen(keys.groups)
        pipe.xpending(keys.groups, TRAINER_GROUP)
        pipe.xpending(keys.prompts, PRODUCERS_GROUP)
        pipe.xpending(keys.retry, PRODUCERS_GROUP)
        pipe.hget(keys.state, StateField.ADMISSION_BLOCKED_MS)
        pipe.hgetall(keys.producers)
        replies = await pipe.execute(raise_on_error=False)
    # The time of the take is a statistic: Redis refuses it at maxmemory, and take() goes on.
    if isinstance(replies[0], Exception) and not is_oom(replies[0]):
        raise replies[0]
    for reply in replies[1:]:
        if isinstance(reply, Exception):
            raise reply
    _, groups_len, groups_pending, prompts_pending, retry_pending, blocked_raw, beats = replies
    await redis.publish(keys.control, TAKEN_MESSAGE)
    return TakeStats(
        groups_length=int(groups_len),
        groups_pending=int(groups_pending["pending"]),
        prompts_pending=int(prompts_pending["pending"]) + int(retry_pending["pending"]),
        admission_blocked_ms=int_or(blocked_raw),
        heartbeats=dict(beats),
    )


@translate_errors
async def record_stale_streak(redis: Redis, keys: Keys, values: Mapping[str, int]) -> None:
    """Write a trainer's stale-recycling diagnosis (the ``StateField.STALE`` fields) for ``inspect``."""
    await redis.hset(keys.state, mapping={name: int(values[name]) for name in StateField.STALE})


@translate_errors
async def read_admission_terms(redis: Redis, keys: Keys, config: PipelineConfig) -> AdmissionTerms:
    """The admission rule's terms now (what ADMIT would compute), read in one round trip; a
    stream or group that does not exist counts as empty."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.xpending(keys.prompts, PRODUCERS_GROUP)
        pipe.xpending(keys.retry, PRODUCERS_GROUP)
        pipe.xlen(keys.groups)
        pipe.xpending(keys.groups, TRAINER_GROUP)
        pipe.hmget(
            keys.state,
            [StateField.COMMITTED, StateField.VERSION_START_CONSUMED, StateField.PREV_VERSION_CONSUMED],
        )
        replies = await pipe.execute(raise_on_error=False)

    def pending(reply: Any) -> int:
        return int(reply["pending"]) if isinstance(reply, dict) else 0

    committed, start, prev = (int_or(v) for v in replies[4])
    return admission_capacity(
        prompts_pending=pending(replies[0]),
        retry_pending=pending(replies[1]),
        groups_length=int_or(replies[2]),
        groups_pending=pending(replies[3]),
        committed=committed,
        version_start_consumed=start,
        prev_version_consumed=prev,
        steps_per_version=config.steps_per_version,
        max_staleness=config.max_staleness or 0,
        batch_size=config.batch_size,
    )


@translate_errors
async def stream_lengths(redis: Redis, keys: Keys) -> tuple[int, int]:
    """(entries in the group stream, entries in the prompt and retry streams)."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.xlen(keys.groups)
        pipe.xlen(keys.prompts)
        pipe.xlen(keys.retry)
        groups, prompts, retry = await pipe.execute()
    return int(groups), int(prompts) + int(retry)


@translate_errors
async def waiting_groups(redis: Redis, keys: Keys) -> int:
    """Groups in the group stream not delivered to any trainer consumer yet."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.xlen(keys.groups)
        pipe.xpending(keys.groups, TRAINER_GROUP)
        length, pending = await pipe.execute()
    return max(0, int(length) - int(pending["pending"]))
