"""The trainer's side: take exactly ``target`` groups, commit them after the step.

``take(target)`` reads the groups stream through the ``trainer`` consumer group, FIFO by arrival.
Each entry is judged as it arrives (:func:`.verdict.judge`: keep, recycle failed / aborted /
stale / filtered, drop, dead-letter) and either accepted or handed back in one Lua script. A
streak of nothing but stale groups is reported at once (log, state hash for ``inspect``) and,
past ``stall_timeout``, raises :class:`AllGroupsStale`.

It keeps reading until it holds exactly ``target`` usable groups; the surplus stays in the
stream. Taken groups stay pending until :meth:`GroupConsumer.commit`, so a trainer that restarts
under the same name gets its uncommitted batch back first, with the same :attr:`Batch.id`.
While it waits, ``take()`` raises :class:`ProducerFailed` (a producer recorded a fatal error
and no group arrived since) or :class:`PipelineStalled` (no live producer for too long) instead
of hanging, and logs a warning every 30 s; the diagnosis is one pipelined read
(:meth:`TrainerMonitor.diagnose`) judged by :mod:`.waiting`.

The rooms of ``consumer/``: :mod:`.options` (the options, checked once), :mod:`.batch` (the batch
and its numpy views), :mod:`.verdict` (the pure routing rule), :mod:`.waiting` (the pure
diagnosis), :mod:`.lease` (the consumer name), :mod:`.sync` (the sync facade), this module (the
take loop and the hand-backs: about 500 lines, kept together because redelivery, orphans and
cancellation share the loop's state).
"""

from __future__ import annotations

import enum
import functools
import logging
import time
from collections import Counter, deque
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

from redis.asyncio import Redis
from rollstream.common import bias
from rollstream.common.cancellation import raise_if_cancelled
from rollstream.common.checked import is_int
from rollstream.common.config import PipelineConfig
from rollstream.common.connection import Outage, connect
from rollstream.common.datasets import RowFormat
from rollstream.common.errors import AllGroupsStale, PayloadError, PayloadUnreadable, PipelineStalled, ProducerFailed
from rollstream.common.eval_lane import EvalResult
from rollstream.common.events import now_ms
from rollstream.common.keys import Keys
from rollstream.common.logs import Prefixed
from rollstream.common.models import Group
from rollstream.common.namespace import load_config
from rollstream.common.payload.plane import PayloadPlane
from rollstream.common.protocol import (
    Control,
    Diagnosis,
    Entry,
    EvalLane,
    GroupQueue,
    TrainerMonitor,
    live_producers,
)

from .batch import Batch, Tally, batch_id, batch_metrics, row_stat_items
from .biaswatch import BiasWatch
from .connecting import Connecting
from .evaluation import finished_evals, submit_eval
from .filters import KeepFilter
from .lateness import StepClock
from .lease import NameHold
from .mixing import Mixer
from .options import NAME_LEASE_SECONDS, NAME_WAIT_SECONDS, ConsumerOptions
from .verdict import (
    ALL_STALE_MARK,
    MAX_STALE_RECYCLES,
    RECYCLE_COUNTERS,
    STALE_STREAK_MIN,
    Cause,
    Route,
    Verdict,
    judge,
    refilter,
    unreadable,
)
from .waiting import StaleWatch, StallClock, alive_producers, deadlock_at_maxmemory, unrecovered_failure, wait_summary

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .options import ConsumerOptionArgs

__all__ = [  # the names this module has always offered, wherever they live now
    "ALL_STALE_MARK",
    "MAX_STALE_RECYCLES",
    "NAME_LEASE_SECONDS",
    "NAME_WAIT_SECONDS",
    "RECYCLE_COUNTERS",
    "STALE_STREAK_MIN",
    "Batch",
    "Connecting",
    "GroupConsumer",
    "batch_id",
]

logger = logging.getLogger(__name__)


class Unset(enum.Enum):
    """The type of :data:`UNSET`: a one-member enum, so that ``x is UNSET`` narrows ``x``'s type."""

    UNSET = "UNSET"


UNSET: Final = Unset.UNSET
"""``take()``'s default for ``max_staleness`` and ``keep``: the namespace's / the consumer's."""
_READ_BLOCK_MS = 1000
_ORPHAN_CHECK_INTERVAL = 5.0
_HEALTH_CHECK_INTERVAL = 1.0
_QUOTA_CHECK_INTERVAL = 1.0


