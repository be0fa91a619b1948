"""The trainer's side: take exactly ``target`` groups, commit them after the step.

``take(target)`` reads the groups stream through the ``trainer`` consumer group, FIFO by arrival.
Each entry is checked as it arrives and either accepted or handed back in one Lua script:

* undecodable, wrong sample count, over the size limits -> dead-letter stream, with the reason;
* any FAILED or ABORTED sample -> prompt recycled (``attempt + 1``, state reset, or with
  partial rollout the partial samples kept); past ``max_attempts`` -> dead-letter stream;
* staleness (trainer version - oldest sample version) above ``max_staleness`` -> recycled;
* rejected by the dynamic-sampling ``keep`` filter -> dropped and counted (or recycled).

It keeps reading until it holds exactly ``target`` usable groups; the surplus stays in the
stream. Taken groups stay pending until :meth:`GroupConsumer.commit`, so a trainer that restarts
under the same name gets its uncommitted batch back first, with the same :attr:`Batch.id`.
While it waits, ``take()`` raises :class:`ProducerFailed` (a producer recorded a fatal error
and no group arrived since) or :class:`PipelineStalled` (no live producer for too long) instead
of hanging, and logs a warning every 30 s.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

from redis.asyncio import Redis
from rollstream.common.codec import DEFAULT_LIMITS, CodecLimits, decode_group_entry, prompt_fields
from rollstream.common.config import PipelineConfig
from rollstream.common.connection import Outage, connect, is_nogroup, nogroup_error
from rollstream.common.errors import DecodeError, PipelineStalled, ProducerFailed
from rollstream.common.events import FATAL, now_ms, recent_events
from rollstream.common.imports import import_callable
from rollstream.common.keys import ALIVE_STATES, PRODUCERS_GROUP, TRAINER_GROUP, Keys, StateField
from rollstream.common.lua import Scripts
from rollstream.common.models import Group, Prompt, Status
from rollstream.common.namespace import load_config, read_state, state_int

logger = logging.getLogger(__name__)

KeepFilter = Callable[[Group], bool | str]
"""Dynamic-sampling filter: True keeps a group; False or a reason string rejects it."""

_UNSET: Any = object()
_READ_BLOCK_MS = 1000
_ORPHAN_CHECK_INTERVAL = 5.0


@dataclass(slots=True)
class Batch:
    """Exactly ``target`` groups, sorted by index, and what it took to get them."""

    id: str
    """Stable across redelivery: derived from the stream entry ids of the groups."""
    groups: list[Group]
    entry_ids: list[bytes]
    metrics: dict[str, float] = field(default_factory=dict)
    weight_version: int = 0
    redelivered: bool = False
    """True when (some of) these groups were taken before, by an earlier incarnation."""

    def __len__(self) -> int:
        return len(self.groups)


def batch_id(entry_ids: list[bytes]) -> str:
    digest = hashlib.sha1(b"\n".join(sorted(entry_ids)), usedforsecurity=False).hexdigest()
    return f"b-{digest[:16]}"


def load_keep(path: str) -> KeepFilter:
    """Import a ``module:function`` filter; ValueError when it cannot be imported."""
    return import_callable(path, "keep filter")


RECYCLE_COUNTERS = {
    "aborted": StateField.RECYCLED_ABORTED,
    "stale": StateField.RECYCLED_STALE,
    "failed": StateField.RECYCLED_FAILED,
    "filtered": StateField.RECYCLED_FILTERED,
}
"""Why a group is recycled -> its counter in the state hash (also its ``recycled_*`` metric)."""


@dataclass(slots=True)
class _Tally:
    recycled: Counter[str] = field(default_factory=Counter)
    """Recycled groups of this take, by kind (the keys of RECYCLE_COUNTERS)."""
    dead_lettered: int = 0
    filtered: Counter[str] = field(default_factory=Counter)
    staleness_max_seen: int = 0
    """Over every decoded group of this take, recycled ones included (``staleness_max`` covers only the batch)."""


class GroupConsumer:
    """The trainer's handle on a namespace. ``await GroupConsumer.connect(url, namespace, name)``."""

    def __init__(
        self,
        url: str,
        namespace: str,
        name: str,
        config: PipelineConfig,
        redis: Redis,
        blocking: Redis,
        *,
        keep: KeepFilter | None = None,
        on_producer_failure: Literal["raise", "warn"] = "raise",
        stall_timeout: float = 300.0,
        warn_interval: float = 30.0,
        limits: CodecLimits = DEFAULT_LIMITS,
    ) -> None:
        if on_producer_failure not in ("raise", "warn"):
            raise ValueError("on_producer_failure must be 'raise' or 'warn'")
        if stall_timeout <= 0 or warn_interval <= 0:
            raise ValueError("stall_timeout and warn_interval must be positive")
        self.url = url
        self.keys = Keys(namespace)
        self.name = name
        self.config = config
        self.redis = redis
        self._blocking = blocking
        self.scripts = Scripts(redis, self.keys)
        self.keep = keep if keep is not None else (load_keep(config.keep) if config.keep else None)
        self.on_producer_failure = on_producer_failure
        self.stall_timeout = stall_timeout
        self.warn_interval = warn_interval
        self.limits = limits
        self._outage = Outage(logger, f"consumer {name}")
        self._redeliver: deque[tuple[bytes, dict[bytes, bytes]]] | None = None
        self._last_blocked_ms: int | None = None
        self._warned_fatal: str | None = None
        # Groups handed out in batches and not committed yet, and whether a read may have
        # delivered entries whose reply never reached us (cancelled, dropped connection).
        self._handed_out: set[bytes] = set()
        self._read_unsure = False
        self._orphans_checked = 0.0

    @classmethod
    async def connect(
        cls,
        url: str,
        namespace: str,
        name: str = "trainer-0",
        *,
        n_samples: int | None = None,
        batch_size: int | None = None,
        **options: Any,
    ) -> GroupConsumer:
        """Connect and check the namespace config against what this trainer expects."""
        redis = connect(url, name=f"rollstream-consumer-{name}")
        try:
            config = await load_config(redis, Keys(namespace))
            config.check_matches(n_samples_per_prompt=n_samples, batch_size=batch_size)
        except BaseException:
            await redis.aclose()
            raise
        blocking = connect(url, block_ms=_READ_BLOCK_MS, name=f"rollstream-consumer-{name}-read")
        return cls(url, namespace, name, config, redis, blocking, **options)

    async def __aenter__(self) -> GroupConsumer:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.redis.aclose()
        await self._blocking.aclose()

    # -- trainer state ------------------------------------------------------------------

    async def weight_version(self) -> int:
        raw = await self._outage.run(lambda: self.redis.hget(self.keys.state, StateField.WEIGHT_VERSION))
        return int(raw or 0)

    async def set_weight_version(self, version: int) -> None:
        """Record the trainer's new weight version (after pushing weights to the engines)."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"weight version must be a non-negative integer, got {version!r}")

        async def write() -> None:
            # One HSET, then the message (PUBLISH cannot sit in a Redis Cluster transaction).
            await self.redis.hset(self.keys.state, StateField.WEIGHT_VERSION, version)
            await self.redis.publish(self.keys.control, f"version {version}")

        await self._outage.run(write)

    async def pause(self) -> None:
        """Stop every producer from admitting new prompts (effective at once: ADMIT checks it)."""

        async def write() -> None:
            await self.redis.hset(self.keys.state, StateField.PAUSED, 1)
            await self.redis.publish(self.keys.control, "pause")

        await self._outage.run(write)

    async def resume(self, version: int | None = None) -> None:
        """Let producers admit again, optionally recording a new weight version first."""
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise ValueError(f"weight version must be a non-negative integer, got {version!r}")

        async def write() -> None:
            fields: dict[str, int] = {StateField.PAUSED: 0}
            if version is not None:
                fields[StateField.WEIGHT_VERSION] = version
            await self.redis.hset(self.keys.state, mapping=fields)
            await self.redis.publish(self.keys.control, "resume" if version is None else f"resume {version}")

        await self._outage.run(write)

    # -- take / commit ------------------------------------------------------------------

    async def take(
        self,
        target: int,
        *,
        max_staleness: int | None = _UNSET,
        keep: KeepFilter | None = _UNSET,
    ) -> Batch:
        """Exactly ``target`` usable groups, sorted by index (FIFO by arrival until then).

        To bound the wait, wrap it in ``asyncio.timeout``: groups taken so far stay pending
        and are handed out first by the next call.
        """
        if isinstance(target, bool) or not isinstance(target, int) or target < 1:
            raise ValueError(f"target must be a positive integer, got {target!r}")
        staleness_limit = self.config.max_staleness if max_staleness is _UNSET else max_staleness
        keep_filter = self.keep if keep is _UNSET else keep
        started = time.monotonic()
        version = await self.weight_version()
        tally = _Tally()
        taken: list[tuple[bytes, Group]] = []
        redelivered = False
        if self._redeliver is None:
            self._redeliver = deque(await self._own_pending())
            if self._redeliver:
                logger.info(
                    "consumer %s (ns %s): %d groups taken but not committed earlier are delivered first",
                    self.name, self.keys.namespace, len(self._redeliver),
                )
        last_warning = started
        no_producer_since: float | None = None
        try:
            while len(taken) < target:
                if self._read_unsure and not self._redeliver:
                    await self._adopt_orphans(taken)
                if self._redeliver:
                    entries = [self._redeliver.popleft() for _ in range(min(target - len(taken), len(self._redeliver)))]
                    redelivered = True
                else:
                    entries = await self._read(target - len(taken))
                for entry_id, fields in entries:
                    group = await self._check(entry_id, fields, version, staleness_limit, keep_filter, tally)
                    if group is not None:
                        taken.append((entry_id, group))
                if entries or len(taken) >= target:
                    continue
                now = time.monotonic()
                if now - self._orphans_checked >= _ORPHAN_CHECK_INTERVAL:
                    # redis-py may re-send a read after a dropped connection without telling us.
                    await self._adopt_orphans(taken)
                alive, health = await self._health()
                no_producer_since = None if alive else (no_producer_since or now)
                if no_producer_since is not None and now - no_producer_since > self.stall_timeout:
                    raise PipelineStalled(
                        f"no producer of namespace {self.keys.namespace!r} has sent a heartbeat for "
                        f"{now - no_producer_since:.0f} s while take({target}) waited ({health})"
                    )
                if now - last_warning >= self.warn_interval:
                    last_warning = now
                    logger.warning(
                        "consumer %s (ns %s): take(%d) waiting for %.0f s with %d groups; %s",
                        self.name, self.keys.namespace, target, now - started, len(taken), health,
                    )
        except BaseException:
            # Whatever was taken stays pending under this consumer: hand it out again next time.
            self._redeliver.extendleft(reversed([(eid, {}) for eid, _ in taken]))
            raise
        return await self._finish(taken, version, started, tally, redelivered)

    async def commit(self, batch: Batch) -> int:
        """Acknowledge and delete the batch's groups; the number acknowledged now."""
        acked = await self._outage.run(
            lambda: self.scripts.ack_delete(
                stream=self.keys.groups,
                group=TRAINER_GROUP,
                ids=batch.entry_ids,
                counter=StateField.COMMITTED,
                time_field=StateField.LAST_COMMIT_MS,
                now_ms=now_ms(),
            )
        )
        self._handed_out.difference_update(batch.entry_ids)
        if acked != len(batch.entry_ids):
            logger.warning(
                "consumer %s: commit of batch %s acknowledged %d of %d groups (already committed?)",
                self.name, batch.id, acked, len(batch.entry_ids),
            )
        return acked

    # -- internals ----------------------------------------------------------------------

    async def _own_pending(self) -> list[tuple[bytes, dict[bytes, bytes]]]:
        out: list[tuple[bytes, dict[bytes, bytes]]] = []
        cursor = "0"
        while True:
            reply = await self._outage.run(
                lambda c=cursor: self.redis.xreadgroup(
                    TRAINER_GROUP, self.name, {self.keys.groups: c}, count=1000
                )
            )
            entries = reply[0][1] if reply else []
            if not entries:
                return out
            for entry_id, fields in entries:
                out.append((entry_id, fields or {}))
            cursor = entries[-1][0].decode()

    async def _adopt_orphans(self, taken: list[tuple[bytes, Group]]) -> None:
        """Queue for delivery the groups pending under this name that nobody here has seen.

        An XREADGROUP whose reply is lost (take() cancelled mid-BLOCK, a dropped connection)
        still delivered its entries: they sit in our pending list and no later ``>`` read
        returns them, so without this they would wait for a trainer restart.
        """
        if self._redeliver is None:
            self._redeliver = deque()
        self._read_unsure = False
        self._orphans_checked = time.monotonic()
        known = self._handed_out | {eid for eid, _ in taken} | {eid for eid, _ in self._redeliver}
        pending = await self._outage.run(
            lambda: self.redis.xpending_range(
                self.keys.groups, TRAINER_GROUP, min="-", max="+", count=10_000, consumername=self.name
            )
        )
        orphans = [p["message_id"] for p in pending if p["message_id"] not in known]
        if orphans:
            logger.warning(
                "consumer %s (ns %s): %d groups delivered to a lost read are handed out now",
                self.name, self.keys.namespace, len(orphans),
            )
            self._redeliver.extend((eid, {}) for eid in orphans)

    async def _read(self, count: int) -> list[tuple[bytes, dict[bytes, bytes]]]:
        outages = self._outage.count
        self._read_unsure = True
        try:
            reply = await self._outage.run(
                lambda: self._blocking.xreadgroup(
                    TRAINER_GROUP, self.name, {self.keys.groups: ">"}, count=count, block=_READ_BLOCK_MS
                )
            )
        except Exception as exc:
            if is_nogroup(exc):
                raise nogroup_error(self.keys.namespace, exc) from exc
            raise
        self._read_unsure = self._outage.count != outages
        return [(eid, fields or {}) for eid, fields in (reply[0][1] if reply else [])]

    async def _check(
        self,
        entry_id: bytes,
        fields: dict[bytes, bytes],
        version: int,
        staleness_limit: int | None,
        keep_filter: KeepFilter | None,
        tally: _Tally,
    ) -> Group | None:
        """The group if usable; otherwise hand it back (dead-letter, recycle, drop) and None."""
        if not fields:
            fields = await self._fetch(entry_id)
            if not fields:  # deleted meanwhile: nothing left to hand back
                await self.redis.xack(self.keys.groups, TRAINER_GROUP, entry_id)
                return None
        try:
            group = decode_group_entry(fields, self.limits)
        except DecodeError as exc:
            await self._dead_letter(entry_id, fields, f"{exc.reason}: {exc.detail}", tally)
            return None
        n = self.config.n_samples_per_prompt
        if len(group.samples) != n:
            await self._dead_letter(
                entry_id, fields, f"wrong_group_size: {len(group.samples)} samples, expected {n}", tally
            )
            return None
        staleness = group.staleness(version)
        tally.staleness_max_seen = max(tally.staleness_max_seen, staleness)
        status = group.status
        if status == Status.FAILED:
            errors = {str(s.metadata.get("error", "failed")) for s in group.samples if s.status == Status.FAILED}
            await self._recycle(entry_id, group, "failed", "; ".join(sorted(errors))[:300], tally)
            return None
        if status == Status.ABORTED:
            await self._recycle(entry_id, group, "aborted", "", tally)
            return None
        if staleness_limit is not None and staleness > staleness_limit:
            await self._recycle(entry_id, group, "stale", f"staleness {staleness} > {staleness_limit}", tally)
            return None
        if keep_filter is not None:
            verdict = keep_filter(group)
            if verdict is not True:
                reason = verdict if isinstance(verdict, str) and verdict else "rejected"
                await self._filter(entry_id, group, reason, tally)
                return None
        return group

    async def _fetch(self, entry_id: bytes) -> dict[bytes, bytes]:
        rows = await self._outage.run(lambda: self.redis.xrange(self.keys.groups, entry_id, entry_id))
        return dict(rows[0][1]) if rows else {}

    async def _dead_letter(
        self, entry_id: bytes, fields: Mapping[Any, Any], reason: str, tally: _Tally, *, log: bool = True
    ) -> None:
        if log:
            logger.warning("consumer %s: group entry %s dead-lettered: %s", self.name, entry_id.decode(), reason)
        moved = await self._outage.run(
            lambda: self.scripts.dead_letter(
                source=self.keys.groups, group=TRAINER_GROUP, entry_id=entry_id,
                reason=reason, fields=fields, now_ms=now_ms(),
            )
        )
        if moved:
            tally.dead_lettered += 1

    def _next_prompt(self, group: Group, reason: str, keep_partial: bool) -> Prompt:
        first = group.samples[0] if group.samples else None
        input_ids = None
        if first is not None and first.prompt_length > 0 and first.metadata.get("prompt_ids") != "unknown":
            input_ids = first.tokens[: first.prompt_length]
        return Prompt(
            index=group.index,
            prompt=group.prompt,
            label=group.label,
            epoch=group.epoch,
            attempt=group.attempt + 1,
            metadata=group.metadata,
            input_ids=input_ids,
            partial=group.samples if keep_partial else None,
            history=[*group.history, reason][-20:],
        )

    async def _recycle(self, entry_id: bytes, group: Group, kind: str, detail: str, tally: _Tally) -> None:
        """Put the group's prompt back with ``attempt + 1`` (past max_attempts: dead-letter it)."""
        reason = f"{kind}: {detail}" if detail else kind
        keep_partial = kind == "aborted" and self.config.partial_rollout
        prompt = self._next_prompt(group, reason, keep_partial)
        fields = prompt_fields(prompt)
        if prompt.attempt > self.config.max_attempts:
            dead_reason = (
                f"max_attempts: recycled {prompt.attempt} times (> {self.config.max_attempts}); last: {reason}"
            )
            logger.warning(
                "consumer %s: prompt %d dead-lettered after %d attempts: %s",
                self.name, group.index, prompt.attempt, "; ".join(prompt.history),
            )
            await self._dead_letter(entry_id, fields, dead_reason, tally, log=False)
            return
        moved = await self._outage.run(lambda: self.scripts.recycle(entry_id, RECYCLE_COUNTERS[kind], fields))
        if moved:
            tally.recycled[kind] += 1
            logger.debug("consumer %s: prompt %d recycled (%s)", self.name, group.index, reason)

    async def _filter(self, entry_id: bytes, group: Group, reason: str, tally: _Tally) -> None:
        tally.filtered[reason] += 1
        if self.config.recycle_filtered:
            await self._recycle(entry_id, group, "filtered", reason, tally)
            return
        await self._outage.run(
            lambda: self.scripts.ack_delete(
                stream=self.keys.groups, group=TRAINER_GROUP, ids=[entry_id],
                counter=StateField.FILTERED, second_counter=StateField.filtered(reason),
            )
        )

    async def _live_producers(self) -> tuple[int, int]:
        """(producers alive, in-flight samples of the alive ones)."""
        return self._count_live(await self._outage.run(lambda: self.redis.hgetall(self.keys.producers)))

    def _count_live(self, raw: Mapping[bytes, bytes]) -> tuple[int, int]:
        """(alive, in-flight samples) from the producers hash: a recent heartbeat of a live state."""
        alive = in_flight = 0
        cutoff = now_ms() - self.config.heartbeat_timeout * 1000
        for value in raw.values():
            try:
                beat = json.loads(value)
            except ValueError:
                continue
            if beat.get("last_seen_ms", 0) >= cutoff and beat.get("state") in ALIVE_STATES:
                alive += 1
                in_flight += int(beat.get("in_flight_samples", 0))
        return alive, in_flight

    async def _health(self) -> tuple[int, str]:
        """Raise ProducerFailed if due; (live producers, a one-line summary for warnings)."""
        alive, in_flight = await self._live_producers()
        state = await self._outage.run(lambda: read_state(self.redis, self.keys))
        backlog = await self._outage.run(lambda: self.redis.xlen(self.keys.groups))
        queued = await self._outage.run(lambda: self.redis.xlen(self.keys.prompts))
        fatal = await self._outage.run(lambda: recent_events(self.redis, self.keys, count=1, kind=FATAL))
        last_error = ""
        if fatal:
            event = fatal[0]
            last_error = f"{event.source}: {event.message}"
            if event.ts_ms > state_int(state, StateField.LAST_PUBLISH_MS):
                if self.on_producer_failure == "raise":
                    raise ProducerFailed(event.source, event.message, event.traceback)
                if self._warned_fatal != event.id:
                    self._warned_fatal = event.id
                    logger.warning("producer %s failed: %s\n%s", event.source, event.message, event.traceback)
        summary = (
            f"backlog {backlog}, prompts queued {queued}, in flight {in_flight} samples, "
            f"live producers {alive}, paused {state.get(StateField.PAUSED, '0') == '1'}"
            + (f", last error: {last_error}" if last_error else "")
        )
        return alive, summary

    async def _finish(
        self, taken: list[tuple[bytes, Group]], version: int, started: float, tally: _Tally, redelivered: bool
    ) -> Batch:
        wait = time.monotonic() - started
        taken.sort(key=lambda item: item[1].index)
        entry_ids = [eid for eid, _ in taken]
        self._handed_out.update(entry_ids)
        groups = [g for _, g in taken]
        staleness = [g.staleness(version) for g in groups]
        rewards = [r for g in groups if not math.isnan(r := g.reward_mean)]
        async with self.redis.pipeline(transaction=False) as pipe:  # one round trip for the metrics
            pipe.hset(self.keys.state, StateField.LAST_TAKE_MS, now_ms())
            pipe.xlen(self.keys.groups)
            pipe.xpending(self.keys.groups, TRAINER_GROUP)
            pipe.xpending(self.keys.prompts, PRODUCERS_GROUP)
            pipe.hget(self.keys.state, StateField.ADMISSION_BLOCKED_MS)
            pipe.hgetall(self.keys.producers)
            _, groups_len, groups_pending, prompts_pending, blocked_raw, beats = await pipe.execute()
        alive, in_flight = self._count_live(beats)
        blocked_ms = int(blocked_raw or 0)
        blocked_delta = 0 if self._last_blocked_ms is None else max(0, blocked_ms - self._last_blocked_ms)
        self._last_blocked_ms = blocked_ms
        metrics: dict[str, float] = {
            "groups": float(len(groups)),
            "weight_version": float(version),
            "wait_time_s": wait,
            "backlog": float(groups_len - groups_pending["pending"]),
            "taken_uncommitted": float(groups_pending["pending"]),
            "in_flight_prompts": float(prompts_pending["pending"]),
            "in_flight_samples": float(in_flight),
            "producers_alive": float(alive),
            **{f"recycled_{kind}": float(tally.recycled[kind]) for kind in RECYCLE_COUNTERS},
            "dead_lettered": float(tally.dead_lettered),
            "filtered": float(sum(tally.filtered.values())),
            "staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
            "staleness_max": float(max(staleness, default=0)),
            "staleness_max_seen": float(tally.staleness_max_seen),
            "reward_mean": sum(rewards) / len(rewards) if rewards else math.nan,
            "admission_blocked_s": blocked_delta / 1000,
        }
        for reason, count in tally.filtered.items():
            metrics[f"filtered/{reason}"] = float(count)
        return Batch(
            id=batch_id(entry_ids),
            groups=groups,
            entry_ids=entry_ids,
            metrics=metrics,
            weight_version=version,
            redelivered=redelivered,
        )


