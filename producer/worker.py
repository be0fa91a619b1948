"""The producer: admit prompts, generate ``n`` samples each, score them, publish the group.

One asyncio process, several cooperating loops (all tasks referenced, all cancelled on exit):

* **admission**: waits for room for ``n`` samples under ``concurrency``, then runs the ADMIT
  script for as many prompts as it has room for (``free samples // n``); ADMIT reads them
  (retry stream first) only if the pipeline is not paused, the ready backlog is under
  ``max_backlog`` and staleness-aware admission allows it. Nothing blocks the event loop and
  nothing is buffered: a prompt is read only when it can start at once.
* **work**: one task per admitted prompt, running its ``n`` episodes (:mod:`.rollout`);
  publishing the group and acknowledging the prompt is one Lua script that checks the XACK
  first, so a prompt taken over by another producer is never published twice. Capacity goes
  back **per episode**, except the group's last unit, held until the group is published (prompts
  in flight never exceed ``concurrency``; a long-tailed group holds one unit, not ``n``).
* **leases**: renewed from a thread of its own with its own Redis connection (:mod:`.renewal`).
* **reclaim** (:mod:`.reclaim`): prompts idle past the lease taken over; its own adopted at start.
* **heartbeat** (:mod:`.pulse`), **watchdog** (:mod:`rollstream.common.watchdog`), **limits**
  and **control** (pub/sub: pause, resume and new versions wake admission at once).

SIGTERM/SIGINT drain: stop admitting, wait up to ``drain_timeout`` for in-flight groups, then
return the unfinished prompts to the stream. A fatal error (an engine that keeps failing, a
broken reward function) is recorded in ``events`` with its traceback, the prompts go back, and
:meth:`Producer.run` raises it so the process exits non-zero; so is an error while starting.
One bad prompt is never fatal: an undecodable entry is dead-lettered, and a failed sample fails
the group, which the consumer recycles. Every loop is one turn repeated by
:meth:`~rollstream.common.connection.Outage.forever` (a transient Redis error is logged once,
backed off, and the next turn follows); cancelled tasks get :data:`TASK_EXIT_TIMEOUT` seconds to
end, so no library swallowing a cancellation can hang the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from array import array
from collections.abc import Mapping
from typing import Any

from redis.asyncio import Redis
from rollstream.common import bias
from rollstream.common.attempts import exhausted, mark_weight_update
from rollstream.common.cancellation import raise_if_cancelled
from rollstream.common.codec import (
    DEFAULT_LIMITS,
    StoreObject,
    decode_prompt_entry,
    group_fields,
    group_fields_offloaded,
    group_too_large,
    prompt_fields,
    prompt_fields_offloaded,
)
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
    PayloadError,
    PayloadStoreFull,
    PayloadUnreadable,
)
from rollstream.common.eval_lane import EVAL_KEY, eval_settings, strip_eval_mark
from rollstream.common.events import START, now_ms, record_event
from rollstream.common.keys import Keys
from rollstream.common.logs import Prefixed
from rollstream.common.models import MAX_HISTORY, Group, Prompt, Status
from rollstream.common.namespace import load_config
from rollstream.common.payload.plane import PayloadPlane
from rollstream.common.protocol import (
    Admission,
    Control,
    EngineRegistry,
    EpisodeJournals,
    Heartbeats,
    NamespaceLimits,
    PromptQueue,
    TrainerMonitor,
)
from rollstream.common.watchdog import LoopWatchdog, Stall, default_stall_after

from . import fault_points
from .capacity import Work, WorkTable
from .drain import cancel_and_wait, shutdown
from .durable import PromptJournal
from .engine import EngineClient
from .episode_runtime import RESUME_POLL
from .outcomes import FailureLog
from .pulse import Pulse
from .reclaim import Reclaimer
from .renewal import Renewer
from .rewards import RewardFunction
from .rollout import Rollout
from .settings import ProducerSettings
from .shared_limits import SharedLimits
from .teacher import TeacherScorer
from .telemetry import Metrics

logger = logging.getLogger(__name__)

STARTUP_REDIS_WAIT = 60.0
"""Seconds a starting producer waits for an unreachable Redis before it gives up."""
PUT_ATTEMPTS = 4
"""Tries of a put into a full payload store (backing off from :data:`PUT_BACKOFF_S`, doubling) before it is fatal."""
PUT_BACKOFF_S = 1.0
"""Seconds before the first retry of a put into a full or unreachable payload store (doubling after each)."""
BACKLOG_RETRY = 2.0
"""Seconds before a producer refused for a full backlog runs ADMIT again, unless a control
message (a ``take()``'s ``taken``, pause, resume, version) wakes it first. Was 0.2 s of polling:
with 1,024 producers that is 5,120 ADMITs a second while the trainer trains (docs/scale.md)."""


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
        self._outage = Outage(logger, f"producer {self.name}")
        self.table = WorkTable(
            settings.concurrency, self._outage, self.log,
            warm=settings.warm if self.rollout.warm is not None else 0,
        )
        """The work in flight (prompts held, capacity, stopping, fatal error), shared with the
        reclaim pass and the drain."""
        self.table.runner = self._run_work
        self._admitted_version: int | None = None
        """The trainer's version at the last admission (a change is a weight update's news)."""
        self.started = time.time()
        """When this producer started (wall clock, for its heartbeat)."""
        self.eval_marks_stripped = 0
        """Training prompts whose metadata carried the eval lane's reserved key (stripped, warned)."""
        self._stripped_log = FailureLog()
        self.payload_stats = {"objects_put": 0, "bytes_put": 0, "put_failures": 0, "orphans_swept": 0}
        """What this producer did with the payload store (its heartbeat's ``payload_*`` stats)."""
        self.reclaimer = Reclaimer(self)
        self.pulse = Pulse(self)
        self.metrics.watch(self.pulse.stats)
        self.watchdog = LoopWatchdog(
            f"producer {self.name}",
            settings.loop_stall_after or default_stall_after(config.lease_seconds),
            logger,
            on_stall=self._stalled,
            on_lag=self.metrics.loop_lag,
        )
        self.limits = SharedLimits(NamespaceLimits(redis, self.keys), self.name, config.lease_seconds)
        """The namespace's limits and rates, held by the episodes (``episode.limit`` / ``rate``)."""
        self.rollout.runtime.shared = self.limits
        self.durable = config.durable_episodes and self.rollout.journals
        """Durable episodes apply: the namespace has them on and the rollout is the user's."""
        self.plane = (
            PayloadPlane.open(config.payload_store, redis, self.keys, config.lease_seconds)
            if config.payload_store else None
        )
        """The namespace's payload store and its ledgers (None: every array rides in the entry)."""

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
        return self.table.in_flight_samples

    @property
    def published(self) -> int:
        return self.table.published

    @property
    def duplicates(self) -> int:
        return self.table.duplicates

    def stop(self) -> None:
        """Ask for a drain: stop admitting, finish or return what is in flight."""
        if not self.table.stopping.is_set():
            self.log.info("drain requested")
        self.table.stop()
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
        table = self.table
        stopper = asyncio.create_task(table.stopping.wait(), name="stop-wait")
        try:
            await self.engine.prepare()  # the tokenizer: the first prompt must not wait for it
            await self.engine.check_versions()  # says once if no engine reports weight versions
            table.state = "running"
            watchdog = asyncio.create_task(self.watchdog.run(), name="watchdog")
            loops.append(watchdog)
            table.renewer = Renewer(
                self.url, self.keys, self.name,
                self.settings.renew_interval or self.config.lease_seconds / 3,
                self.reclaimer.leases_lost, table.fail, asyncio.get_running_loop(),
            )
            table.renewer.start()
            await self._outage.run(lambda: record_event(self.redis, self.keys, START, source=self.name))
            await self._outage.run(self.pulse.follow_registry)
            await self._outage.run(self.pulse.follow_weights)
            await self._outage.run(self.pulse.write)
            await self._outage.run(self.limits.refresh)
            await self.reclaimer.adopt_own_pending()
            heartbeat = asyncio.create_task(self.pulse.loop(), name="heartbeat")
            loops += [
                asyncio.create_task(self._admission_loop(), name="admission"),
                asyncio.create_task(self.reclaimer.loop(), name="reclaim"),
                asyncio.create_task(self._control_loop(), name="control"),
                asyncio.create_task(self._limits_loop(), name="limits"),
            ]
            done, _ = await asyncio.wait([stopper, heartbeat, *loops], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopper and not task.cancelled() and (error := task.exception()) is not None:
                    table.fail(error)
        except Exception as exc:  # a failure while starting is as fatal as one while running
            table.fail(exc)
        finally:
            stopper.cancel()
            await cancel_and_wait(table, [stopper, *loops], "loops")
            try:
                await shutdown(self)
            finally:
                if table.renewer is not None:  # after the shutdown: the drain's prompts are renewed
                    await asyncio.to_thread(table.renewer.close)
                try:
                    await self._close_generate()
                finally:
                    if heartbeat is not None:
                        await cancel_and_wait(table, [heartbeat], "heartbeat")
        if table.fatal is not None:
            raise table.fatal

    async def aclose(self) -> None:
        try:
            if self.plane is not None:
                await self.plane.close()
        finally:
            await self.redis.aclose()
            await self._blocking.aclose()

    async def _close_generate(self) -> None:
        """Close the rollout plug-in (its endpoint server) once its episodes ended; a failure to
        close is logged, never fatal: the work is done."""
        try:
            await self.rollout.aclose()
        except Exception as exc:
            self.log.warning("closing the generate function failed: %s", exc)

    async def _nap(self, seconds: float) -> None:
        """Sleep up to ``seconds``; a control message, a stop or a finished reclaim wakes it early."""
        self.table.woken.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self.table.woken.wait()

    async def _wait_resumed(self) -> None:
        """Return once the pipeline is not paused: an episode whose engine call was aborted (a
        weight update) continues after the resume. Woken by control messages, else polled."""
        while await self._outage.run(self.control.paused):
            changed = self._control_changed
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RESUME_POLL):
                    await changed.wait()

    # -- admission ----------------------------------------------------------------------

    async def _admission_loop(self) -> None:
        await self._outage.forever(self._admission_turn)

    async def _admission_turn(self) -> bool:
        """One ADMIT round: wait for room for ``n`` samples, admit as many prompts as there is room
        for, start them; then wait as the answer says (new prompts, a full backlog, staleness).
        False when it asked Redis nothing."""
        n = self.config.n_samples_per_prompt
        table, capacity = self.table, self.table.capacity
        if self.reclaimer.due:  # prompts of a dead producer come first
            await self._nap(0.2)
            return False
        if table.warm and not table.stopping.is_set() and (table.warming or capacity.free < n):
            return await self._warm_turn()
        if table.stopping.is_set() or not await capacity.take(n, table.stopping):
            await asyncio.Future()  # draining: nothing more is admitted; the drain cancels this loop
        extra = capacity.free // n  # as many prompts as there is room for, in one round trip
        capacity.free -= extra * n
        held = count = 1 + extra

        async def admit() -> Admission:
            # the prompts are held before Outage.run returns: a cancellation it raises after a
            # successful ADMIT (one redis-py lost) leaves them to the drain, not to the lease
            nonlocal held
            admission = await self.prompts.admit(self.config, count)
            version = admission.weight_version
            if version is not None and version != self._admitted_version:
                if self._admitted_version is not None:  # the trainer moved: engines are read again
                    self.engine.versions_moved()
                self._admitted_version = version
            if self.config.max_staleness is not None and version is not None:  # a refusal has none
                self.engine.set_trainer_version(version, self.config.max_staleness)
            for item in admission.entries:
                table.start(item, version or 0, n)
                held -= 1
            return admission

        try:
            with table.claiming():
                admission = await self._outage.run(admit)
        finally:
            if held:
                capacity.give(held * n)
        return await self._admitted(admission.status)

    async def _warm_turn(self) -> bool:
        """Warm pools (``--warm K``): no room, so admit one prompt beyond the concurrency while
        fewer than K wait for room (its prepare hook runs meanwhile); else wait for one to start."""
        table = self.table
        if len(table.warming) >= table.warm:
            table.warm_changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await table.warm_changed.wait()
            return False
        async def admit() -> Admission:  # held inside the step, as in _admission_turn
            admission = await self.prompts.admit(self.config, 1)
            for item in admission.entries:
                table.start(item, admission.weight_version or 0, self.config.n_samples_per_prompt, warming=True)
            return admission

        with table.claiming():
            admission = await self._outage.run(admit)
        return await self._admitted(admission.status)

    async def _admitted(self, status: str) -> bool:
        """After an ADMIT: wait as its answer says (new prompts, a full backlog, staleness)."""
        if status == "ok":
            self.pulse.blocked(False)
        elif status == "empty":
            self.pulse.blocked(False)
            await self._wait_for_prompts()
        else:
            self.pulse.blocked(True, status)
            self.metrics.admission_blocked(status)
            await self._nap(
                BACKLOG_RETRY if status == "backlog" else 0.2 if status in ("backlog_bytes", "source_backlog") else 1.0
            )
        return True

    async def _wait_for_prompts(self) -> None:
        """Block (on the blocking client) until a new prompt is added, or briefly time out."""
        self.table.woken.clear()
        read = asyncio.create_task(
            self.prompts.wait_for_new(self._blocking, block_ms=1000), name="wait-prompts"
        )
        wake = asyncio.create_task(self.table.woken.wait(), name="wait-wake")
        try:
            await asyncio.wait([read, wake], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (read, wake):
                task.cancel()
            results = await asyncio.gather(read, wake, return_exceptions=True)
        if isinstance(results[0], TRANSIENT_ERRORS):
            await self._outage.failed(results[0])

    # -- one prompt ---------------------------------------------------------------------

    async def _run_work(self, work: Work) -> None:
        """One prompt, from its entry to its last script (a publish or a dead letter), when it is
        dropped; one stopped by the drain (or a fatal error) stays held, and the shutdown returns it."""
        try:
            await self._work_through(work)
        except Exception as exc:  # an engine that keeps failing, a broken reward, ...: fatal
            self.table.fail(exc)
        finally:
            if work.prompt_id in self.table:  # not ended: it stays listed, and the shutdown returns it
                work.finishing = False
            else:
                await self.table.release_prepared(work)
            self.table.give_back_units(work)

    async def _work_through(self, work: Work) -> None:
        try:
            prompt = decode_prompt_entry(work.fields, DEFAULT_LIMITS)
        except DecodeError as exc:
            await self._dead_letter_prompt(work, f"{exc.reason}: {exc.detail}")
            self.table.drop(work)
            return
        if work.stream != self.keys.eval_prompts and strip_eval_mark(prompt.metadata):
            # eval settings are the eval lane's alone: a training row must not steer its sampling
            self.eval_marks_stripped += 1
            self._stripped_log.report(
                "eval_mark",
                f"prompt {prompt.index}: a training prompt carried metadata[{EVAL_KEY!r}] (reserved for the "
                f"eval lane): ignored and stripped ({self.eval_marks_stripped} so far)",
            )
        if prompt.payload is not None:
            await self._fetch_partial(prompt)
        work.prompt = prompt
        started_ms = now_ms()
        if not prompt.admitted_ms:  # its first admission: kept across its attempts (lateness, issue 38)
            prompt.admitted_ms = started_ms
        work.prepared = self.rollout.prepare(prompt, work.version)  # warm pools: ahead of the episodes
        if work.warming:  # admitted beyond the concurrency: wait for room
            if not await self.table.capacity.take(self.config.n_samples_per_prompt, self.table.stopping):
                return  # draining: the shutdown returns it and releases what it prepared
            work.held, work.warming = self.config.n_samples_per_prompt, False
            self.table.done_warming(work)
        journal = await self._journal(work, prompt) if self.durable else None
        try:
            group = await self.rollout.run(
                prompt, work.version, lambda k: self.table.sample_done(work, k), journal, work.prepared
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
            fields, objects = await self._dead_prompt_fields(work, last)
            if await self._dead_letter_prompt(work, reason, fields, log=False, objects=objects):
                await self._outage.run(lambda: self.monitor.add_bias(bias.deltas(group, "dead")))
            elif objects:  # no longer ours: MOVE queued them to be freed
                await self._free_objects()
            self.table.drop(work)
            return
        fields, objects = await self._group_fields(work, prompt, group)
        if (too_large := group_too_large(fields, self.config.max_group_bytes)) is not None:
            await self._dead_letter_prompt(work, too_large)
            self.table.drop(work)
            return
        await self._publish(work, prompt, group, fields, objects)

    async def _fetch_partial(self, prompt: Prompt) -> None:
        """The arrays of ``prompt``'s partial samples read from the payload store (checksums
        verified) into them, so they can be continued; an object that cannot be read drops the
        partial samples (the prompt is generated again from scratch, the reason in its history),
        never continues a sample with a short or zeroed array. Not read when partial rollout is off
        here (nothing would continue them). The prompt's entry keeps the objects held either way:
        its PUBLISH (or any other fate) releases them."""
        payload, partial = prompt.payload, prompt.partial
        if payload is None or partial is None:
            return
        if not self.config.partial_rollout:  # nothing continues them: their placeholders go
            prompt.partial, prompt.payload = None, None
            return
        plane = self.plane
        try:
            if plane is None:
                raise PayloadUnreadable(
                    "(none)", payload.objects[0].key, "the namespace has no payload store any more"
                )
            # attach() puts each array into its sample (a view on the fetched object), the text decoded
            # (not UTF-8: PayloadCorrupt, dropped as an unreadable object is)
            payload.attach(
                Group(index=prompt.index, prompt=prompt.prompt, samples=partial), await plane.fetch(payload), plane.url
            )
        except PayloadError as exc:
            reason = f"payload: partial samples dropped, generated again: {exc}"
            self.log.warning("prompt %d: its partial samples cannot be read, generated again: %s", prompt.index, exc)
            prompt.partial, prompt.payload = None, None
            prompt.history = [*prompt.history, reason][-MAX_HISTORY:]
            if plane is not None:
                await self._outage.run(lambda: plane.ledger.read_failed(reason))
            return
        first = partial[0] if partial else None
        if prompt.input_ids is None and first is not None and first.prompt_length > 0:
            prompt.input_ids = array("i", first.tokens[: first.prompt_length])  # its ids were in the store too

    async def _group_fields(
        self, work: Work, prompt: Prompt, group: Group
    ) -> tuple[dict[str, Any], list[StoreObject]]:
        """The group's stream fields, and the payload objects its arrays went to (a store, not the
        eval lane); an eval-lane group carries its eval's name and the trainer's step."""
        objects: list[StoreObject] = []
        if self.plane is not None and work.stream != self.keys.eval_prompts:
            # arrays past --payload-min-bytes go to the store (the eval lane keeps its inline)
            fields, objects = group_fields_offloaded(group, self.config.payload_min_bytes, self.plane.new_key)
        else:
            fields = group_fields(group)
        if work.stream == self.keys.eval_prompts:  # the eval lane: its name and the trainer's step beside
            lane = eval_settings(prompt)
            step = await self._outage.run(self.prompts.trained_steps)
            fields = {**fields, "eval": lane.name if lane is not None else "", "step": step}
        return fields, objects

    async def _publish(
        self, work: Work, prompt: Prompt, group: Group, fields: dict[str, Any], objects: list[StoreObject]
    ) -> None:
        """Put the group's objects, then PUBLISH it (XACK-checked: a prompt taken over by another
        producer is discarded as a duplicate); the prompt is dropped once the script returned."""
        if objects:
            await self._put_objects(objects)  # before PUBLISH: a published group's objects exist
            fault_points.reached("after_put")
        work.finishing = True
        refs, journal = [o.ref for o in objects], self._journal_key(work)
        result = await self._outage.run(  # the prompt's own objects (work.fields' refs) are released with it
            lambda: self.prompts.publish(work.stream, work.prompt_id, fields, journal, refs, work.fields)
        )
        self.table.drop(work)
        if objects:
            fault_points.reached("after_publish")
        if result is None:
            self.table.duplicates += 1
            self.log.warning(
                "prompt %d was taken over by another producer; duplicate group discarded",
                prompt.index,
            )
            if objects:  # PUBLISH queued them to be freed: nothing refers to them
                await self._free_objects()
        else:
            self.table.published += 1
            self.pulse.group_published()
            self.metrics.group_published(group)

    async def _put_objects(self, objects: list[StoreObject]) -> None:
        """Put a group's payload objects (their intents first). A full or unreachable store is
        retried :data:`PUT_ATTEMPTS` times, backing off (the trainer's commits free room, a store
        process comes back), then raised: fatal, loudly (``--max-backlog-bytes`` below the store's
        size keeps it from filling)."""
        plane = self.plane
        if plane is None:  # only a plane makes objects: a namespace without a store never gets here
            raise RuntimeError("payload objects to put but no payload store is configured")
        for attempt in range(1, PUT_ATTEMPTS + 1):
            try:
                await self._outage.run(lambda: plane.put(objects))
                self.payload_stats["objects_put"] += len(objects)
                self.payload_stats["bytes_put"] += sum(o.ref.size for o in objects)
                return
            except PayloadError as exc:
                self.payload_stats["put_failures"] += 1
                if not isinstance(exc, PayloadStoreFull | PayloadUnreadable) or attempt == PUT_ATTEMPTS:
                    raise
                delay = PUT_BACKOFF_S * 2 ** (attempt - 1)
                what = "full" if isinstance(exc, PayloadStoreFull) else "unreachable"
                self.log.error("payload store %s, retrying in %.0f s (%d of %d): %s", what, delay, attempt,
                               PUT_ATTEMPTS, exc)
                await asyncio.sleep(delay)

    async def _free_objects(self) -> None:
        """Delete released payload objects now (best effort: the reclaim turn frees the rest)."""
        plane = self.plane
        if plane is None:
            return
        try:
            await self._outage.run(lambda: plane.free(), give_up_after=5)
        except Exception as exc:
            self.log.warning("freeing released payload objects failed (the reclaim turn retries): %s", exc)

    async def _dead_prompt_fields(self, work: Work, last: Prompt) -> tuple[Mapping[Any, Any], list[StoreObject]]:
        """The dead letter of a prompt past max_attempts: its next attempt, whose partial samples
        (generated here, partial rollout) put their large arrays in the payload store as a group's
        would (a store, not the eval lane), the entry naming them; a store that fails keeps them
        inline (logged)."""
        plane = self.plane
        if plane is None or work.stream == self.keys.eval_prompts or not last.partial:
            return prompt_fields(last), []
        fields, objects = prompt_fields_offloaded(last, self.config.payload_min_bytes, plane.new_key)
        if objects:
            try:
                await self._outage.run(lambda: plane.put(objects))
            except PayloadError as exc:
                self.log.warning("prompt %d: its dead letter keeps its arrays in Redis, the payload store failed: %s",
                                 last.index, exc)
                return prompt_fields(last), []
        return fields, objects

    async def _dead_letter_prompt(
        self, work: Work, reason: str, fields: Mapping[Any, Any] | None = None, *, log: bool = True,
        objects: list[StoreObject] | None = None,
    ) -> bool:
        """Dead-letter the prompt with ``fields`` (default: the entry as read) and ``reason``
        (``objects``: payload objects ``fields`` refer to, put already: claimed with it);
        False when it was no longer ours (taken over)."""
        if log:
            self.log.warning("prompt entry %s dead-lettered: %s", work.prompt_id, reason)
        work.finishing = True
        written = work.fields if fields is None else fields
        journal = self._journal_key(work)
        refs = [o.ref for o in objects or ()]
        return await self._outage.run(
            lambda: self.prompts.dead_letter(work.stream, work.prompt_id, written, reason, journal, refs)
        )

    def _journal_key(self, work: Work) -> str | None:
        """The prompt's episode journal, deleted with its publish or dead letter (durable episodes)."""
        if not self.durable or work.prompt is None:
            return None
        return self.keys.episode(work.prompt.index, work.prompt.epoch, self._eval_lane(work))

    def _eval_lane(self, work: Work) -> str | None:
        """The eval name an eval-lane prompt's journal is keyed by (None: a training prompt's); the
        key MOVE follows is read from the same plain field (``Keys.episode_lane``)."""
        return self.keys.episode_lane(work.stream, work.fields)

    async def _journal(self, work: Work, prompt: Prompt) -> PromptJournal:
        """The prompt's episode journal as another producer left it (``{}`` when fresh), and its
        writer: appends name this attempt's entry, so they stop when the lease is lost."""
        index, epoch, lane = prompt.index, prompt.epoch, self._eval_lane(work)
        steps = await self._outage.run(lambda: self.journals.load(index, epoch, lane))
        plane = self.plane
        if plane is not None and steps:  # steps kept in the payload store, read back (checksums verified)
            try:
                steps = await plane.resolve_steps(steps)
            except PayloadError as exc:
                self.log.warning("prompt %d: its journal's steps cannot be read, the episodes start over: %s",
                                 index, exc)
                steps = {}
        if steps:
            self.log.info("prompt %d resumes from its journal (%s steps)", index,
                          ", ".join(f"member {m}: {len(s)}" for m, s in sorted(steps.items())))

        async def append(member: int, seq: int, step: bytes) -> str:
            objects = ""
            if plane is not None:  # a large step goes to the payload store, the journal keeps a reference
                try:
                    step, objects = await plane.offload_step(step, self.config.payload_min_bytes)
                except PayloadError as exc:  # journaled inline instead: the episode goes on
                    self.log.warning("prompt %d: a journal step stays in Redis, the payload store failed: %s",
                                     index, exc)
            return await self.journals.append(
                stream=work.stream, entry_id=work.prompt_id, index=index, epoch=epoch, member=member, seq=seq,
                budget=self.config.max_backlog_bytes, step=step, eval_name=lane, objects=objects,
            )

        return PromptJournal(steps, append, self.journals.count_diverged, self.rollout.runtime.journal,
                             f"producer {self.name}: prompt {index}")

    # -- control, limits (reclaim: .reclaim, heartbeat: .pulse) -------------------------

    async def _limits_loop(self) -> None:
        """Renew the namespace limit units held (a third of the lease) and re-read the sizes."""
        await self._outage.forever(self._limits_turn)

    async def _limits_turn(self) -> bool:
        await asyncio.sleep(self.config.lease_seconds / 3)
        await self.limits.renew()
        await self.limits.refresh()
        return True

    def _stalled(self, stall: Stall) -> None:
        self.metrics.loop_stalled(stall.seconds)

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
                    data = message.get("data")
                    if isinstance(data, bytes) and data.startswith((b"pause", b"resume", b"version")):
                        # no request goes out while paused; on the resume every engine is read first
                        self.engine.versions_moved(paused=data.startswith(b"pause"))
                    self.table.wake()
                    changed, self._control_changed = self._control_changed, asyncio.Event()
                    changed.set()
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()