def _over_quota(quotas: dict[str, int] | None, taken: list[tuple[bytes, Group]], group: Group) -> bool:
    """Whether ``group``'s source already has its share of this batch (a source outside the mix has none)."""
    if quotas is None or group.source not in quotas:
        return False
    return sum(1 for _, g in taken if g.source == group.source) >= quotas[group.source]


def _rebalance(
    quotas: dict[str, int], taken: list[tuple[bytes, Group]], held: list[tuple[bytes, Group]], target: int
) -> None:
    """After the quotas changed (a source ran dry): groups held for a source with room now are
    taken, oldest first; a source over its new quota keeps its newest ones held."""
    for source, quota in quotas.items():
        mine = [item for item in taken if item[1].source == source]
        for item in sorted(mine, key=lambda i: i[0])[quota:]:
            taken.remove(item)
            held.append(item)
    held.sort(key=lambda item: item[0])
    for item in list(held):
        if len(taken) >= target:
            break
        if not _over_quota(quotas, taken, item[1]):
            held.remove(item)
            taken.append(item)


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
        options: ConsumerOptions | None = None,
        hold: NameHold | None = None,
        plane: PayloadPlane | None = None,
    ) -> None:
        self.url = url
        self.keys = Keys(namespace)
        self.name = name
        self.log = Prefixed(logger, "consumer", name, namespace)
        self.config = config
        self.options = options if options is not None else ConsumerOptions()
        self.redis = redis
        self._blocking = blocking
        self.queue = GroupQueue(redis, self.keys, name)
        self.control = Control(redis, self.keys)
        self.monitor = TrainerMonitor(redis, self.keys)
        self._hold = hold
        self.plane = plane
        """The namespace's payload store and its ledgers (None: the namespace has no store)."""
        self._outage = Outage(logger, f"consumer {name}")
        self._redeliver: deque[tuple[bytes, dict[bytes, bytes]]] | None = None
        self._last_blocked_ms: int | None = None
        self._warned_fatal: str | None = None
        # Groups handed out in batches and not committed yet, and whether a read may have
        # delivered entries whose reply never reached us (cancelled, dropped connection).
        self._handed_out: set[bytes] = set()
        self._read_unsure = False
        self._orphans_checked = 0.0
        self._stall = StallClock()
        # Whether the last health check found Redis at maxmemory with nothing able to move.
        self._memory_deadlock = False
        # Entries put back after a cancelled take() whose hand-back script may have run meanwhile:
        # finding them deleted is expected, not a loss.
        self._handed_back_maybe: set[bytes] = set()
        self._stale = StaleWatch(config.batch_size)
        # With a mix: each source's quota per batch; groups over their source's quota stay
        # pending under this name and are examined first by the next call.
        self._mixer = Mixer(redis, self.keys, config.weights, self._outage, self.log) if config.weights else None
        self._held: deque[tuple[bytes, dict[bytes, bytes]]] = deque()
        self._bias_pending: Counter[str] = Counter()
        """Ledger counts of hand-backs not yet added (by the next take's statistics round trip)."""
        self._version = 0
        self._bias = BiasWatch(self.name, self.keys.namespace, self.options.warn_interval)
        self._steps = StepClock(self.name, self.keys.namespace, self.options.warn_interval)
        self._eval_groups: dict[str, list[Group]] = {}
        """The groups of running evals this consumer collected (``eval_results``): handed back with
        the result of the call that finishes each."""

    @property
    def keep(self) -> KeepFilter | None:
        """The dynamic-sampling filter ``take()`` applies unless given another."""
        return self.options.keep

    @property
    def stall_timeout(self) -> float:
        return self.options.stall_timeout

    @classmethod
    def connect(
        cls, url: str, namespace: str, name: str = "trainer-0", **options: Unpack[ConsumerOptionArgs]
    ) -> Connecting:
        """Connect and check the namespace config against what this trainer expects.

        Use ``async with GroupConsumer.connect(...) as consumer:`` (closed on exit) or
        ``consumer = await GroupConsumer.connect(...)`` (close it with ``aclose()``).
        ``options`` are :class:`~.options.ConsumerOptions`' fields (``n_samples``,
        ``batch_size``, ``keep``, ``on_producer_failure``, ``stall_timeout``, ``warn_interval``,
        ``limits``, ``name_wait``), checked here (``ConfigError``). The consumer ``name`` is held
        by one live trainer at a time: while another holds it, ``connect`` waits up to
        ``name_wait`` seconds (a crashed holder's hold expires within ``NAME_LEASE_SECONDS``),
        then raises ``ConsumerNameInUse``.
        """
        return Connecting(cls.open(url, namespace, name, ConsumerOptions(**options)))

    @classmethod
    async def open(cls, url: str, namespace: str, name: str, options: ConsumerOptions) -> GroupConsumer:
        """Connect with options already built (what ``connect`` and ``SyncGroupConsumer`` run)."""
        keys = Keys(namespace)
        redis = connect(url, name=f"rollstream-consumer-{name}")
        hold = NameHold(redis, keys, name)
        try:
            config = await load_config(redis, keys)
            config.check_matches(n_samples_per_prompt=options.n_samples, batch_size=options.batch_size)
            await hold.take(options.name_wait)
        except BaseException:
            await redis.aclose()
            raise
        blocking = connect(url, block_ms=_READ_BLOCK_MS, name=f"rollstream-consumer-{name}-read")
        try:
            plane = (
                PayloadPlane.open(config.payload_store, redis, keys, config.lease_seconds)
                if config.payload_store else None
            )
            consumer = cls(url, namespace, name, config, redis, blocking, options, hold, plane)
        except BaseException:
            await hold.release()
            await redis.aclose()
            await blocking.aclose()
            raise
        hold.keep()
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
            if self._hold is not None:
                await self._hold.release()
        finally:
            try:
                if self.plane is not None:
                    await self.plane.close()
            finally:
                await self.redis.aclose()
                await self._blocking.aclose()

    def _check_name(self) -> None:
        if self._hold is not None:
            self._hold.check()

    # -- trainer state ------------------------------------------------------------------

    async def weight_version(self) -> int:
        return await self._outage.run(self.control.weight_version)

    async def set_weight_version(self, version: int) -> None:
        """Record the trainer's new weight version (after pushing weights to the engines)."""
        await self._outage.run(lambda: self.control.set_weight_version(version))

    async def record_weights(self, path: str, version: int) -> None:
        """Record where the weights of ``version`` are (a path the engines can load): producers
        with ``--catch-up-engines`` load them into an engine found behind (restarted on its base
        checkpoint). ``WeightSync.update`` records its path itself."""
        await self._outage.run(lambda: self.control.record_weights(path, version))

    async def pause(self) -> None:
        """Stop every producer from admitting new prompts (effective at once: ADMIT checks it)."""
        await self._outage.run(self.control.pause)

    async def resume(self, version: int | None = None) -> None:
        """Let producers admit again, optionally recording a new weight version first."""
        await self._outage.run(lambda: self.control.resume(version))

    # -- the eval lane (consumer/evaluation.py) -------------------------------------------

    async def evaluate(
        self, name: str, source: str | Path | Iterable[Any], *, n_samples: int = 1, max_new_tokens: int | None = None,
        temperature: float | None = None, top_p: float | None = None, row_format: RowFormat | None = None,
    ) -> str:
        """Submit an eval set and return at once (its name). Its prompts go to the producers
        before any training prompt, ``n_samples`` each with at most ``max_new_tokens``, sampled
        at ``temperature`` and ``top_p`` (None: the producer's), and their groups go to the eval
        lane, never to ``take()``; training goes on.
        ``source``: a dataset on disk, read as the feeder reads one (JSONL or Parquet, a folder or
        glob of shards, ``path@[a:b]``; ``prompt``, optional ``label`` and ``metadata``, or the keys
        ``row_format`` names), or an iterable of prompts (text, chat messages, or mappings with
        ``prompt`` / ``label`` / ``metadata``). A name is used once
        per namespace (``ConfigError`` otherwise). Results: :meth:`eval_results`."""
        return await submit_eval(
            EvalLane(self.redis, self.keys), self._outage, self.name, name, source, n_samples, max_new_tokens,
            temperature, top_p, row_format,
        )

    async def eval_results(self) -> list[EvalResult]:
        """Every finished eval of the namespace, oldest first: its metrics (mean reward, pass rate,
        response length), the weight versions its samples were generated at with how many at each,
        and its lag in steps (training steps committed while it ran). An eval finishes when every
        one of its prompts came back. Each call folds the groups that came back since the last into
        their eval's rows and archives (fate ``evaluated``) and deletes them, so the eval lane stays
        within its bound (``max_backlog``, ``max_backlog_bytes``) however large the eval: call it
        while an eval runs. The result returned by the call that finishes an eval carries the
        groups this consumer collected (``EvalResult.groups``)."""
        return await finished_evals(EvalLane(self.redis, self.keys), self._outage, self.name, self._eval_groups)

    # -- take / commit ------------------------------------------------------------------

    async def take(
        self,
        target: int,
        *,
        max_staleness: int | Unset | None = UNSET,
        keep: KeepFilter | Unset | None = UNSET,
    ) -> Batch:
        """Exactly ``target`` usable groups, sorted by index (FIFO by arrival until then).

        To bound the wait, wrap it in ``asyncio.timeout``: groups taken so far stay pending
        and are handed out first by the next call.
        """
        if not is_int(target) or target < 1:
            raise ValueError(f"target must be a positive integer, got {target!r}")
        self._check_name()
        staleness_limit = self.config.max_staleness if max_staleness is UNSET else max_staleness
        keep_filter = self.keep if keep is UNSET else keep
        started = time.monotonic()
        tally = Tally(bias=self._bias_pending)  # a cancelled take's hand-backs go with the next one
        taken: list[tuple[bytes, Group]] = []
        held: list[tuple[bytes, Group]] = []
        entries: deque[Entry] = deque()
        redelivered = False
        quotas: dict[str, int] | None = None
        try:
            if time.monotonic() - self._stall.checked >= _HEALTH_CHECK_INTERVAL and (
                diagnosis := await self._stall_due()
            ):
                # checked here too, not only after an empty read: calls shorter than one blocking
                # read (asyncio.timeout) must still end in PipelineStalled
                await self._check_health(target, started, len(taken), diagnosis)
            version = self._version = await self.weight_version()
            if self._redeliver is None:
                self._redeliver = deque(await self._own_pending())
                if self._redeliver:
                    self.log.info(
                        "%d groups taken but not committed earlier are delivered first",
                        len(self._redeliver),
                    )
            if self._mixer is not None:
                quotas = await self._mixer.quotas(target)
            quotas_checked = last_warning = started
            while len(taken) < target:
                raise_if_cancelled()
                if self._read_unsure and not self._redeliver:
                    await self._adopt_orphans([*taken, *held])
                if self._redeliver:
                    for _ in range(min(target - len(taken), len(self._redeliver))):
                        entries.append(self._redeliver.popleft())
                    redelivered = True
                elif self._held:
                    entries.extend(self._held)
                    self._held.clear()
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
                        (held if _over_quota(quotas, taken, group) else taken).append((entry_id, group))
                if self._stale.streak is not None:
                    await self._stale_check(target, started, len(taken))
                if self._mixer is not None and len(taken) < target and (
                    not got or (held and time.monotonic() - quotas_checked >= _QUOTA_CHECK_INTERVAL)
                ):  # a source may have run dry meanwhile
                    quotas_checked = time.monotonic()
                    quotas = await self._mixer.quotas(target, Counter(g.source for _, g in (*taken, *held)))
                    _rebalance(quotas, taken, held, target)
                if got or len(taken) >= target:
                    continue
                now = time.monotonic()
                if now - self._orphans_checked >= _ORPHAN_CHECK_INTERVAL:
                    # redis-py may re-send a read after a dropped connection without telling us.
                    await self._adopt_orphans([*taken, *held])
                health = await self._check_health(target, started, len(taken))
                if now - last_warning >= self.options.warn_interval:
                    last_warning = now
                    unfed = "" if self._mixer is None or quotas is None else self._mixer.unfed(
                        quotas, Counter(g.source for _, g in taken))
                    # a deadlock at maxmemory ends only when someone raises maxmemory: an error
                    (self.log.error if self._memory_deadlock else self.log.warning)(
                        "take(%d) waiting for %.0f s with %d groups; %s%s",
                        target, now - started, len(taken), health, f"; {unfed}" if unfed else "",
                    )
            batch = await self._finish(taken, version, started, tally, redelivered)
            self._held.extend((eid, {}) for eid, _ in held)
            return batch
        except BaseException:
            # Cancelled (asyncio.timeout), or failed, at any await: everything this call holds
            # stays pending under this consumer, so it is handed out first by the next call (the
            # fields are read again: an entry whose hand-back script ran is gone by then). A read
            # whose reply was lost is found by the orphan check the next call starts with.
            if self._redeliver is None:
                self._redeliver = deque()
            back = [eid for eid, _ in (*taken, *held, *entries)]
            self._redeliver.extendleft(reversed([(eid, {}) for eid in back]))
            self._handed_back_maybe.update(back)
            self._read_unsure = True
            raise

    async def commit(self, batch: Batch) -> int:
        """Acknowledge and delete the batch's groups; the number acknowledged now."""
        self._check_name()
        sources = [g.source for g in batch.groups] if any(g.source for g in batch.groups) else []
        acked = await self._outage.run(lambda: self.queue.commit(batch.entry_ids, sources))
        if self.config.row_stats and acked:
            items = row_stat_items(batch.groups, batch.weight_version)
            await self._outage.run(lambda: self.queue.record_rows(self.config.row_stats, items))
        self._handed_out.difference_update(batch.entry_ids)
        await self._free_objects()
        if acked == len(batch.entry_ids) and batch.bias:  # committed now, all of it: trained once
            forget = self._bias.forget
            await self._outage.run(lambda: self.monitor.add_bias(batch.bias, forget))
            batch.bias.clear()
            self._bias.forget = []
        if acked != len(batch.entry_ids):
            self.log.warning(
                "commit of batch %s acknowledged %d of %d groups (already committed?)",
                batch.id, acked, len(batch.entry_ids),
            )
        return acked

    # -- the payload plane ----------------------------------------------------------------

    async def _free_objects(self) -> None:
        """Delete from the store the objects the last hand-overs released (best effort: what is
        left waits for the next commit or a producer's reclaim turn)."""
        if self.plane is None:
            return
        plane = self.plane
        try:
            await self._outage.run(lambda: plane.free(rounds=4), give_up_after=5)
        except Exception as exc:
            self.log.warning("freeing released payload objects failed (retried later): %s", exc)

    async def _check_payload(self, entry_id: bytes, verdict: Verdict, tally: Tally) -> Group | None:
        """A kept group whose arrays are in the payload store, checked as ``payload_check`` says
        (read and checksum, or present with their size); one that fails is recycled with the
        reason (store and key) and counted, and None returned."""
        group = verdict.group
        if group is None or group.payload is None or group.payload.attached:  # attached: read for the filter
            return group
        if not await self._read_payload(entry_id, verdict, tally, fetch=self.options.payload_check == "checksum"):
            return None
        return group

    async def _read_payload(self, entry_id: bytes, verdict: Verdict, tally: Tally, *, fetch: bool) -> bool:
        """The kept group's objects read into it (``fetch``: checksums verified) or checked present
        with their size; False when that fails: the group is then recycled with the reason (store
        and key) and counted."""
        group = verdict.group
        if group is None or group.payload is None:  # nothing in the store
            return True
        plane = self.plane
        try:
            if plane is None:
                raise PayloadUnreadable(
                    "(none)", group.payload.objects[0].key, "the namespace has no payload store any more"
                )
            if fetch:
                group.payload.attach(group, await plane.fetch(group.payload), plane.url)
            else:
                await plane.stat(group.payload)
        except PayloadError as exc:
            reason = f"{Cause.PAYLOAD}: {exc}"
            self.log.error("group of prompt %d cannot be used: %s", group.index, exc)
            failed = unreadable(group, reason, self.config, verdict.staleness or 0)
            tally.saw(failed)
            await self._hand_back(entry_id, failed, tally)
            if plane is not None:
                await self._outage.run(lambda: plane.ledger.read_failed(reason))
            return False
        return True

    # -- internals ----------------------------------------------------------------------

    async def _own_pending(self) -> list[tuple[bytes, dict[bytes, bytes]]]:
        out: list[tuple[bytes, dict[bytes, bytes]]] = []
        cursor = "0"
        while True:
            entries = await self._outage.run(functools.partial(self.queue.own_pending_page, cursor))
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
        known = self._handed_out | {eid for eid, _ in taken} | {eid for eid, _ in (*self._redeliver, *self._held)}
        orphans = [eid for eid in pending if eid not in known]
        if orphans:
            self.log.warning(
                "%d groups delivered to a lost read are handed out now",
                len(orphans),
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
        tally: Tally,
    ) -> Group | None:
        """The group if usable; otherwise hand it back as :func:`.verdict.judge` says and None."""
        if not fields:
            fields = await self._fetch(entry_id)
            if not fields:  # deleted meanwhile: nothing left to hand back
                if entry_id not in self._handed_back_maybe:  # not by us: XTRIM, XDEL, a lost AOF tail
                    self.log.warning(
                        "group entry %s was delivered but is gone from the stream "
                        "(XTRIM / XDEL?): acknowledged, its group is lost (see `rollstream inspect`)",
                        entry_id.decode(),
                    )
                await self._outage.run(lambda: self.queue.ack_deleted(entry_id))
                self._handed_back_maybe.discard(entry_id)
                return None
        stale = self._stale.context()
        verdict = judge(
            fields, self.config, version=version, staleness_limit=staleness_limit, keep=keep_filter,
            limits=self.options.limits, stale=stale,
        )
        if verdict.filter_after_fetch and keep_filter is not None:
            # the keep filter read what is still in the payload store: fetch (checksums verified,
            # whatever payload_check) and run it again; an unreadable object recycles the group
            self._stale.saw(verdict, version, staleness_limit)  # fresh: it passed the staleness check
            if not await self._read_payload(entry_id, verdict, tally, fetch=True):
                return None
            verdict = refilter(verdict, keep_filter, self.config, stale)
        self._stale.saw(verdict, version, staleness_limit)
        tally.saw(verdict)
        if verdict.route == Route.KEEP:
            return await self._check_payload(entry_id, verdict, tally)
        # A recycle that keeps its partial samples (partial rollout) refers to the group's objects
        # (the retry prompt's ``refs``: MOVE keeps them held): no fetch here, the producer reads them.
        await self._hand_back(entry_id, verdict, tally)
        return None

    async def _hand_back(self, entry_id: bytes, verdict: Verdict, tally: Tally) -> None:
        """Carry out a verdict other than keep (one Lua script)."""
        group, reason = verdict.group, verdict.reason
        if verdict.route == Route.DROP:
            source = group.source if group is not None else ""
            if await self._outage.run(lambda: self.queue.drop_filtered(entry_id, reason, source)):
                tally.handed_back(verdict)
                if self.config.row_stats and group is not None:
                    items = row_stat_items([group], self._version)
                    await self._outage.run(lambda: self.queue.record_rows(self.config.row_stats, items))
            return
        fields = verdict.fields or {}
        if verdict.route == Route.RECYCLE:
            counter = RECYCLE_COUNTERS[verdict.cause]
            if await self._outage.run(lambda: self.queue.recycle(entry_id, counter, fields, reason)):
                tally.handed_back(verdict)
                self.log.debug("prompt %d recycled (%s)", group.index if group else -1, reason)
            return
        prompt = verdict.prompt
        if prompt is None or verdict.cause == Cause.WRONG_SIZE:
            self.log.warning("group entry %s dead-lettered: %s", entry_id.decode(), reason)
        elif verdict.cause == Cause.STALE:
            self.log.warning("prompt %d dead-lettered: %s", prompt.index, reason)
        else:
            self.log.warning(
                "prompt %d dead-lettered after %d attempts: %s",
                prompt.index, prompt.attempt, "; ".join(prompt.history),
            )
        if await self._outage.run(lambda: self.queue.dead_letter(entry_id, fields, reason)):
            tally.handed_back(verdict)

    async def _stale_check(self, target: int, started: float, have: int) -> None:
        """Report a streak of stale recycles at once, then every ``warn_interval`` (log and the
        state hash, for ``inspect``); past ``stall_timeout`` of nothing but stale groups, raise
        :class:`AllGroupsStale`: recycling them for ever would only burn engine time."""
        streak = self._stale.reportable
        if streak is None:
            return
        now = time.monotonic()
        if now - streak.reported >= self.options.warn_interval:
            streak.reported = now
            self.log.warning(
                "take(%d) waiting for %.0f s with %d groups; %s",
                target, now - started, have, streak.describe(),
            )
            values = streak.record(now_ms())
            await self._outage.run(lambda: self.monitor.record_stale_streak(values))
        if now - streak.since > self.options.stall_timeout:
            self._stale.streak = None  # a trainer that goes on (new weights pushed) gets a fresh window
            raise AllGroupsStale(
                f"take({target}) of namespace {self.keys.namespace!r}: for more than the "
                f"{self.options.stall_timeout:.0f} s stall timeout every group read was recycled as stale; "
                f"{streak.describe()}"
            )

    async def _fetch(self, entry_id: bytes) -> dict[bytes, bytes]:
        return await self._outage.run(lambda: self.queue.fetch(entry_id))

    # -- diagnosis (one round trip: TrainerMonitor.diagnose; judged in .waiting) ---------------

    async def _diagnose(self) -> Diagnosis:
        return await self._outage.run(lambda: self.monitor.diagnose(self.config))

    async def _stall_due(self) -> Diagnosis | None:
        """The diagnosis when no producer has been alive for ``stall_timeout`` and no group waits
        for us, else None."""
        diagnosis = await self._diagnose()
        alive, _ = alive_producers(diagnosis, self.config)
        if self._stall.tick(alive) <= self.options.stall_timeout or self._redeliver or diagnosis.waiting:
            return None
        return diagnosis

    async def _check_health(self, target: int, started: float, have: int, diagnosis: Diagnosis | None = None) -> str:
        """Raise ProducerFailed or PipelineStalled if due; a one-line summary for warnings."""
        if diagnosis is None:
            diagnosis = await self._diagnose()
        health = self._health(diagnosis, target)
        without = self._stall.tick(alive_producers(diagnosis, self.config)[0])
        if without > self.options.stall_timeout:
            raise PipelineStalled(
                f"no producer of namespace {self.keys.namespace!r} has sent a heartbeat for "
                f"{without:.0f} s while take({target}) waited {time.monotonic() - started:.0f} s "
                f"with {have} groups ({health})"
            )
        return health

    def _health(self, diagnosis: Diagnosis, target: int) -> str:
        """Raise ProducerFailed if due; a one-line summary for warnings that names the likeliest
        cause of the wait (a deadlock at maxmemory first: then the warning is an error)."""
        last_error = ""
        event = unrecovered_failure(diagnosis)
        if event is not None:
            last_error = f"{event.source}: {event.message}"
            if self.options.on_producer_failure == "raise":
                raise ProducerFailed(event.source, event.message, event.traceback)
            if self._warned_fatal != event.id:
                self._warned_fatal = event.id
                logger.warning("producer %s failed: %s\n%s", event.source, event.message, event.traceback)
        streak = self._stale.reportable
        stale = streak.describe() if streak is not None else None
        deadlock = deadlock_at_maxmemory(diagnosis, target)
        self._memory_deadlock = deadlock is not None
        return wait_summary(
            diagnosis, self.config, last_error=last_error, stale=stale, deadlock=deadlock
        )

    async def _finish(
        self, taken: list[tuple[bytes, Group]], version: int, started: float, tally: Tally, redelivered: bool
    ) -> Batch:
        wait = time.monotonic() - started
        taken.sort(key=lambda item: item[1].index)
        entry_ids = [eid for eid, _ in taken]
        groups = [g for _, g in taken]
        # Redis may be restarting: wait it out. The hand-backs' ledger counts go in the same round trip.
        stats = await self._outage.run(lambda: self.monitor.mark_take(tally.bias))
        tally.bias.clear()  # statistics: a round trip retried after an outage may add them twice
        alive, in_flight = live_producers(stats.heartbeats, now_ms(), self.config.heartbeat_timeout)
        blocked_ms = stats.admission_blocked_ms
        blocked_delta = 0 if self._last_blocked_ms is None else max(0, blocked_ms - self._last_blocked_ms)
        self._last_blocked_ms = blocked_ms
        metrics = batch_metrics(
            groups, version, stats, tally, wait_s=wait, alive=alive, in_flight=in_flight,
            blocked_delta_ms=blocked_delta, staleness_rule=self.config.staleness_rule,
        )
        trained: Counter[str] = Counter()
        for group in groups:
            bias.deltas(group, "trained", trained)
        metrics.update(self._bias.observe(groups, stats.bias, trained))
        late_metrics, late_counts = self._steps.report(self._steps.late(groups))
        metrics.update(late_metrics)
        trained.update(late_counts)  # committed with the batch's ledger counts
        self._steps.took(now_ms())
        # the last step, after the last await: a call cancelled before here hands these out again
        self._handed_out.update(entry_ids)
        return Batch(
            id=batch_id(entry_ids),
            groups=groups,
            entry_ids=entry_ids,
            metrics=metrics,
            weight_version=version,
            redelivered=redelivered,
            bias=trained,
            plane=self.plane,
        )

