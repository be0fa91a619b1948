"""The trainer's side: take exactly ``target`` groups, commit them after the step.

``take(target)`` reads the groups stream through the ``trainer`` consumer group, FIFO by arrival.
Each entry is checked as it arrives and either accepted or handed back in one Lua script:

* undecodable, wrong sample count, over the size limits -> dead-letter stream, with the reason;
* any FAILED or ABORTED sample -> prompt recycled (``attempt + 1``, state reset, or with
  partial rollout the partial samples kept); past ``max_attempts`` -> dead-letter stream;
* staleness (trainer version - oldest sample version) above ``max_staleness`` -> recycled with
  its attempt unchanged (staleness is not the prompt's fault); a streak of nothing but stale
  groups is reported at once (log, state hash for ``inspect``) and, past ``stall_timeout``,
  raises :class:`AllGroupsStale`;
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
import logging
import math
import os
import secrets
import socket
import time
from array import array
from collections import Counter, deque
from collections.abc import Coroutine, Generator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from redis.asyncio import Redis
from rollstream.common.admission import WRITE_ROOM, memory_deadlock, wait_cause
from rollstream.common.cancellation import raise_if_cancelled
from rollstream.common.codec import DEFAULT_LIMITS, CodecLimits, decode_group_entry, prompt_fields
from rollstream.common.config import PipelineConfig
from rollstream.common.connection import TRANSIENT_ERRORS, Outage, connect
from rollstream.common.errors import (
    AllGroupsStale,
    ConfigError,
    ConsumerNameInUse,
    DecodeError,
    PipelineStalled,
    ProducerFailed,
)
from rollstream.common.events import FATAL, now_ms, recent_events, unrecovered
from rollstream.common.imports import require_extra
from rollstream.common.keys import Keys, StateField
from rollstream.common.loop_thread import LoopThread
from rollstream.common.models import FloatArray, Group, IntArray, Status, retry_prompt
from rollstream.common.namespace import load_config, read_state, state_int
from rollstream.common.protocol import (
    Control,
    Entry,
    GroupQueue,
    Heartbeat,
    NameLease,
    admission_refusals,
    live_producers,
    mark_take,
    read_admission_terms,
    read_heartbeats,
    record_stale_streak,
    server_memory,
    stream_lengths,
    waiting_groups,
)

from .filters import KeepFilter, rejection_reason

if TYPE_CHECKING:
    import numpy

logger = logging.getLogger(__name__)


_UNSET: Any = object()
_READ_BLOCK_MS = 1000
_ORPHAN_CHECK_INTERVAL = 5.0
_HEALTH_CHECK_INTERVAL = 1.0
_MEMORY_RETRY_SECONDS = 60.0
"""After INFO memory failed (a trainer ACL role without INFO, Redis unreachable), this long before
the deadlock check at maxmemory asks again: no denied command at every health check."""


NAME_LEASE_SECONDS = 10.0
"""A trainer's hold on its consumer name lasts this long unless renewed (every quarter of it)."""
NAME_WAIT_SECONDS = NAME_LEASE_SECONDS + 2.0
"""How long ``connect`` waits for a consumer name held by another trainer (it may have crashed)."""


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

    def tokens_numpy(self) -> list[numpy.ndarray]:
        """Every sample's ``tokens`` (prompt + response ids) as an ``int32`` numpy array, groups
        in batch order, samples in group order. Zero-copy: each array is a view on the sample's
        packed array, which for groups from ``take()`` is the entry's bytes as Redis sent them; it
        keeps that buffer alive, so it stays valid after :meth:`commit <GroupConsumer.commit>`,
        after the consumer is closed and after the batch is dropped. Such arrays are read-only
        (``.copy()`` one to modify it). Needs numpy (extra ``numpy``)."""
        return [_numpy_view(s.tokens) for g in self.groups for s in g.samples]

    def log_probs_numpy(self) -> list[numpy.ndarray | None]:
        """Every sample's ``rollout_log_probs`` as a ``float32`` view (None where absent); as
        :meth:`tokens_numpy`."""
        return [_numpy_view(s.rollout_log_probs) if s.rollout_log_probs is not None else None
                for g in self.groups for s in g.samples]

    def loss_masks_numpy(self) -> list[numpy.ndarray | None]:
        """Every sample's ``loss_mask`` as a ``uint8`` view (None where absent); as
        :meth:`tokens_numpy`."""
        return [_numpy_view(s.loss_mask) if s.loss_mask is not None else None for g in self.groups for s in g.samples]

    def routed_experts_numpy(self) -> list[numpy.ndarray | None]:
        """Every sample's routing replay (R3) as a ``(len(tokens) - 1, layers, topk)`` view in its
        wire dtype (``uint8`` for up to 256 experts, ``uint16``, ``int32``; ``.astype`` for
        another), None where absent; zero-copy as :meth:`tokens_numpy`."""
        return self._packed_numpy("routed_experts")

    def indexer_topk_numpy(self) -> list[numpy.ndarray | None]:
        """Every sample's indexer top-k replay (DSA models), as :meth:`routed_experts_numpy`."""
        return self._packed_numpy("indexer_topk")

    def top_p_numpy(self) -> list[tuple[numpy.ndarray, numpy.ndarray] | None]:
        """Every sample's nucleus replay as ``(token_ids, offsets)`` views (response token ``i``
        kept ``token_ids[offsets[i]:offsets[i + 1]]``), None where absent."""
        return [
            (s.top_p_token_ids.numpy(), s.top_p_token_offsets.numpy())
            if s.top_p_token_ids is not None and s.top_p_token_offsets is not None else None
            for g in self.groups for s in g.samples
        ]

    def teacher_log_probs_numpy(self) -> list[numpy.ndarray | None]:
        """Every sample's teacher log-probs (``response_length`` float32s), as :meth:`tokens_numpy`."""
        return [_numpy_view(s.teacher_log_probs) if s.teacher_log_probs is not None else None
                for g in self.groups for s in g.samples]

    def opd_reverse_kl_numpy(self) -> list[numpy.ndarray | None]:
        """Every sample's OPD reverse-KL estimate (float32s), as :meth:`tokens_numpy`."""
        return [_numpy_view(s.opd_reverse_kl) if s.opd_reverse_kl is not None else None
                for g in self.groups for s in g.samples]

    def _packed_numpy(self, name: str) -> list[numpy.ndarray | None]:
        out: list[numpy.ndarray | None] = []
        for g in self.groups:
            for s in g.samples:
                packed = getattr(s, name)
                out.append(None if packed is None else packed.numpy())
        return out


