"""The producer: admit prompts, generate ``n`` samples each, score them, publish the group.

One asyncio process, several cooperating loops (all tasks referenced, all cancelled on exit):

* **admission**: waits for room for ``n`` samples under ``concurrency``, then runs the ADMIT
  script for as many prompts as it has room for (``free samples // n``); ADMIT reads them
  (retry stream first) only if the pipeline is not paused, the ready backlog is under
  ``max_backlog`` and staleness-aware admission allows it, and at most as many as the rule
  allows. Nothing blocks the event loop and nothing is buffered: a prompt is read only when it
  can start at once. The last refusal and since when go into the heartbeat.
* **work**: one task per admitted prompt, running its ``n`` episodes (the generate function,
  :mod:`.rollout`); publishing the group and acknowledging the prompt is
  one Lua script that checks the XACK first, so a prompt taken over by another producer is
  never published twice. Capacity goes back **per episode**: as each member's episode (for the
  default rollout: its engine request) ends, its unit is free for the next admission, except
  the group's last unit, held until the group is published (so groups being scored or
  published count too, and prompts in flight never exceed ``concurrency``). A long-tailed group
  holds one unit, not ``n``, while its slowest sample runs.
* **leases**: renews the lease of every prompt it works on (XCLAIM JUSTID of its own ids), from
  a thread of its own with its own Redis connection (:mod:`.renewal`): a rollout that blocks the
  event loop costs its own prompt's time, never the leases of the others.
* **watchdog**: measures the loop's lag (:mod:`rollstream.common.watchdog`); a stall over
  ``--loop-stall-after`` is logged once with the code that held the loop, counted in the
  heartbeat and the metrics.
* **reclaim**: XAUTOCLAIM, keeping its cursor, takes over prompts idle past the lease
  (a producer that died); on Redis 6.2 deleted entries come back without fields and are
  acknowledged and skipped.
* **heartbeat** and **control** (pub/sub: pause, resume and new versions wake admission at once).

SIGTERM/SIGINT drain: stop admitting, wait up to ``drain_timeout`` for in-flight groups, then
return the unfinished prompts to the stream. A fatal error (an engine that keeps failing, an
engine whose replies are all unusable, a broken reward function) is recorded in ``events`` with
its traceback, the prompts go back, and :meth:`Producer.run` raises it so the process exits
non-zero; so is an error while starting.
One bad prompt is never fatal: an undecodable entry is dead-lettered, and a failed sample or
reward fails the group (:mod:`.rollout`), which the consumer recycles. Every loop checks once per
turn whether it was cancelled, and cancelled tasks get :data:`TASK_EXIT_TIMEOUT` seconds to end,
so no library swallowing a cancellation can hang the process.

Every loop is one turn repeated by :meth:`~rollstream.common.connection.Outage.forever` (the one
resilient loop step: a transient Redis error is logged once, backed off, and the next turn
follows). The settings live in :mod:`.settings`, the capacity and the prompts held in
:mod:`.capacity`, the rollout in :mod:`.rollout`. Why this module stays over 500 lines: it is one
class whose loops share its state (capacity, the prompts held, the outage, the stop event) and
whose Redis calls are the protocol's call sites; cutting it into mixins would spread that state
over several files without making any loop shorter.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
import traceback
from collections.abc import Mapping
from typing import Any

from redis.asyncio import Redis
from rollstream.common import bias
from rollstream.common.attempts import exhausted, mark_weight_update
from rollstream.common.cancellation import raise_if_cancelled
from rollstream.common.codec import DEFAULT_LIMITS, decode_prompt_entry, group_fields, group_too_large, prompt_fields
from rollstream.common.config import PipelineConfig
from rollstream.common.connection import (
    TRANSIENT_ERRORS,
    Outage,
    connect,
    redact_url,
)
from rollstream.common.errors import (
    DecodeError,
    EpisodeDrained,
)
from rollstream.common.eval_lane import eval_settings
from rollstream.common.events import DRAIN, FATAL, START, STOP, now_ms, record_event
from rollstream.common.keys import Keys
from rollstream.common.logs import Prefixed
from rollstream.common.models import Prompt, Status
from rollstream.common.namespace import load_config
from rollstream.common.protocol import (
    Admitted,
    Control,
    EngineRegistry,
    EpisodeJournals,
    Heartbeat,
    Heartbeats,
    NamespaceLimits,
    PromptQueue,
    TrainerMonitor,
)
from rollstream.common.watchdog import LoopWatchdog, Stall, default_stall_after

from .capacity import Capacity, Work
from .durable import PromptJournal
from .engine import EngineClient
from .renewal import Renewer
from .rewards import RewardFunction
from .rollout import Rollout
from .session import RESUME_POLL
from .settings import ProducerSettings
from .shared_limits import SharedLimits
from .teacher import TeacherScorer
from .telemetry import Metrics

logger = logging.getLogger(__name__)

STARTUP_REDIS_WAIT = 60.0
"""Seconds a starting producer waits for an unreachable Redis before it gives up."""
BACKLOG_RETRY = 2.0
"""Seconds before a producer refused for a full backlog runs ADMIT again, unless a control
message (a ``take()``'s ``taken``, pause, resume, version) wakes it first. Was 0.2 s of polling:
with 1,024 producers that is 5,120 ADMITs a second while the trainer trains (docs/scale.md)."""
TASK_EXIT_TIMEOUT = 5.0
"""Seconds the runtime waits for cancelled tasks to end before it abandons them (logged)."""


class Producer:
    """A rollout producer. ``await Producer.connect(...)``, then ``await producer.run()``."""

    def __init__(
        self,
        redis_url: str,
        settings: ProducerSettings,
        engine: EngineClient,
        reward: RewardFunction,
        config: PipelineConfig,
        redis: Redis,
        blocking: Redis,
        metrics: Metrics | None = None,
        teacher: TeacherScorer | None = None,
    ) -> None:
        self.url = redis_url
        self.settings = settings
        self.engine = engine
        self.reward = reward
        self.config = config
        self.keys = Keys(settings.namespace)
        self.redis = redis
        self._blocking = blocking
        self.prompts = PromptQueue(redis, self.keys, settings.name)
        self.journals = EpisodeJournals(redis, self.keys, settings.name)
        self.control = Control(redis, self.keys)
        self.monitor = TrainerMonitor(redis, self.keys)
        """The bias ledger's counts of the prompts this producer dead-letters (issue 38)."""
        self.heartbeats = Heartbeats(redis, self.keys)
        self.registry = EngineRegistry(redis, self.keys)
        self._registry_skipped: set[str] = set()
        self.metrics = metrics if metrics is not None else Metrics()
        self.name = settings.name
        self.log = Prefixed(logger, "producer", settings.name, settings.namespace)
        self.rollout = Rollout(
            engine,
            reward,
            config.n_samples_per_prompt,
            settings.episodes,
            partial_rollout=config.partial_rollout,
            producer=settings.name,
            metrics=self.metrics,
            teacher=teacher,
            wait_resumed=self._wait_resumed,
        )
        self._control_changed = asyncio.Event()
        """Set (and replaced) on every control message: wakes episodes waiting for a resume."""
        self._capacity = Capacity(settings.concurrency)
        self._work: dict[bytes, Work] = {}
        self._abandoned: set[asyncio.Task[Any]] = set()
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._fatal: BaseException | None = None
        self._fatal_tb = ""
        self._state = "starting"
        self._reclaim_due = False
        self._reclaim_seen_ms = 0
        """The newest ``reclaim_due_ms`` this producer acted on (0 at start: its first turn acts on
        an earlier find once, harmlessly: XAUTOCLAIM finds nothing left)."""
        self._outage = Outage(logger, f"producer {self.name}")
        self._blocked_since: float | None = None
        self._refusal = ""
        self._refusal_since_ms = 0
        self._blocked_total = 0.0
        self._blocked_reported = 0.0
        self._started = time.time()
        self.published = 0
        self.duplicates = 0
        self.reclaimed = 0
        self.returned = 0
        self._publish_times: list[float] = []
        self.watchdog = LoopWatchdog(
            f"producer {self.name}",
            settings.loop_stall_after or default_stall_after(config.lease_seconds),
            logger,
            on_stall=self._stalled,
            on_lag=self.metrics.loop_lag,
        )
        self._renewer: Renewer | None = None
        self.limits = SharedLimits(NamespaceLimits(redis, self.keys), self.name, config.lease_seconds)
        """The namespace's limits and rates, held by the episodes (``episode.limit`` / ``rate``)."""
        self.rollout.runtime.shared = self.limits
        self.durable = config.durable_episodes and self.rollout.journals
        self._warm_size = settings.warm if self.rollout.warm is not None else 0
        """Warm pools: prompts admitted beyond the concurrency (the generate function has a prepare hook)."""
        self._warming: set[bytes] = set()
        self._warm_changed = asyncio.Event()
        """Durable episodes apply: the namespace has them on and the rollout is the user's."""

    @classmethod
    async def connect(
        cls,
        redis_url: str,
        settings: ProducerSettings,
        engine: EngineClient,
        reward: RewardFunction,
        metrics: Metrics | None = None,
        teacher: TeacherScorer | None = None,
    ) -> Producer:
        redis = connect(redis_url, name=f"rollstream-producer-{settings.name}")
        try:
            # A producer (re)started by its supervisor while Redis restarts waits for it.
            config = await Outage(logger, f"producer {settings.name}").run(
                lambda: load_config(redis, Keys(settings.namespace)), give_up_after=STARTUP_REDIS_WAIT
            )
            settings.check(config)
        except BaseException:
            await redis.aclose()
            raise
        blocking = connect(redis_url, block_ms=2000, name=f"rollstream-producer-{settings.name}-wait")
        return cls(redis_url, settings, engine, reward, config, redis, blocking, metrics, teacher)

    # -- public -------------------------------------------------------------------------

    @property
    def in_flight_samples(self) -> int:
        return self._capacity.total - self._capacity.free

    def stop(self) -> None:
        """Ask for a drain: stop admitting, finish or return what is in flight."""
        if not self._stopping.is_set():
            self.log.info("drain requested")
        self._stopping.set()
        self._wake.set()
        self._capacity.wake()
        if self.durable:  # episodes stop at a step boundary; their journals go back with the prompts
            self.rollout.runtime.stop_episodes()

    async def run(self) -> None:
        """Run until :meth:`stop` (returns) or a fatal error (raises it, after recording it)."""
        n = self.config.n_samples_per_prompt
        self.log.info(
            "starting: concurrency %d samples, n=%d, engines %s",
            self.settings.concurrency, n,
            ", ".join(redact_url(u) for u in self.engine.settings.all_urls),
        )
        # The heartbeat outlives the other loops: operators see "draining" during the drain.
        heartbeat: asyncio.Task[None] | None = None
        loops: list[asyncio.Task[None]] = []
        stopper = asyncio.create_task(self._stopping.wait(), name="stop-wait")
        try:
            await self.engine.prepare()  # the tokenizer: the first prompt must not wait for it
            await self.engine.check_versions()  # says once if no engine reports weight versions
            self._state = "running"
            watchdog = asyncio.create_task(self.watchdog.run(), name="watchdog")
            loops.append(watchdog)
            self._renewer = Renewer(
                self.url, self.keys, self.name,
                self.settings.renew_interval or self.config.lease_seconds / 3,
                self._leases_lost, self._set_fatal, asyncio.get_running_loop(),
            )
            self._renewer.start()
            await self._outage.run(lambda: record_event(self.redis, self.keys, START, source=self.name))
            await self._outage.run(self._follow_registry)
            await self._outage.run(self._follow_weights)
            await self._outage.run(self._heartbeat_once)
            await self._outage.run(self.limits.refresh)
            await self._adopt_own_pending()
            heartbeat = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")
            loops += [
                asyncio.create_task(self._admission_loop(), name="admission"),
                asyncio.create_task(self._reclaim_loop(), name="reclaim"),
                asyncio.create_task(self._control_loop(), name="control"),
                asyncio.create_task(self._limits_loop(), name="limits"),
            ]
            done, _ = await asyncio.wait([stopper, heartbeat, *loops], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopper and not task.cancelled() and (error := task.exception()) is not None:
                    self._set_fatal(error)
        except Exception as exc:  # a failure while starting is as fatal as one while running
            self._set_fatal(exc)
        finally:
            stopper.cancel()
            await self._cancel_and_wait([stopper, *loops], "loops")
            try:
                await self._shutdown()
            finally:
                if self._renewer is not None:  # after the shutdown: the drain's prompts are renewed
                    await asyncio.to_thread(self._renewer.close)
                try:
                    await self._close_generate()
                finally:
                    if heartbeat is not None:
                        await self._cancel_and_wait([heartbeat], "heartbeat")
        if self._fatal is not None:
            raise self._fatal

    async def aclose(self) -> None:
        await self.redis.aclose()
        await self._blocking.aclose()

    async def _close_generate(self) -> None:
        """Close the rollout plug-in (its endpoint server) once its episodes ended; a failure to
        close is logged, never fatal: the work is done."""
        try:
            await self.rollout.aclose()
        except Exception as exc:
            self.log.warning("closing the generate function failed: %s", exc)

    async def _cancel_and_wait(self, tasks: list[asyncio.Task[Any]], what: str) -> None:
        """Cancel ``tasks`` and wait for them, at most :data:`TASK_EXIT_TIMEOUT` seconds: one
        that does not end (a library swallowed its cancellation) is logged and left behind,
        referenced, rather than hanging the shutdown."""
        for task in tasks:
            task.cancel()
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=TASK_EXIT_TIMEOUT)
        for task in pending:
            self._abandoned.add(task)
            task.add_done_callback(self._abandoned.discard)
            self.log.warning(
                "%s task %s did not end %.0f s after its cancellation; left behind",
                what, task.get_name(), TASK_EXIT_TIMEOUT,
            )

    def _set_fatal(self, exc: BaseException) -> None:
        if self._fatal is None:
            self._fatal = exc
            self._fatal_tb = "".join(traceback.format_exception(exc))
            self.log.error("fatal error: %s", exc)
        self._stopping.set()
        self._wake.set()
        self._capacity.wake()

    async def _nap(self, seconds: float) -> None:
        """Sleep up to ``seconds``; a control message, a stop or a finished reclaim wakes it early."""
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()

    async def _wait_resumed(self) -> None:
        """Return once the pipeline is not paused: an episode whose engine call was aborted (a
        weight update) continues after the resume. Woken by control messages, else polled."""
        while await self._outage.run(self.control.paused):
            changed = self._control_changed
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RESUME_POLL):
                    await changed.wait()

    # -- admission ----------------------------------------------------------------------

    def _blocked(self, blocked: bool, reason: str = "") -> None:
        now = time.monotonic()
        if blocked and self._blocked_since is None:
            self._blocked_since = now
        elif not blocked and self._blocked_since is not None:
            self._blocked_total += now - self._blocked_since
            self._blocked_since = None
        if reason != self._refusal:
            self._refusal = reason
            self._refusal_since_ms = now_ms() if reason else 0

    async def _admission_loop(self) -> None:
        await self._outage.forever(self._admission_turn)

    async def _admission_turn(self) -> bool:
        """One ADMIT round: wait for room for ``n`` samples, admit as many prompts as there is room
        for, start them; then wait as the answer says (new prompts, a full backlog, staleness).
        False when it asked Redis nothing."""
        n = self.config.n_samples_per_prompt
        if self._reclaim_due:  # prompts of a dead producer come first
            await self._nap(0.2)
            return False
        if self._warm_size and not self._stopping.is_set() and (self._warming or self._capacity.free < n):
            return await self._warm_turn()
        if self._stopping.is_set() or not await self._capacity.take(n, self._stopping):
            await asyncio.Future()  # draining: nothing more is admitted; the drain cancels this loop
        extra = self._capacity.free // n  # as many prompts as there is room for, in one round trip
        self._capacity.free -= extra * n
        held = count = 1 + extra
        try:
            with self._claiming():
                admission = await self._outage.run(lambda: self.prompts.admit(self.config, count))
                version = admission.weight_version
                if self.config.max_staleness is not None and version is not None:  # a refusal has none
                    self.engine.set_trainer_version(version, self.config.max_staleness)
                for item in admission.entries:
                    self._start_work(item, version or 0)
                    held -= 1
        finally:
            if held:
                self._capacity.give(held * n)
        return await self._admitted(admission.status)

    async def _warm_turn(self) -> bool:
        """Warm pools (``--warm K``): no room, so admit one prompt beyond the concurrency while
        fewer than K wait for room (its prepare hook runs meanwhile); else wait for one to start."""
        if len(self._warming) >= self._warm_size:
            self._warm_changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._warm_changed.wait()
            return False
        with self._claiming():
            admission = await self._outage.run(lambda: self.prompts.admit(self.config, 1))
            for item in admission.entries:
                self._start_work(item, admission.weight_version or 0, warming=True)
        return await self._admitted(admission.status)

    async def _admitted(self, status: str) -> bool:
        """After an ADMIT: wait as its answer says (new prompts, a full backlog, staleness)."""
        if status == "ok":
            self._blocked(False)
        elif status == "empty":
            self._blocked(False)
            await self._wait_for_prompts()
        else:
            self._blocked(True, status)
            self.metrics.admission_blocked(status)
            await self._nap(BACKLOG_RETRY if status == "backlog" else 0.2 if status == "backlog_bytes" else 1.0)
        return True

    async def _wait_for_prompts(self) -> None:
        """Block (on the blocking client) until a new prompt is added, or briefly time out."""
        self._wake.clear()
        read = asyncio.create_task(
            self.prompts.wait_for_new(self._blocking, block_ms=1000), name="wait-prompts"
        )
        wake = asyncio.create_task(self._wake.wait(), name="wait-wake")
        try:
            await asyncio.wait([read, wake], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (read, wake):
                task.cancel()
            results = await asyncio.gather(read, wake, return_exceptions=True)
        if isinstance(results[0], TRANSIENT_ERRORS):
            await self._outage.failed(results[0])

    def _start_work(self, item: Admitted, version: int, *, warming: bool = False) -> None:
        """Run a prompt whose ``n`` units of capacity were just taken (``warming``: none yet, its
        task takes them once its prepare hook started)."""
        work = Work(
            stream=item.stream, prompt_id=item.entry_id, fields=item.fields, version=version,
            held=0 if warming else self.config.n_samples_per_prompt, warming=warming,
        )
        if warming:
            self._warming.add(work.prompt_id)
        self._hold(work)
        work.task = asyncio.create_task(self._run_work(work), name=f"work-{item.entry_id.decode()}")

    def _hold(self, work: Work) -> None:
        """List a prompt as held: its lease is renewed until :meth:`_drop`."""
        self._work[work.prompt_id] = work
        if self._renewer is not None:
            self._renewer.hold(work.stream, work.prompt_id)

    def _claiming(self) -> contextlib.AbstractContextManager[None]:
        """Around a call that claims prompts (ADMIT, XAUTOCLAIM, adoption) until they are held."""
        return self._renewer.claiming() if self._renewer is not None else contextlib.nullcontext()

    def _drop(self, work: Work) -> None:
        """A prompt's last script returned: no longer held, no longer renewed. (Renewing goes on
        until then: the loop may stall between the call and the script, see :mod:`.renewal`.)"""
        self._work.pop(work.prompt_id, None)
        self._done_warming(work)
        if self._renewer is not None:
            self._renewer.release(work.prompt_id)

    def _done_warming(self, work: Work) -> None:
        if work.prompt_id in self._warming:
            self._warming.discard(work.prompt_id)
            self._warm_changed.set()

    # -- one prompt ---------------------------------------------------------------------

    def _sample_done(self, work: Work, samples: int) -> None:
        """Give back the units of finished samples, keeping one until the group is published."""
        units = min(samples, work.held - 1)
        if units > 0:
            work.held -= units
            self._capacity.give(units)

    async def _run_work(self, work: Work) -> None:
        finished = False
        try:
            try:
                prompt = decode_prompt_entry(work.fields, DEFAULT_LIMITS)
            except DecodeError as exc:
                await self._dead_letter_prompt(work, f"{exc.reason}: {exc.detail}")
                finished = True
                return
            work.prompt = prompt
            started_ms = now_ms()
            if not prompt.admitted_ms:  # its first admission: kept across its attempts (lateness, issue 38)
                prompt.admitted_ms = started_ms
            work.prepared = self.rollout.prepare(prompt, work.version)  # warm pools: ahead of the episodes
            if work.warming:  # admitted beyond the concurrency: wait for room
                if not await self._capacity.take(self.config.n_samples_per_prompt, self._stopping):
                    return  # draining: the shutdown returns it and releases what it prepared
                work.held, work.warming = self.config.n_samples_per_prompt, False
                self._done_warming(work)
            journal = await self._journal(work, prompt) if self.durable else None
            try:
                group = await self.rollout.run(
                    prompt, work.version, lambda k: self._sample_done(work, k), journal, work.prepared
                )
            except EpisodeDrained:
                self.log.info("prompt %d stopped by the drain; its journal goes back with it", prompt.index)
                return
            group.generated_ms = max(1, now_ms() - started_ms)
            if group.status == Status.ABORTED and await self._outage.run(
                lambda: self.control.updated_since(work.version)
            ):
                # The engine aborted during a weight update: the pipeline's cadence, the attempt is kept.
                mark_weight_update(group)
            if (dead := exhausted(group, self.config)) is not None:
                # No take() would accept it (past max_attempts): dead-lettered here, not left in the backlog.
                reason, last = dead
                self.log.warning(
                    "prompt %d dead-lettered after %d attempts: %s",
                    last.index, last.attempt, "; ".join(last.history),
                )
                if await self._dead_letter_prompt(work, reason, prompt_fields(last), log=False):
                    await self._outage.run(lambda: self.monitor.add_bias(bias.deltas(group, "dead")))
                finished = True
                return
            fields = group_fields(group)
            if work.stream == self.keys.eval_prompts:  # the eval lane: its name and the trainer's step beside
                lane = eval_settings(prompt)
                step = await self._outage.run(self.prompts.trained_steps)
                fields = {**fields, "eval": lane.name if lane is not None else "", "step": step}
            if (too_large := group_too_large(fields, self.config.max_group_bytes)) is not None:
                await self._dead_letter_prompt(work, too_large)
                finished = True
                return
            work.finishing = True
            result = await self._outage.run(
                lambda: self.prompts.publish(work.stream, work.prompt_id, fields, self._journal_key(work))
            )
            finished = True
            if result is None:
                self.duplicates += 1
                self.log.warning(
                    "prompt %d was taken over by another producer; duplicate group discarded",
                    prompt.index,
                )
            else:
                self.published += 1
                self._publish_times.append(time.monotonic())
                self.metrics.group_published(group)
        except Exception as exc:  # an engine that keeps failing, a broken reward, ...: fatal
            self._set_fatal(exc)
        finally:
            if finished:  # otherwise the prompt stays listed, and the shutdown returns it
                self._drop(work)
                await self._release_prepared(work)
            else:
                work.finishing = False
            self._capacity.give(work.held)
            work.held = 0

    async def _dead_letter_prompt(
        self, work: Work, reason: str, fields: Mapping[Any, Any] | None = None, *, log: bool = True
    ) -> bool:
        """Dead-letter the prompt with ``fields`` (default: the entry as read) and ``reason``;
        False when it was no longer ours (taken over)."""
        if log:
            self.log.warning("prompt entry %s dead-lettered: %s", work.prompt_id, reason)
        work.finishing = True
        written = work.fields if fields is None else fields
        journal = self._journal_key(work)
        return await self._outage.run(
            lambda: self.prompts.dead_letter(work.stream, work.prompt_id, written, reason, journal)
        )

    def _journal_key(self, work: Work) -> str | None:
        """The prompt's episode journal, deleted with its publish or dead letter (durable episodes)."""
        if not self.durable or work.prompt is None:
            return None
        return self.keys.episode(work.prompt.index, work.prompt.epoch)

    async def _journal(self, work: Work, prompt: Prompt) -> PromptJournal:
        """The prompt's episode journal as another producer left it (``{}`` when fresh), and its
        writer: appends name this attempt's entry, so they stop when the lease is lost."""
        index, epoch = prompt.index, prompt.epoch
        steps = await self._outage.run(lambda: self.journals.load(index, epoch))
        if steps:
            self.log.info("prompt %d resumes from its journal (%s steps)", index,
                          ", ".join(f"member {m}: {len(s)}" for m, s in sorted(steps.items())))

        async def append(member: int, seq: int, step: bytes) -> str:
            return await self.journals.append(
                stream=work.stream, entry_id=work.prompt_id, index=index, epoch=epoch, member=member, seq=seq,
                budget=self.config.max_backlog_bytes, step=step,
            )

        return PromptJournal(steps, append, self.journals.count_diverged, self.rollout.runtime.journal,
                             f"producer {self.name}: prompt {index}")

    # -- leases, reclaim ----------------------------------------------------------------

    async def _adopt_own_pending(self) -> None:
        """Prompts pending under this name (a restart with the same ``--name``) are ours now."""
        with self._claiming():
            claimed = await self._outage.run(self.prompts.own_pending)
            if claimed:
                self.log.info("adopting %d prompts pending under its name", len(claimed))
                await self._take_over(claimed)

    async def _take_over(self, claimed: list[Admitted]) -> None:
        n = self.config.n_samples_per_prompt
        version = await self._trainer_version()
        for item in claimed:
            if not item.fields:
                await self._outage.run(functools.partial(self.prompts.ack_deleted, item.stream, item.entry_id))
                continue
            if item.entry_id in self._work:
                continue
            if not await self._capacity.take(n, self._stopping):
                # Stopping: no room will come. Listed without a task, the shutdown hands it back.
                self._hold(Work(stream=item.stream, prompt_id=item.entry_id, fields=item.fields, version=version))
                continue
            self.reclaimed += 1
            self._start_work(item, version)
            # Only a counter, but a Redis outage here must not become a fatal error.
            await self._outage.run(self.prompts.count_reclaimed)

    async def _trainer_version(self) -> int:
        return await self._outage.run(self.control.weight_version)

    def _leases_lost(self, lost: list[bytes]) -> None:
        """The renewal thread found prompts no longer ours (taken over after the lease)."""
        for pid in lost:
            work = self._work.get(pid)
            if work is not None and not work.lease_lost and not work.finishing:
                work.lease_lost = True
                self.log.warning(
                    "lost the lease of prompt entry %s (taken over after %.0f s idle)",
                    pid.decode(), self.config.lease_seconds,
                )

    async def _reclaim_loop(self) -> None:
        """Take over prompts idle past the lease; while some are due, admission holds off so the
        next free capacity goes to them (a dead producer's prompts do not wait behind new ones).

        Looking for idle prompts walks the whole pending list, so one producer per interval does
        it for the fleet (``reclaim_turn``) and, when it finds some, records when
        (``announce_reclaim``): every producer sees it at its next turn and reclaims what it has
        room for. With P producers the looks cost P times less than one per producer
        (docs/scale.md)."""

        def give_up() -> None:
            self._reclaim_due = False

        await self._outage.forever(self._reclaim_turn, on_error=give_up)

    async def _reclaim_turn(self) -> bool:
        n = self.config.n_samples_per_prompt
        interval = self.settings.reclaim_interval or min(5.0, self.config.lease_seconds / 4)
        lease_ms = int(self.config.lease_seconds * 1000)
        if not self._reclaim_due:
            await asyncio.sleep(interval)
        if self._stopping.is_set():
            self._reclaim_due = False
            return False
        if not self._reclaim_due:
            my_turn, found_ms = await self.prompts.reclaim_turn(int(interval * 900))
            if found_ms > self._reclaim_seen_ms:  # another producer found idle prompts
                self._reclaim_seen_ms = found_ms
                self._reclaim_due = True
            elif not my_turn:
                return False
        if await self.control.paused():
            self._reclaim_due = False
            return False
        if not self._reclaim_due:
            if not await self.prompts.any_idle(lease_ms):
                return False
            self._reclaim_due = True
            await self.prompts.announce_reclaim()
            self._reclaim_seen_ms = now_ms()  # its own find: already acting on it
        await self._capacity.room(n, self._stopping)
        with self._claiming():
            claimed = await self.prompts.reclaim(lease_ms, count=self._capacity.free // n, held=self._work)
            self._outage.recovered()  # before the take-over, whose own calls ride out an outage
            if claimed:
                self.log.info(
                    "reclaimed %d prompts idle past the %.0f s lease",
                    len(claimed), self.config.lease_seconds,
                )
                await self._take_over(claimed)
        if not claimed and self.prompts.reclaim_scanned:
            self._reclaim_due = False  # scanned to the end: nothing left to take over
        if not self._reclaim_due:
            self._wake.set()
        return False  # the outage ended above

    # -- heartbeat, control, limits ----------------------------------------------------

    async def _limits_loop(self) -> None:
        """Renew the namespace limit units held (a third of the lease) and re-read the sizes."""
        await self._outage.forever(self._limits_turn)

    async def _limits_turn(self) -> bool:
        await asyncio.sleep(self.config.lease_seconds / 3)
        await self.limits.renew()
        await self.limits.refresh()
        return True

    def _groups_last_minute(self) -> int:
        cutoff = time.monotonic() - 60
        self._publish_times = [t for t in self._publish_times if t >= cutoff]
        return len(self._publish_times)

    async def _heartbeat_once(self) -> None:
        if self._blocked_since is not None:
            now = time.monotonic()
            self._blocked_total += now - self._blocked_since
            self._blocked_since = now
        blocked_ms = int((self._blocked_total - self._blocked_reported) * 1000)
        long_requests, oldest_request = self.rollout.requests_older_than(self.settings.long_request_after)
        beat = Heartbeat(
            host=socket.gethostname(),
            pid=os.getpid(),
            state=self._state,
            in_flight_samples=self.in_flight_samples,
            in_flight_prompts=len(self._work),
            concurrency=self.settings.concurrency,
            published=self.published,
            groups_last_minute=self._groups_last_minute(),
            duplicates=self.duplicates,
            reclaimed=self.reclaimed,
            engine_retries=self.engine.retries,
            engines=[redact_url(u) for u in self.engine.settings.all_urls],
            started_ms=int(self._started * 1000),
            last_seen_ms=now_ms(),
            admission=self._refusal,
            admission_since_ms=self._refusal_since_ms,
            long_requests=long_requests,
            oldest_request_s=round(oldest_request, 1),
            long_request_s=self.settings.long_request_after,
            episodes=self.rollout.runtime.episodes,
            episodes_peak=self.rollout.runtime.episodes_peak,
            engine_requests=self.rollout.runtime.engine_requests,
            engine_requests_peak=self.rollout.runtime.engine_slots.peak,
            episodes_failed=self.rollout.episodes_failed,
            aborts_continued=self.rollout.runtime.aborts_continued,
            journal_steps=self.rollout.runtime.journal.journaled,
            replayed_steps=self.rollout.runtime.journal.replayed,
            episodes_resumed=self.rollout.runtime.journal.resumed,
            resume_diverged=self.rollout.runtime.journal.diverged,
            engine_fleet=self.engine.fleet_status(),
            loop_stalls=self.watchdog.stalls,
            loop_stall_s=round(self.watchdog.stall_seconds, 2),
            loop_stall_longest_s=self.watchdog.longest.seconds if self.watchdog.longest else 0.0,
            loop_stall_where=self.watchdog.longest.describe() if self.watchdog.longest else "",
            loop_lag_max_s=round(self.watchdog.take_max_lag(), 3),
            loop_stall_after_s=self.watchdog.threshold,
            weight_versions_from=self.engine.versions_from,
        )
        await self.heartbeats.write(self.name, beat, blocked_ms)
        self._blocked_reported += blocked_ms / 1000
        if blocked_ms > 0:
            self.metrics.admission_blocked_for(blocked_ms / 1000)

    def _stalled(self, stall: Stall) -> None:
        self.metrics.loop_stalled(stall.seconds)

    async def _heartbeat_loop(self) -> None:
        await self._outage.forever(self._heartbeat_turn, wrote=True)  # a write Redis refuses at maxmemory

    async def _heartbeat_turn(self) -> bool:
        await asyncio.sleep(self.settings.heartbeat_interval)
        await self._follow_registry()
        await self._follow_weights()
        await self._heartbeat_once()
        if self.metrics.wants_bias:
            self.metrics.bias(await self.monitor.bias())
        return True

    async def _follow_weights(self) -> None:
        """Where the trainer's weights are, for engines found behind (``--catch-up-engines``)."""
        if self.engine.settings.catch_up:
            self.engine.set_weights_source(await self.control.weights())

    async def _follow_registry(self) -> None:
        """The engine registry's changes to the fleet (``--engines-from-registry``); an entry that
        cannot be used is skipped, with a warning once."""
        if not self.settings.engines_from_registry:
            return
        entries = await self.registry.entries()
        for url, entry in entries.items():
            problem = entry.problem
            if problem and url not in self._registry_skipped:
                self._registry_skipped.add(url)
                self.log.warning("engine registry entry %r skipped: %s", url, problem)
        self.engine.apply_registry({url: e.state for url, e in entries.items() if not e.problem})

    async def _control_loop(self) -> None:
        """Wake admission at once on pause/resume/version/taken messages (the check itself is in ADMIT)."""
        await self._outage.forever(self._control_turn)

    async def _control_turn(self) -> bool:
        """Subscribe and listen until the subscription fails (a turn never returns otherwise)."""
        pubsub = await self.control.subscribe(self._blocking)
        try:
            while True:
                raise_if_cancelled()
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if message is not None:
                    self.log.debug("control message %r", message.get("data"))
                    self._wake.set()
                    changed, self._control_changed = self._control_changed, asyncio.Event()
                    changed.set()
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    # -- shutdown -----------------------------------------------------------------------

    async def _shutdown(self) -> None:
        work_tasks = [w.task for w in self._work.values() if w.task is not None]
        if self._fatal is None:
            self._state = "draining"
            self.log.info(
                "draining %d prompts (up to %.0f s)",
                len(work_tasks), self.settings.drain_timeout,
            )
            with contextlib.suppress(Exception):
                await self._heartbeat_once()
                await record_event(self.redis, self.keys, DRAIN, source=self.name)
            if work_tasks:
                await asyncio.wait(work_tasks, timeout=self.settings.drain_timeout)
        else:
            self._state = "failed"
        await self._cancel_and_wait(work_tasks, "work")
        await self._return_unfinished()
        if self._fatal is not None:
            await self._outage.run(
                lambda: record_event(
                    self.redis, self.keys, FATAL, source=self.name,
                    message=f"{type(self._fatal).__name__}: {self._fatal}", traceback=self._fatal_tb,
                ),
                give_up_after=30,
            )
        else:
            self._state = "stopped"
            with contextlib.suppress(*TRANSIENT_ERRORS):
                await record_event(
                    self.redis, self.keys, STOP, source=self.name,
                    message=f"published {self.published}, returned {self.returned}",
                )
        with contextlib.suppress(*TRANSIENT_ERRORS):
            await self._heartbeat_once()
        self.log.info(
            "%s: published %d groups, returned %d prompts, discarded %d duplicates",
            self._state, self.published, self.returned, self.duplicates,
        )

    async def _release_prepared(self, work: Work) -> None:
        """Release the prepared resources no episode of ``work`` took (warm pools)."""
        if work.prepared is not None:
            released = await work.prepared.release_unused()
            if released:
                logger.debug("producer %s: released %d unused prepared resource(s) of prompt entry %s",
                             self.name, released, work.prompt_id.decode())

    async def _give_back(self, work: Work) -> bool:
        work.finishing = True
        return await self.prompts.give_back(work.stream, work.prompt_id, work.fields)

    async def _return_unfinished(self) -> None:
        """Put the prompts still held into the retry stream, with their attempt unchanged."""
        for work in list(self._work.values()):
            try:
                returned = await self._outage.run(
                    functools.partial(self._give_back, work), give_up_after=30
                )
            except TRANSIENT_ERRORS:
                self.log.error(
                    "could not return prompt entry %s; it will be reclaimed after the lease",
                    work.prompt_id.decode(),
                )
                continue
            if returned:
                self.returned += 1
            self._drop(work)
            await self._release_prepared(work)

