"""The trainer's rollstream session shared by the slime and miles glue.

The frameworks call their rollout function and data source synchronously, from the rollout
manager's thread (slime) or a worker thread (miles), so the session runs its own event loop in a
daemon thread and every public method blocks on it: it works from any thread, inside or outside
someone else's running loop.

A rollout's groups are decided once and remembered: :meth:`RolloutSession.train_batch` takes
exactly ``rollout_batch_size`` groups, writes them to the journal under the rollout id, and only
then commits them (the groups stream never holds more than one rollout's worth of taken groups,
so producers' ``max_backlog`` is not eaten by groups waiting for a checkpoint). The same rollout
id asked again (after a resume from a checkpoint) gets the journaled groups back.
:meth:`save` lets the journal forget rollouts a checkpoint now covers; :meth:`load` checks that
the journal still covers everything after the checkpoint resumed from.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Coroutine
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rollstream.common.connection import connect
from rollstream.common.errors import ConfigError
from rollstream.common.imports import import_callable
from rollstream.common.loop_thread import LoopThread
from rollstream.common.models import Group
from rollstream.common.watchdog import LoopWatchdog, default_stall_after
from rollstream.consumer import ArchiveReplay, GroupConsumer
from rollstream.consumer.options import NAME_LEASE_SECONDS, OnProducerFailure

from .convert import Framework
from .environment import ALLOW_JOURNAL_GAP, KEEP_CHECKPOINTS, KEEP_FILTER, Settings
from .journal import Journal, JournalRecord, journal_key
from .stats_checkpoint import load_stats, save_stats

logger = logging.getLogger(__name__)

T = TypeVar("T")

HEALTH_INTERVAL = 1.0
"""Seconds between checks of the run's own pipeline while a take waits."""


@dataclass(slots=True)
class TrainBatch:
    """The groups of one rollout and rollstream's metrics for it (unprefixed)."""

    groups: list[Group]
    metrics: dict[str, float] = field(default_factory=dict)
    replayed: bool = False


async def open_consumer(
    stack: AsyncExitStack, url: str, namespace: str, name: str, keep: Any = None,
    on_producer_failure: OnProducerFailure = "raise",
) -> Any:
    """``GroupConsumer.connect`` used as an async context manager when it is one, else awaited."""
    opened: Any = GroupConsumer.connect(
        url, namespace, name, keep=keep, on_producer_failure=on_producer_failure
    )
    if hasattr(opened, "__aenter__"):
        return await stack.enter_async_context(opened)
    consumer = await opened if inspect.isawaitable(opened) else opened
    if hasattr(consumer, "__aexit__"):
        return await stack.enter_async_context(consumer)
    stack.push_async_callback(consumer.aclose)
    return consumer