_NUMPY_DTYPES = {"i": "int32", "f": "float32", "B": "uint8", "H": "uint16"}


def _numpy_view(values: IntArray | FloatArray) -> numpy.ndarray:
    """A numpy array sharing ``values``' memory (the codec's arrays are native-endian)."""
    np = require_extra("numpy", "numpy", "numpy views of a batch")
    code = values.typecode if isinstance(values, array) else values.format
    return np.frombuffer(values, dtype=_NUMPY_DTYPES[code])


def batch_id(entry_ids: list[bytes]) -> str:
    digest = hashlib.sha1(b"\n".join(sorted(entry_ids)), usedforsecurity=False).hexdigest()
    return f"b-{digest[:16]}"


RECYCLE_COUNTERS = {
    "aborted": StateField.RECYCLED_ABORTED,
    "stale": StateField.RECYCLED_STALE,
    "failed": StateField.RECYCLED_FAILED,
    "filtered": StateField.RECYCLED_FILTERED,
}
"""Why a group is recycled -> its counter in the state hash (also its ``recycled_*`` metric)."""


STALE_STREAK_MIN = 4
"""Groups recycled as stale in a row (and at least a batch of them) before ``take()`` reports
that everything goes stale."""
MAX_STALE_RECYCLES = 20
"""A prompt recycled as stale this many times in a row while other groups were fresh (its own
generation outlasts the staleness window) is dead-lettered; at most ``MAX_HISTORY``."""
ALL_STALE_MARK = " (all groups stale)"
"""Appended to a stale recycle's reason in the prompt's history when every group was going stale
(the pipeline's fault): those never count towards :data:`MAX_STALE_RECYCLES`."""


def _stale_alone(reason: str) -> bool:
    return reason.startswith("stale:") and not reason.endswith(ALL_STALE_MARK)


@dataclass(slots=True)
class _StaleStreak:
    """Groups recycled as stale in a row with no usable group in between (across takes)."""

    since: float
    since_ms: int
    oldest: int
    newest: int
    trainer: int
    limit: int
    count: int = 0
    reported: float = -math.inf

    def add(self, oldest: int, newest: int, trainer: int, limit: int) -> None:
        self.count += 1
        self.oldest, self.newest = min(self.oldest, oldest), max(self.newest, newest)
        self.trainer, self.limit = trainer, limit

    def describe(self) -> str:
        versions = str(self.oldest) if self.oldest == self.newest else f"{self.oldest}..{self.newest}"
        return (
            f"groups are being recycled as stale: {self.count} in a row over {time.monotonic() - self.since:.0f} s, "
            f"none usable; the engines generated them at weight version {versions} while the trainer is at "
            f"{self.trainer} (max_staleness {self.limit}): do the new weights reach the engines?"
        )


@dataclass(slots=True)
class _Tally:
    recycled: Counter[str] = field(default_factory=Counter)
    """Recycled groups of this take, by kind (the keys of RECYCLE_COUNTERS)."""
    dead_lettered: int = 0
    filtered: Counter[str] = field(default_factory=Counter)
    staleness_max_seen: int = 0
    """Over every decoded group of this take, recycled ones included (``staleness_max`` covers only the batch)."""