async def release_consumer(redis: Redis, keys: Keys, consumer: str) -> int:
    """Give a gone trainer consumer's pending groups back to the stream, then delete it.

    Each pending group is re-added as a new entry and its old entry acknowledged and deleted,
    atomically; only then is the consumer deleted (XGROUP DELCONSUMER with entries pending
    would discard them). Returns the number of groups moved back.
    """
    scripts = Scripts(redis, keys)
    moved = 0
    while True:
        pending = await redis.xpending_range(
            keys.groups, TRAINER_GROUP, min="-", max="+", count=500, consumername=consumer
        )
        if not pending:
            break
        for item in pending:
            entry_id = item["message_id"]
            rows = await redis.xrange(keys.groups, entry_id, entry_id)
            if not rows:
                await redis.xack(keys.groups, TRAINER_GROUP, entry_id)
                continue
            fields = {k.decode(): v for k, v in rows[0][1].items()}
            if await scripts.move(
                source=keys.groups, group=TRAINER_GROUP, entry_id=entry_id,
                target=keys.groups, counter=StateField.RELEASED, fields=fields,
            ):
                moved += 1
    await redis.xgroup_delconsumer(keys.groups, TRAINER_GROUP, consumer)
    return moved


class SyncGroupConsumer:
    """The same API for trainers that are not asyncio: runs its own event loop in this thread."""

    def __init__(self, url: str, namespace: str, name: str = "trainer-0", **options: Any) -> None:
        self._runner = asyncio.Runner()
        self._consumer = self._runner.run(GroupConsumer.connect(url, namespace, name, **options))

    @property
    def config(self) -> PipelineConfig:
        return self._consumer.config

    def take(self, target: int, **options: Any) -> Batch:
        return self._runner.run(self._consumer.take(target, **options))

    def commit(self, batch: Batch) -> int:
        return self._runner.run(self._consumer.commit(batch))

    def set_weight_version(self, version: int) -> None:
        self._runner.run(self._consumer.set_weight_version(version))

    def weight_version(self) -> int:
        return self._runner.run(self._consumer.weight_version())

    def pause(self) -> None:
        self._runner.run(self._consumer.pause())

    def resume(self, version: int | None = None) -> None:
        self._runner.run(self._consumer.resume(version))

    def close(self) -> None:
        try:
            self._runner.run(self._consumer.aclose())
        finally:
            self._runner.close()

    def __enter__(self) -> SyncGroupConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