class RolloutSession:
    """One trainer's connection to a namespace, its journal, and the checkpoint tie."""

    def __init__(
        self,
        settings: Settings,
        framework: Framework,
        *,
        extra_metrics: Callable[[], dict[str, float]] | None = None,
        health: Callable[[], BaseException | None] | None = None,
        on_producer_failure: OnProducerFailure = "raise",
    ) -> None:
        self.settings = settings
        self.framework = framework
        self.extra_metrics = extra_metrics
        """More batch metrics (the one-flag run's ``children_restarted``)."""
        self.health = health
        """Why the run's own pipeline cannot go on (a child stopped for good), checked while taking."""
        self.on_producer_failure = on_producer_failure
        """``warn`` when the run supervises its producers (a failed one is restarted)."""
        self.loaded_from: int | None = None
        """The checkpoint rollout id given to :meth:`load` (None: not called, or a fresh start)."""
        self._thread: LoopThread | None = None
        self._watchdog: asyncio.Task[None] | None = None
        """The loop-lag watchdog of the session's loop: the consumer's name lease is renewed on
        it, so a stall there (a heavy conversion, a blocking keep filter) is named in the log; the
        threshold is a fifth of that lease (2 s)."""
        self._stack: AsyncExitStack | None = None
        self._consumer: Any = None
        self._journal: Journal | None = None
        self._known_ids: set[bytes] | None = None
        self._sizes_checked = False
        self._recorded: ArchiveReplay | None = None

    # -- sync facade (any thread) ---------------------------------------------------------

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._thread is None:
            self._thread = LoopThread(f"rollstream-{self.framework.name}")
            self._thread.run(self._watch())
        return self._thread.run(coro)

    def train_batch(
        self,
        rollout_id: int,
        *,
        n_samples: int,
        batch_size: int,
        weight_version: int | None = None,
        max_staleness: int | None = None,
    ) -> TrainBatch:
        """Exactly ``batch_size`` groups for ``rollout_id`` (journaled ones first).

        ``weight_version`` is recorded as the trainer's before taking; ``max_staleness`` is the
        framework's staleness flag, checked against the namespace's (which take() applies).
        """
        return self.run(self._train_batch(rollout_id, n_samples, batch_size, weight_version, max_staleness))

    def eval_step(self, lane: Any, rollout_id: int) -> tuple[dict[str, dict[str, Any]], dict[str, float]]:
        """The framework's eval call through the eval lane (:class:`~.eval_calls.LaneEvals`): submits
        and returns at once, with the evals finished since the last call."""
        return self.run(self._eval_step(lane, rollout_id))

    async def _eval_step(self, lane: Any, rollout_id: int) -> tuple[dict[str, dict[str, Any]], dict[str, float]]:
        consumer, _ = await self._ensure()
        result: tuple[dict[str, dict[str, Any]], dict[str, float]] = await lane.step(consumer, rollout_id)
        return result

    def save(self, rollout_id: int, checkpoint_dir: str | None = None) -> None:
        """Checkpoint ``rollout_id`` written: trim the journal, and (with ``checkpoint_dir``, the
        framework's ``--save``) write the row statistics and the mix's carry beside it."""
        self.run(self._save(rollout_id, checkpoint_dir))

    def load(self, rollout_id: int | None, checkpoint_dir: str | None = None) -> None:
        """Resuming from ``rollout_id``: check the journal, and (with ``checkpoint_dir``, the
        framework's ``--load``) restore the statistics saved with that checkpoint."""
        self.run(self._load(rollout_id, checkpoint_dir))

    def config(self) -> Any:
        """The namespace's PipelineConfig (connects on first use)."""
        return self.run(self._config())

    def close(self) -> None:
        if self._thread is None:
            return
        if self._stack is not None:
            self._thread.run(self._stack.aclose())
            self._stack = None
            self._consumer = None
            self._journal = None
        self._thread.run(self._unwatch())
        self._thread.close()
        self._thread = None

    # -- internals (on the session's loop) ------------------------------------------------

    async def _watch(self) -> None:
        watchdog = LoopWatchdog(
            f"rollstream {self.framework.name} integration", default_stall_after(NAME_LEASE_SECONDS), logger
        )
        self._watchdog = asyncio.create_task(watchdog.run(), name="watchdog")

    async def _unwatch(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.wait([self._watchdog], timeout=5)
            self._watchdog = None

    async def _ensure(self) -> tuple[Any, Journal]:
        if self._consumer is None or self._journal is None:
            stack = AsyncExitStack()
            try:
                keep = self.settings.keep_filter
                consumer = await open_consumer(
                    stack, self.settings.redis_url, self.settings.namespace, self.settings.consumer_name,
                    import_callable(keep, f"{KEEP_FILTER} keep filter") if keep else None,
                    self.on_producer_failure,
                )
                redis = connect(self.settings.redis_url, name=f"rollstream-journal-{self.settings.consumer_name}")
                stack.push_async_callback(redis.aclose)
            except BaseException:
                await stack.aclose()
                raise
            self._stack = stack
            self._consumer = consumer
            self._journal = Journal(redis, self.settings.namespace, self.settings.consumer_name)
        return self._consumer, self._journal

    async def _config(self) -> Any:
        if self.settings.replay_archive:
            return self._replaying().config
        consumer, _ = await self._ensure()
        return consumer.config

    def _replaying(self) -> ArchiveReplay:
        if self._recorded is None:
            self._recorded = ArchiveReplay.open(
                self.settings.replay_archive or "", consumer=self.settings.consumer_name or None
            )
            logger.info(
                "replaying %d recorded batches of %s (ROLLSTREAM_REPLAY_ARCHIVE): no Redis, no engines",
                len(self._recorded), self.settings.replay_archive,
            )
        return self._recorded

    def _replayed(self, n_samples: int, batch_size: int) -> TrainBatch:
        """The next recorded batch of the archive, as it was trained."""
        replay = self._replaying()
        if not self._sizes_checked:
            self._check_sizes(replay.config, n_samples, batch_size, None)
            self._sizes_checked = True
        batch = replay.take_next(batch_size)
        return TrainBatch(groups=batch.groups, metrics=dict(batch.metrics), replayed=True)

    def _check_sizes(self, config: Any, n_samples: int, batch_size: int, max_staleness: int | None) -> None:
        ns = self.settings.namespace
        problems = []
        if config.n_samples_per_prompt != n_samples:
            problems.append(
                f"--n-samples-per-prompt is {n_samples} but namespace {ns!r} has n_samples_per_prompt="
                f"{config.n_samples_per_prompt}"
            )
        if config.batch_size != batch_size:
            problems.append(
                f"--rollout-batch-size is {batch_size} but namespace {ns!r} has batch_size={config.batch_size}"
            )
        if max_staleness is not None and config.max_staleness != max_staleness:
            problems.append(
                f"--max-weight-staleness is {max_staleness} but namespace {ns!r} has max_staleness="
                f"{config.max_staleness} (producers' admission control uses the namespace's)"
            )
        if problems:
            raise ConfigError(
                f"{self.framework.name} and rollstream disagree: {'; '.join(problems)}. Fix the flag or "
                f"re-run `rollstream init --ns {ns}` with matching sizes"
            )

    async def _take(self, consumer: Any, target: int) -> Any:
        coro = self._watched(consumer.take(target))
        if self.settings.take_timeout is None:
            return await coro
        try:
            async with asyncio.timeout(self.settings.take_timeout):
                return await coro
        except TimeoutError:
            raise TimeoutError(
                f"rollstream: no {target} groups within ROLLSTREAM_TAKE_TIMEOUT={self.settings.take_timeout} s "
                f"(namespace {self.settings.namespace!r}); see `rollstream inspect --ns {self.settings.namespace}`"
            ) from None

    def _check_health(self) -> None:
        problem = self.health() if self.health is not None else None
        if problem is not None:
            raise problem

    async def _watched(self, coro: Coroutine[Any, Any, T]) -> T:
        """``coro``, given up with the pipeline's error when it breaks for good meanwhile (a feeder
        refusing the dataset would otherwise leave the take waiting forever)."""
        if self.health is None:
            return await coro
        task = asyncio.ensure_future(coro)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=HEALTH_INTERVAL)
                if done:
                    return task.result()
                self._check_health()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=10)

    async def _train_batch(
        self, rollout_id: int, n_samples: int, batch_size: int, weight_version: int | None, max_staleness: int | None
    ) -> TrainBatch:
        if self.settings.replay_archive:
            return self._replayed(n_samples, batch_size)
        self._check_health()
        consumer, journal = await self._ensure()
        if not self._sizes_checked:
            self._check_sizes(consumer.config, n_samples, batch_size, max_staleness)
            self._sizes_checked = True
        if weight_version is not None:
            await consumer.set_weight_version(weight_version)
        record = await journal.get(rollout_id)
        if record is not None:
            replay = self._replay(record, n_samples, batch_size)
            replay.metrics.update(self.extra_metrics() if self.extra_metrics else {})
            return replay
        if self._known_ids is None:
            self._known_ids = await journal.entry_ids()
        taken: list[tuple[bytes, Group]] = []
        batches: list[Any] = []
        metrics: dict[str, float] = {}
        skipped = 0
        while len(taken) < batch_size:
            batch = await self._take(consumer, batch_size - len(taken))
            await batch.fetch()  # arrays in the payload store: on every Sample (and in the journal) as inline
            batches.append(batch)
            if not metrics:
                metrics = dict(batch.metrics)
            for entry_id, group in zip(batch.entry_ids, batch.groups, strict=True):
                if entry_id in self._known_ids:
                    skipped += 1  # journaled by an earlier incarnation that died before committing
                    continue
                taken.append((entry_id, group))
        taken.sort(key=lambda item: item[1].index)
        metrics.update({"replayed": 0.0, "journal_duplicates_skipped": float(skipped)})
        record = JournalRecord(
            rollout_id=rollout_id,
            groups=[g for _, g in taken],
            entry_ids=[eid for eid, _ in taken],
            metrics=metrics,
        )
        await journal.put(record)
        self._known_ids.update(record.entry_ids)
        for batch in batches:
            await consumer.commit(batch)
        return TrainBatch(
            groups=record.groups, metrics={**metrics, **(self.extra_metrics() if self.extra_metrics else {})},
            replayed=False,
        )

    def _replay(self, record: JournalRecord, n_samples: int, batch_size: int) -> TrainBatch:
        sizes = {len(g.samples) for g in record.groups}
        if len(record.groups) != batch_size or sizes - {n_samples}:
            raise ConfigError(
                f"rollout {record.rollout_id} was journaled with {len(record.groups)} groups of {sorted(sizes)} "
                f"samples but this run asks for {batch_size} groups of {n_samples}: resume with the sizes the "
                f"checkpoint was trained with"
            )
        logger.info(
            "rollout %d: training the %d groups an earlier incarnation took for it (journal %s)",
            record.rollout_id, len(record.groups), journal_key(self.settings.namespace, self.settings.consumer_name),
        )
        return TrainBatch(groups=record.groups, metrics={**record.metrics, "replayed": 1.0}, replayed=True)

    async def _save(self, rollout_id: int, checkpoint_dir: str | None = None) -> None:
        if self.settings.replay_archive:
            return  # nothing was taken from Redis
        _, journal = await self._ensure()
        if checkpoint_dir:
            await save_stats(journal.redis, self.settings.namespace, rollout_id, checkpoint_dir)
        meta = await journal.meta()
        meta.checkpoints = sorted({*meta.checkpoints, rollout_id})[-self.settings.keep_checkpoints :]
        oldest = meta.checkpoints[0]
        dropped = await journal.trim_through(oldest)
        meta.trimmed_through = max(oldest, meta.trimmed_through if meta.trimmed_through is not None else oldest)
        await journal.set_meta(meta)
        logger.info(
            "checkpoint %d saved: journal forgets rollouts <= %d (%d dropped); resumable checkpoints %s",
            rollout_id, oldest, dropped, meta.checkpoints,
        )

    async def _load(self, rollout_id: int | None, checkpoint_dir: str | None = None) -> None:
        if self.settings.replay_archive:
            # rollouts count from 0, recorded steps from 1: resume after the checkpoint's rollout
            self.loaded_from = None if rollout_id is None or rollout_id < 0 else rollout_id
            if self.loaded_from is not None:
                self._replaying().seek(self.loaded_from + 2)
            return
        _, journal = await self._ensure()
        meta = await journal.meta()
        pending = await journal.rollout_ids()
        if rollout_id is None or rollout_id < 0:
            self.loaded_from = None
            if pending:
                logger.warning(
                    "starting without a checkpoint, but the journal holds rollouts %s of an earlier run: "
                    "those rollout ids train the groups journaled for them", pending,
                )
            return
        self.loaded_from = rollout_id
        if checkpoint_dir:
            await load_stats(journal.redis, self.settings.namespace, rollout_id, checkpoint_dir)
        trimmed = meta.trimmed_through
        if trimmed is not None and trimmed > rollout_id:
            message = (
                f"resuming from checkpoint {rollout_id}, but the journal already forgot rollouts up to {trimmed} "
                f"(it keeps the last {self.settings.keep_checkpoints} checkpoints: {meta.checkpoints}); the groups "
                f"of rollouts {rollout_id + 1}..{trimmed} cannot be trained again"
            )
            if not self.settings.allow_journal_gap:
                raise ConfigError(
                    f"{message}. Resume from checkpoint {meta.checkpoints[0] if meta.checkpoints else trimmed}, "
                    f"raise {KEEP_CHECKPOINTS} for the future, or set {ALLOW_JOURNAL_GAP}=1 to accept the loss"
                )
            logger.error("%s (%s=1)", message, ALLOW_JOURNAL_GAP)
        replay = [r for r in pending if r > rollout_id]
        logger.info(
            "resuming after checkpoint %d: rollouts %s replay their journaled groups, later ones take new groups",
            rollout_id, replay,
        )