class GroupConsumer:
    """The trainer's handle on a namespace: ``async with GroupConsumer.connect(url, namespace, name) as c``."""

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
            raise ConfigError("on_producer_failure must be 'raise' or 'warn'")
        if stall_timeout <= 0 or warn_interval <= 0:
            raise ConfigError("stall_timeout and warn_interval must be positive")
        self.url = url
        self.keys = Keys(namespace)
        self.name = name
        self.config = config
        self.redis = redis
        self._blocking = blocking
        self.queue = GroupQueue(redis, self.keys, name)
        self.control = Control(redis, self.keys)
        self.keep = keep
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
        # The stall clock lives here, not in one take(): short calls (asyncio.timeout) add up.
        self._no_producer_since: float | None = None
        self._health_checked = 0.0
        # Whether the last health check found Redis at maxmemory with nothing able to move, and
        # until when not to ask again after INFO failed (an ACL trainer role without INFO).
        self._memory_deadlock = False
        self._memory_unread_until = 0.0
        self._lease: NameLease | None = None
        self._lease_task: asyncio.Task[None] | None = None
        self._lease_lost: ConsumerNameInUse | None = None
        # Entries put back after a cancelled take() whose hand-back script may have run meanwhile:
        # finding them deleted is expected, not a loss.
        self._handed_back_maybe: set[bytes] = set()
        # The groups recycled as stale since the last usable one (None: the last group was usable).
        self._stale: _StaleStreak | None = None
        self._fresh_seen = False

    @classmethod
    def connect(
        cls,
        url: str,
        namespace: str,
        name: str = "trainer-0",
        *,
        n_samples: int | None = None,
        batch_size: int | None = None,
        keep: KeepFilter | None = None,
        on_producer_failure: Literal["raise", "warn"] = "raise",
        stall_timeout: float = 300.0,
        warn_interval: float = 30.0,
        limits: CodecLimits = DEFAULT_LIMITS,
        name_wait: float = NAME_WAIT_SECONDS,
    ) -> Connecting:
        """Connect and check the namespace config against what this trainer expects.

        Use ``async with GroupConsumer.connect(...) as consumer:`` (closed on exit) or
        ``consumer = await GroupConsumer.connect(...)`` (close it with ``aclose()``).
        ``n_samples`` / ``batch_size`` raise ``ConfigError`` when the namespace differs;
        ``keep`` is the dynamic-sampling filter (named only here, by the trainer's own code: nothing is
        imported from Redis); ``on_producer_failure="warn"`` logs
        instead of raising ``ProducerFailed``; ``stall_timeout`` is how long without a live
        producer before ``take()`` raises ``PipelineStalled``. The consumer ``name`` is held by
        one live trainer at a time: while another holds it, ``connect`` waits up to ``name_wait``
        seconds (a crashed holder's hold expires within ``NAME_LEASE_SECONDS``), then raises
        ``ConsumerNameInUse``.
        """
        return Connecting(
            cls._open(
                url, namespace, name, n_samples=n_samples, batch_size=batch_size, keep=keep,
                on_producer_failure=on_producer_failure, stall_timeout=stall_timeout,
                warn_interval=warn_interval, limits=limits, name_wait=name_wait,
            )
        )

    @classmethod
    async def _open(
        cls,
        url: str,
        namespace: str,
        name: str,
        *,
        n_samples: int | None,
        batch_size: int | None,
        keep: KeepFilter | None,
        on_producer_failure: Literal["raise", "warn"],
        stall_timeout: float,
        warn_interval: float,
        limits: CodecLimits,
        name_wait: float,
    ) -> GroupConsumer:
        if not name_wait >= 0:
            raise ConfigError(f"name_wait must be >= 0 seconds, got {name_wait!r}")
        keys = Keys(namespace)
        redis = connect(url, name=f"rollstream-consumer-{name}")
        lease = NameLease(redis, keys, name, f"{socket.gethostname()} pid {os.getpid()} {secrets.token_hex(4)}")
        try:
            config = await load_config(redis, keys)
            config.check_matches(n_samples_per_prompt=n_samples, batch_size=batch_size)
            await _hold_name(lease, keys, name, name_wait)
        except BaseException:
            await redis.aclose()
            raise
        blocking = connect(url, block_ms=_READ_BLOCK_MS, name=f"rollstream-consumer-{name}-read")
        try:
            consumer = cls(
                url, namespace, name, config, redis, blocking, keep=keep, on_producer_failure=on_producer_failure,
                stall_timeout=stall_timeout, warn_interval=warn_interval, limits=limits,
            )
        except BaseException:
            await _release_name(lease)
            await redis.aclose()
            await blocking.aclose()
            raise
        consumer._lease = lease
        consumer._lease_task = asyncio.create_task(consumer._keep_name(lease), name=f"rollstream-lease-{name}")
        return consumer

    async def __aenter__(self) -> GroupConsumer:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Give up the consumer name and close the connections."""
        try:
            if self._lease_task is not None:
                self._lease_task.cancel()
                await asyncio.wait({self._lease_task}, timeout=5)
            if self._lease is not None:
                await _release_name(self._lease)
        finally:
            await self.redis.aclose()
            await self._blocking.aclose()

    async def _keep_name(self, lease: NameLease) -> None:
        """Renew the hold on the consumer name while connected (a task; cancelled by aclose)."""
        while True:
            await asyncio.sleep(NAME_LEASE_SECONDS / 4)
            try:
                if await lease.hold(int(NAME_LEASE_SECONDS * 1000)):
                    continue
                holder = await lease.holder()
            except TRANSIENT_ERRORS as exc:
                logger.debug("consumer %s: renewing the name lease failed (%s); retrying", self.name, exc)
                continue
            self._lease_lost = ConsumerNameInUse(
                self.keys.namespace, self.name, holder,
                f"this trainer's hold lapsed (Redis unreachable for over {NAME_LEASE_SECONDS:.0f} s?) and another "
                "trainer took the name; this one stops taking and committing",
            )
            logger.error("%s", self._lease_lost)
            return

    def _check_name(self) -> None:
        if self._lease_lost is not None:
            raise self._lease_lost

    # -- trainer state ------------------------------------------------------------------

    async def weight_version(self) -> int:
        return await self._outage.run(self.control.weight_version)

    async def set_weight_version(self, version: int) -> None:
        """Record the trainer's new weight version (after pushing weights to the engines)."""
        await self._outage.run(lambda: self.control.set_weight_version(version))

    async def pause(self) -> None:
        """Stop every producer from admitting new prompts (effective at once: ADMIT checks it)."""
        await self._outage.run(self.control.pause)

    async def resume(self, version: int | None = None) -> None:
        """Let producers admit again, optionally recording a new weight version first."""
        await self._outage.run(lambda: self.control.resume(version))

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
        self._check_name()
        staleness_limit = self.config.max_staleness if max_staleness is _UNSET else max_staleness
        keep_filter = self.keep if keep is _UNSET else keep
        started = time.monotonic()
        tally = _Tally()
        taken: list[tuple[bytes, Group]] = []
        entries: deque[Entry] = deque()
        redelivered = False
        try:
            if time.monotonic() - self._health_checked >= _HEALTH_CHECK_INTERVAL and await self._stall_due():
                # checked here too, not only after an empty read: calls shorter than one blocking
                # read (asyncio.timeout) must still end in PipelineStalled
                await self._check_health(target, started, len(taken))
            version = await self.weight_version()
            if self._redeliver is None:
                self._redeliver = deque(await self._own_pending())
                if self._redeliver:
                    logger.info(
                        "consumer %s (ns %s): %d groups taken but not committed earlier are delivered first",
                        self.name, self.keys.namespace, len(self._redeliver),
                    )
            last_warning = started
            while len(taken) < target:
                raise_if_cancelled()
                if self._read_unsure and not self._redeliver:
                    await self._adopt_orphans(taken)
                if self._redeliver:
                    for _ in range(min(target - len(taken), len(self._redeliver))):
                        entries.append(self._redeliver.popleft())
                    redelivered = True
                else:
                    entries.extend(await self._read(target - len(taken)))
                got = bool(entries)
                while entries:
                    entry_id, fields = entries[0]
                    group = await self._check(entry_id, fields, version, staleness_limit, keep_filter, tally)
                    # Decoded (or handed back): its other reply bytes go now, not with the whole
                    # read (the kept group's arrays are views on its data field).
                    fields.clear()
                    entries.popleft()
                    if group is not None:
                        taken.append((entry_id, group))
                if self._stale is not None:
                    await self._stale_check(target, started, len(taken))
                if got or len(taken) >= target:
                    continue
                now = time.monotonic()
                if now - self._orphans_checked >= _ORPHAN_CHECK_INTERVAL:
                    # redis-py may re-send a read after a dropped connection without telling us.
                    await self._adopt_orphans(taken)
                health = await self._check_health(target, started, len(taken))
                if now - last_warning >= self.warn_interval:
                    last_warning = now
                    # a deadlock at maxmemory ends only when someone raises maxmemory: an error
                    (logger.error if self._memory_deadlock else logger.warning)(
                        "consumer %s (ns %s): take(%d) waiting for %.0f s with %d groups; %s",
                        self.name, self.keys.namespace, target, now - started, len(taken), health,
                    )
            return await self._finish(taken, version, started, tally, redelivered)
        except BaseException:
            # Cancelled (asyncio.timeout), or failed, at any await: everything this call holds
            # stays pending under this consumer, so it is handed out first by the next call (the
            # fields are read again: an entry whose hand-back script ran is gone by then). A read
            # whose reply was lost is found by the orphan check the next call starts with.
            if self._redeliver is None:
                self._redeliver = deque()
            held = [eid for eid, _ in (*taken, *entries)]
            self._redeliver.extendleft(reversed([(eid, {}) for eid in held]))
            self._handed_back_maybe.update(held)
            self._read_unsure = True
            raise

    async def commit(self, batch: Batch) -> int:
        """Acknowledge and delete the batch's groups; the number acknowledged now."""
        self._check_name()
        acked = await self._outage.run(lambda: self.queue.commit(batch.entry_ids))
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
            entries = await self._outage.run(lambda c=cursor: self.queue.own_pending_page(c))
            if not entries:
                return out
            out.extend(entries)
            cursor = entries[-1][0].decode()

    async def _adopt_orphans(self, taken: list[tuple[bytes, Group]]) -> None:
        """Queue for delivery the groups pending under this name that nobody here has seen.

        An XREADGROUP whose reply is lost (take() cancelled mid-BLOCK, a dropped connection)
        still delivered its entries: they sit in our pending list and no later ``>`` read
        returns them, so without this they would wait for a trainer restart.
        """
        if self._redeliver is None:
            self._redeliver = deque()
        pending = await self._outage.run(self.queue.pending_ids)
        self._read_unsure = False
        self._orphans_checked = time.monotonic()
        known = self._handed_out | {eid for eid, _ in taken} | {eid for eid, _ in self._redeliver}
        orphans = [eid for eid in pending if eid not in known]
        if orphans:
            logger.warning(
                "consumer %s (ns %s): %d groups delivered to a lost read are handed out now",
                self.name, self.keys.namespace, len(orphans),
            )
            self._redeliver.extend((eid, {}) for eid in orphans)

    async def _read(self, count: int) -> list[tuple[bytes, dict[bytes, bytes]]]:
        outages = self._outage.count
        self._read_unsure = True
        entries = await self._outage.run(lambda: self.queue.read(self._blocking, count, _READ_BLOCK_MS))
        self._read_unsure = self._outage.count != outages
        return entries

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
                if entry_id not in self._handed_back_maybe:  # not by us: XTRIM, XDEL, a lost AOF tail
                    logger.warning(
                        "consumer %s (ns %s): group entry %s was delivered but is gone from the stream "
                        "(XTRIM / XDEL?): acknowledged, its group is lost (see `rollstream inspect`)",
                        self.name, self.keys.namespace, entry_id.decode(),
                    )
                await self._outage.run(lambda: self.queue.ack_deleted(entry_id))
                self._handed_back_maybe.discard(entry_id)
                return None
        try:
            group = decode_group_entry(fields, self.limits, views=True)
        except DecodeError as exc:
            await self._dead_letter(entry_id, fields, f"{exc.reason}: {exc.detail}", tally)
            return None
        n = self.config.n_samples_per_prompt
        size_error = group.size_error(n)
        if size_error is not None:
            wrong_size = f"wrong_group_size: {size_error}"
            # dead letters hold prompts: what `rollstream dead requeue` puts back
            await self._dead_letter(entry_id, prompt_fields(retry_prompt(group, wrong_size)), wrong_size, tally)
            return None
        staleness = group.staleness(version)
        tally.staleness_max_seen = max(tally.staleness_max_seen, staleness)
        status = group.status
        if status == Status.FAILED:
            errors = {s.error or "failed" for s in group.samples if s.status == Status.FAILED}
            await self._recycle(entry_id, group, "failed", "; ".join(sorted(errors))[:300], tally)
            return None
        if status == Status.ABORTED:
            await self._recycle(entry_id, group, "aborted", "", tally)
            return None
        if staleness_limit is not None and staleness > staleness_limit:
            self._count_stale(group, version, staleness_limit)
            await self._recycle(entry_id, group, "stale", f"staleness {staleness} > {staleness_limit}", tally)
            return None
        self._stale = None  # a fresh group: whatever went stale before, weights reach the engines
        self._fresh_seen = True
        if keep_filter is not None:
            reason = rejection_reason(keep_filter(group))
            if reason is not None:
                await self._filter(entry_id, group, reason, tally)
                return None
        return group

    def _count_stale(self, group: Group, version: int, limit: int) -> None:
        versions = [v for s in group.samples for v in s.weight_versions]
        oldest, newest = (min(versions), max(versions)) if versions else (0, 0)
        if self._stale is None:
            self._stale = _StaleStreak(time.monotonic(), now_ms(), oldest, newest, version, limit)
        self._stale.add(oldest, newest, version, limit)

    @property
    def _stale_reportable(self) -> bool:
        """A streak long enough to be reported: a whole batch's worth of groups (at least
        :data:`STALE_STREAK_MIN`), all stale."""
        return self._stale is not None and self._stale.count >= max(self.config.batch_size, STALE_STREAK_MIN)

    async def _stale_check(self, target: int, started: float, have: int) -> None:
        """Report a streak of stale recycles at once, then every ``warn_interval`` (log and the
        state hash, for ``inspect``); past ``stall_timeout`` of nothing but stale groups, raise
        :class:`AllGroupsStale`: recycling them for ever would only burn engine time."""
        streak = self._stale
        if streak is None or not self._stale_reportable:
            return
        now = time.monotonic()
        if now - streak.reported >= self.warn_interval:
            streak.reported = now
            logger.warning(
                "consumer %s (ns %s): take(%d) waiting for %.0f s with %d groups; %s",
                self.name, self.keys.namespace, target, now - started, have, streak.describe(),
            )
            values = {
                StateField.STALE_STREAK: streak.count, StateField.STALE_SINCE_MS: streak.since_ms,
                StateField.STALE_REPORTED_MS: now_ms(), StateField.STALE_ENGINE_OLDEST: streak.oldest,
                StateField.STALE_ENGINE_NEWEST: streak.newest, StateField.STALE_TRAINER_VERSION: streak.trainer,
            }
            await self._outage.run(lambda: record_stale_streak(self.redis, self.keys, values))
        if now - streak.since > self.stall_timeout:
            self._stale = None  # a trainer that goes on (new weights pushed) gets a fresh window
            raise AllGroupsStale(
                f"take({target}) of namespace {self.keys.namespace!r}: for more than the {self.stall_timeout:.0f} s "
                f"stall timeout every group read was recycled as stale; {streak.describe()}"
            )

    async def _fetch(self, entry_id: bytes) -> dict[bytes, bytes]:
        return await self._outage.run(lambda: self.queue.fetch(entry_id))

    async def _dead_letter(
        self, entry_id: bytes, fields: Mapping[Any, Any], reason: str, tally: _Tally, *, log: bool = True
    ) -> None:
        if log:
            logger.warning("consumer %s: group entry %s dead-lettered: %s", self.name, entry_id.decode(), reason)
        moved = await self._outage.run(
            lambda: self.queue.dead_letter(entry_id, fields, reason)
        )
        if moved:
            tally.dead_lettered += 1

    async def _recycle(self, entry_id: bytes, group: Group, kind: str, detail: str, tally: _Tally) -> None:
        """Put the group's prompt back with ``attempt + 1`` (past max_attempts: dead-letter it)."""
        reason = f"{kind}: {detail}" if detail else kind
        keep_partial = kind == "aborted" and self.config.partial_rollout
        # Staleness is the pipeline's doing, not the prompt's: it does not use up an attempt
        # (counted in recycled_stale; a pipeline where everything goes stale is diagnosed instead).
        stale = kind == "stale"
        alone = stale and self._fresh_seen and not self._stale_reportable  # other groups are fresh
        if stale and not alone:
            reason += ALL_STALE_MARK
        prompt = retry_prompt(group, reason, keep_partial=keep_partial, uses_attempt=not stale)
        fields = prompt_fields(prompt)
        recent = prompt.history[-MAX_STALE_RECYCLES:]
        if alone and len(recent) == MAX_STALE_RECYCLES and all(_stale_alone(h) for h in recent):
            # The one loop staleness can make for a prompt: its generation always outlasts the window.
            dead_reason = (
                f"stale_recycles: recycled as stale {MAX_STALE_RECYCLES} times in a row while other groups "
                f"were fresh: its generation outlasts max_staleness versions (raise max_staleness or lower "
                f"max_new_tokens); last: {reason}"
            )
            logger.warning("consumer %s: prompt %d dead-lettered: %s", self.name, group.index, dead_reason)
            await self._dead_letter(entry_id, fields, dead_reason, tally, log=False)
            return
        if not stale and prompt.attempt > self.config.max_attempts:
            dead_reason = (
                f"max_attempts: recycled {prompt.attempt} times (> {self.config.max_attempts}); last: {reason}"
            )
            logger.warning(
                "consumer %s: prompt %d dead-lettered after %d attempts: %s",
                self.name, group.index, prompt.attempt, "; ".join(prompt.history),
            )
            await self._dead_letter(entry_id, fields, dead_reason, tally, log=False)
            return
        moved = await self._outage.run(lambda: self.queue.recycle(entry_id, RECYCLE_COUNTERS[kind], fields))
        if moved:
            tally.recycled[kind] += 1
            logger.debug("consumer %s: prompt %d recycled (%s)", self.name, group.index, reason)

    async def _filter(self, entry_id: bytes, group: Group, reason: str, tally: _Tally) -> None:
        tally.filtered[reason] += 1
        if self.config.recycle_filtered:
            await self._recycle(entry_id, group, "filtered", reason, tally)
            return
        await self._outage.run(lambda: self.queue.drop_filtered(entry_id, reason))

    async def _live_producers(self) -> tuple[int, int]:
        """(producers alive, in-flight samples of the alive ones)."""
        beats = await self._outage.run(lambda: read_heartbeats(self.redis, self.keys))
        return live_producers(beats, now_ms(), self.config.heartbeat_timeout)

    def _tick_stall_clock(self, alive: int) -> float:
        """Seconds without a live producer (0 while one is alive), on this consumer's clock."""
        now = time.monotonic()
        self._health_checked = now
        if alive:
            self._no_producer_since = None
            return 0.0
        if self._no_producer_since is None:
            self._no_producer_since = now
        return now - self._no_producer_since

    async def _stall_due(self) -> bool:
        """Whether no producer has been alive for ``stall_timeout`` and no group waits for us."""
        alive, _ = await self._live_producers()
        if self._tick_stall_clock(alive) <= self.stall_timeout or self._redeliver:
            return False
        return await self._outage.run(lambda: waiting_groups(self.redis, self.keys)) == 0

    async def _check_health(self, target: int, started: float, have: int) -> str:
        """Raise ProducerFailed or PipelineStalled if due; a one-line summary for warnings."""
        alive, health = await self._health(target)
        without = self._tick_stall_clock(alive)
        if without > self.stall_timeout:
            raise PipelineStalled(
                f"no producer of namespace {self.keys.namespace!r} has sent a heartbeat for "
                f"{without:.0f} s while take({target}) waited {time.monotonic() - started:.0f} s "
                f"with {have} groups ({health})"
            )
        return health

    async def _health(self, target: int) -> tuple[int, str]:
        """Raise ProducerFailed if due; (live producers, a one-line summary for warnings that
        names the likeliest cause of the wait: ``common.admission.wait_cause``, or a deadlock at
        maxmemory: ``common.admission.memory_deadlock``)."""
        now = now_ms()
        beats = await self._outage.run(lambda: read_heartbeats(self.redis, self.keys))
        alive, in_flight = live_producers(beats, now, self.config.heartbeat_timeout)
        refusals = admission_refusals(beats, now, self.config.heartbeat_timeout)
        state = await self._outage.run(lambda: read_state(self.redis, self.keys))
        backlog, queued = await self._outage.run(lambda: stream_lengths(self.redis, self.keys))
        terms = await self._outage.run(lambda: read_admission_terms(self.redis, self.keys, self.config))
        fatal = await self._outage.run(lambda: recent_events(self.redis, self.keys, count=1, kind=FATAL))
        last_error = ""
        if fatal:
            event = fatal[0]
            if unrecovered(event.ts_ms, state_int(state, StateField.LAST_PUBLISH_MS)):
                last_error = f"{event.source}: {event.message}"
                if self.on_producer_failure == "raise":
                    raise ProducerFailed(event.source, event.message, event.traceback)
                if self._warned_fatal != event.id:
                    self._warned_fatal = event.id
                    logger.warning("producer %s failed: %s\n%s", event.source, event.message, event.traceback)
        in_flight_prompts = terms.outstanding - terms.ready
        paused = state.get(StateField.PAUSED, "0") == "1"
        cause = wait_cause(
            producers_alive=alive, paused=paused, prompts_waiting=max(0, queued - in_flight_prompts),
            in_flight_prompts=in_flight_prompts, ready=terms.ready, refusals=refusals,
            terms=terms if self.config.admission_enabled else None,
            engine_retries=_engine_retries(beats, now, self.config.heartbeat_timeout), last_error=last_error,
        )
        if self._stale is not None and self._stale_reportable:
            cause = self._stale.describe()
        memory = None
        if time.monotonic() >= self._memory_unread_until:
            memory = await server_memory(self.redis)  # None when INFO is not allowed
            if memory is None:
                self._memory_unread_until = time.monotonic() + _MEMORY_RETRY_SECONDS
        deadlock = memory_deadlock(
            memory, prompts_waiting=max(0, queued - in_flight_prompts), in_flight_prompts=in_flight_prompts,
            groups_held=backlog, batch_size=target,
        )
        self._memory_deadlock = deadlock is not None
        if deadlock is not None:
            cause = deadlock
        elif memory and memory["maxmemory"] and memory["used_memory"] >= memory["maxmemory"] - WRITE_ROOM:
            cause = f"Redis is at maxmemory (writes refused, backing off until commits free memory); {cause}"
        summary = (
            f"{cause} (backlog {backlog}, prompts queued {queued}, in flight {in_flight} samples, "
            f"live producers {alive}, paused {paused})"
        )
        return alive, summary

    async def _finish(
        self, taken: list[tuple[bytes, Group]], version: int, started: float, tally: _Tally, redelivered: bool
    ) -> Batch:
        wait = time.monotonic() - started
        taken.sort(key=lambda item: item[1].index)
        entry_ids = [eid for eid, _ in taken]
        groups = [g for _, g in taken]
        staleness = [g.staleness(version) for g in groups]
        rewards = [r for g in groups if not math.isnan(r := g.reward_mean)]
        stats = await mark_take(self.redis, self.keys)
        alive, in_flight = live_producers(stats.heartbeats, now_ms(), self.config.heartbeat_timeout)
        blocked_ms = stats.admission_blocked_ms
        blocked_delta = 0 if self._last_blocked_ms is None else max(0, blocked_ms - self._last_blocked_ms)
        self._last_blocked_ms = blocked_ms
        metrics: dict[str, float] = {
            "groups": float(len(groups)),
            "weight_version": float(version),
            "wait_time_s": wait,
            "backlog": float(stats.groups_length - stats.groups_pending),
            "taken_uncommitted": float(stats.groups_pending),
            "in_flight_prompts": float(stats.prompts_pending),
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
        # the last step, after the last await: a call cancelled before here hands these out again
        self._handed_out.update(entry_ids)
        return Batch(
            id=batch_id(entry_ids),
            groups=groups,
            entry_ids=entry_ids,
            metrics=metrics,
            weight_version=version,
            redelivered=redelivered,
        )


def _engine_retries(beats: Mapping[bytes, bytes], now: int, timeout_s: float) -> int:
    """Engine requests retried by the live producers (their heartbeats)."""
    total = 0
    for raw in beats.values():
        try:
            beat = Heartbeat.parse(raw)
        except ValueError:
            continue
        if beat.alive(now, timeout_s):
            total += beat.engine_retries
    return total


async def _hold_name(lease: NameLease, keys: Keys, name: str, wait: float) -> None:
    """Take the consumer name, waiting up to ``wait`` seconds for another holder to go."""
    deadline = time.monotonic() + wait
    announced = False
    while not await lease.hold(int(NAME_LEASE_SECONDS * 1000)):
        holder = await lease.holder()
        if time.monotonic() >= deadline:
            raise ConsumerNameInUse(keys.namespace, name, holder, f"still held after waiting {wait:.0f} s")
        if not announced:
            announced = True
            logger.warning(
                "consumer %s (ns %s): the name is held by %s; waiting up to %.0f s for it to be released or expire",
                name, keys.namespace, holder, wait,
            )
        await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


async def _release_name(lease: NameLease) -> None:
    """Best effort: if Redis cannot be reached, the hold expires by itself."""
    try:
        async with asyncio.timeout(2):
            await lease.release()
    except (TimeoutError, *TRANSIENT_ERRORS) as exc:
        logger.debug("releasing the consumer name lease failed (%s); it expires by itself", exc)


class Connecting:
    """What ``GroupConsumer.connect()`` returns: await it for the consumer, or use it as an
    async context manager that closes the consumer on exit."""

    def __init__(self, opening: Coroutine[Any, Any, GroupConsumer]) -> None:
        self._opening: Coroutine[Any, Any, GroupConsumer] | None = opening
        self._consumer: GroupConsumer | None = None

    def _take(self) -> Coroutine[Any, Any, GroupConsumer]:
        if self._opening is None:
            raise RuntimeError("GroupConsumer.connect(...) can be awaited or entered only once")
        opening, self._opening = self._opening, None
        return opening

    def __await__(self) -> Generator[Any, None, GroupConsumer]:
        return self._take().__await__()

    async def __aenter__(self) -> GroupConsumer:
        self._consumer = await self._take()
        return self._consumer

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._consumer is not None:
            await self._consumer.aclose()

    def __del__(self) -> None:
        if self._opening is not None:  # never awaited: close the coroutine without a warning
            self._opening.close()


class SyncGroupConsumer:
    """The same API for trainers that are not asyncio: its event loop runs in a daemon thread."""

    def __init__(
        self,
        url: str,
        namespace: str,
        name: str = "trainer-0",
        *,
        n_samples: int | None = None,
        batch_size: int | None = None,
        keep: KeepFilter | None = None,
        on_producer_failure: Literal["raise", "warn"] = "raise",
        stall_timeout: float = 300.0,
        warn_interval: float = 30.0,
        limits: CodecLimits = DEFAULT_LIMITS,
        name_wait: float = NAME_WAIT_SECONDS,
    ) -> None:
        """The options of :meth:`GroupConsumer.connect`."""
        self._runner = LoopThread(f"rollstream-consumer-{name}")
        try:
            self._consumer: GroupConsumer = self._runner.run(
                GroupConsumer._open(
                    url, namespace, name, n_samples=n_samples, batch_size=batch_size, keep=keep,
                    on_producer_failure=on_producer_failure, stall_timeout=stall_timeout,
                    warn_interval=warn_interval, limits=limits, name_wait=name_wait,
                )
            )
        except BaseException:
            self._runner.close()
            raise

    @property
    def config(self) -> PipelineConfig:
        return self._consumer.config

    def take(self, target: int, *, max_staleness: int | None = _UNSET, keep: KeepFilter | None = _UNSET) -> Batch:
        return self._runner.run(self._consumer.take(target, max_staleness=max_staleness, keep=keep))

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
