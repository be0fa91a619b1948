"""The producer: admit prompts, generate ``n`` samples each, score them, publish the group.

One asyncio process, several cooperating loops (all tasks referenced, all cancelled on exit):

* **admission**: waits for room for ``n`` samples under ``concurrency``, then runs the ADMIT
  script, which reads one prompt only if the pipeline is not paused, the group backlog is
  under ``max_backlog`` and staleness-aware admission allows it. Nothing blocks the event loop
  and nothing is buffered: a prompt is read only when it can start at once.
* **work**: one task per admitted prompt; publishing the group and acknowledging the prompt is
  one Lua script that checks the XACK first, so a prompt taken over by another producer is
  never published twice.
* **leases**: renews the lease of every prompt it works on (XCLAIM JUSTID of its own ids).
* **reclaim**: XAUTOCLAIM, keeping its cursor, takes over prompts idle past the lease
  (a producer that died); on Redis 6.2 deleted entries come back without fields and are
  acknowledged and skipped.
* **heartbeat** and **control** (pub/sub: pause, resume and new versions wake admission at once).

SIGTERM/SIGINT drain: stop admitting, wait up to ``drain_timeout`` for in-flight groups, then
return the unfinished prompts to the stream. A fatal error (an engine that keeps failing, a
broken reward function) is recorded in ``events`` with its traceback, the prompts go back,
and :meth:`Producer.run` raises it so the process exits non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import traceback
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from redis.asyncio import Redis
from rollstream.common.codec import DEFAULT_LIMITS, decode_prompt_entry, group_fields
from rollstream.common.config import PipelineConfig
from rollstream.common.connection import (
    TRANSIENT_ERRORS,
    Outage,
    connect,
    is_nogroup,
    nogroup_error,
    redact_url,
)
from rollstream.common.errors import (
    ConfigError,
    DecodeError,
    EngineRejected,
)
from rollstream.common.events import DRAIN, FATAL, START, STOP, now_ms, record_event
from rollstream.common.keys import PRODUCERS_GROUP, Keys, StateField
from rollstream.common.lua import Scripts
from rollstream.common.models import Group, Prompt, Sample, Status
from rollstream.common.namespace import load_config

from .engine import EngineClient, Generation
from .rewards import RewardFunction

logger = logging.getLogger(__name__)

STARTUP_REDIS_WAIT = 60.0
"""Seconds a starting producer waits for an unreachable Redis before it gives up."""


def default_producer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True, slots=True)
class ProducerSettings:
    """Per-process settings; the pipeline-wide ones live in the namespace config."""

    namespace: str
    concurrency: int
    """Samples in flight at most (a prompt needs ``n_samples_per_prompt`` of them)."""
    name: str = field(default_factory=default_producer_name)
    n_samples: int | None = None
    """When given, must match the namespace's ``n_samples_per_prompt``."""
    heartbeat_interval: float = 2.0
    drain_timeout: float = 30.0
    renew_interval: float | None = None
    """Default: a third of the lease."""
    reclaim_interval: float | None = None
    """Default: a quarter of the lease, at most 5 s."""
    tokenize_prompts: bool = True
    """Ask the engine's ``/tokenize`` for prompt ids, so samples carry prompt + response ids."""

    def __post_init__(self) -> None:
        if isinstance(self.concurrency, bool) or not isinstance(self.concurrency, int) or self.concurrency < 1:
            raise ValueError(f"concurrency must be a positive integer, got {self.concurrency!r}")
        if not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"producer name must be non-empty without spaces, got {self.name!r}")
        for name in ("heartbeat_interval", "drain_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    def check(self, config: PipelineConfig) -> None:
        config.check_matches(n_samples_per_prompt=self.n_samples)
        if self.concurrency < config.n_samples_per_prompt:
            raise ConfigError(
                f"concurrency {self.concurrency} is below n_samples_per_prompt "
                f"{config.n_samples_per_prompt}: one prompt needs that many samples in flight"
            )


@dataclass(slots=True)
class _Work:
    prompt_id: bytes
    fields: dict[bytes, bytes]
    prompt: Prompt | None = None
    task: asyncio.Task[None] | None = None
    lease_lost: bool = False


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
        metrics: Any | None = None,
    ) -> None:
        self.url = redis_url
        self.settings = settings
        self.engine = engine
        self.reward = reward
        self.config = config
        self.keys = Keys(settings.namespace)
        self.redis = redis
        self._blocking = blocking
        self.scripts = Scripts(redis, self.keys)
        self.metrics = metrics
        self.name = settings.name
        self._free = settings.concurrency
        self._capacity = asyncio.Condition()
        self._work: dict[bytes, _Work] = {}
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._fatal: BaseException | None = None
        self._fatal_tb = ""
        self._state = "starting"
        self._reclaim_cursor = "0-0"
        self._reclaim_due = False
        self._outage = Outage(logger, f"producer {self.name}")
        self._blocked_since: float | None = None
        self._blocked_total = 0.0
        self._blocked_reported = 0.0
        self._started = time.time()
        self.published = 0
        self.duplicates = 0
        self.reclaimed = 0
        self.returned = 0
        self._publish_times: list[float] = []

    @classmethod
    async def connect(
        cls,
        redis_url: str,
        settings: ProducerSettings,
        engine: EngineClient,
        reward: RewardFunction,
        metrics: Any | None = None,
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
        return cls(redis_url, settings, engine, reward, config, redis, blocking, metrics)

    # -- public -------------------------------------------------------------------------

    @property
    def in_flight_samples(self) -> int:
        return self.settings.concurrency - self._free

    def stop(self) -> None:
        """Ask for a drain: stop admitting, finish or return what is in flight."""
        if not self._stopping.is_set():
            logger.info("producer %s (ns %s): drain requested", self.name, self.keys.namespace)
        self._stopping.set()
        self._wake.set()

    async def run(self) -> None:
        """Run until :meth:`stop` (returns) or a fatal error (raises it, after recording it)."""
        n = self.config.n_samples_per_prompt
        logger.info(
            "producer %s (ns %s) starting: concurrency %d samples, n=%d, engines %s",
            self.name, self.keys.namespace, self.settings.concurrency, n,
            ", ".join(redact_url(u) for u in self.engine.settings.urls),
        )
        self._state = "running"
        await self._outage.run(lambda: record_event(self.redis, self.keys, START, source=self.name))
        await self._outage.run(self._heartbeat_once)
        await self._adopt_own_pending()
        # The heartbeat outlives the other loops: operators see "draining" during the drain.
        heartbeat = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")
        loops = [
            asyncio.create_task(self._admission_loop(), name="admission"),
            asyncio.create_task(self._renew_loop(), name="renew"),
            asyncio.create_task(self._reclaim_loop(), name="reclaim"),
            asyncio.create_task(self._control_loop(), name="control"),
        ]
        stopper = asyncio.create_task(self._stopping.wait(), name="stop-wait")
        try:
            done, _ = await asyncio.wait([stopper, heartbeat, *loops], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopper and not task.cancelled() and (error := task.exception()) is not None:
                    self._set_fatal(error)
        finally:
            stopper.cancel()
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            try:
                await self._shutdown()
            finally:
                heartbeat.cancel()
                await asyncio.gather(heartbeat, return_exceptions=True)
        if self._fatal is not None:
            raise self._fatal

    async def aclose(self) -> None:
        await self.redis.aclose()
        await self._blocking.aclose()

    # -- capacity -----------------------------------------------------------------------

    async def _acquire(self, samples: int) -> bool:
        async with self._capacity:
            while self._free < samples:
                if self._stopping.is_set():
                    return False
                await self._capacity.wait()
            self._free -= samples
            return True

    async def _release(self, samples: int) -> None:
        async with self._capacity:
            self._free += samples
            self._capacity.notify_all()

    def _set_fatal(self, exc: BaseException) -> None:
        if self._fatal is None:
            self._fatal = exc
            self._fatal_tb = "".join(traceback.format_exception(exc))
            logger.error("producer %s (ns %s): fatal error: %s", self.name, self.keys.namespace, exc)
        self._stopping.set()
        self._wake.set()

    async def _nap(self, seconds: float) -> None:
        """Sleep up to ``seconds``; a control message, a stop or a finished reclaim wakes it early."""
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()

    # -- admission ----------------------------------------------------------------------

    def _blocked(self, blocked: bool) -> None:
        now = time.monotonic()
        if blocked and self._blocked_since is None:
            self._blocked_since = now
        elif not blocked and self._blocked_since is not None:
            self._blocked_total += now - self._blocked_since
            self._blocked_since = None

    async def _admission_loop(self) -> None:
        n = self.config.n_samples_per_prompt
        cfg = self.config
        while not self._stopping.is_set():
            _raise_if_cancel_requested()
            if self._reclaim_due:  # prompts of a dead producer come first
                await self._nap(0.2)
                continue
            if not await self._acquire(n):
                return
            admitted = False
            try:
                status, prompt_id, fields, version = await self._outage.run(
                    lambda: self.scripts.admit(
                        consumer=self.name,
                        max_backlog=cfg.max_backlog,
                        admission=cfg.admission_enabled,
                        max_staleness=cfg.max_staleness or 0,
                        batch_size=cfg.batch_size,
                    )
                )
                if status == "ok" and prompt_id is not None and fields is not None:
                    self._blocked(False)
                    self._start_work(prompt_id, fields, version)
                    admitted = True
                    continue
            except Exception as exc:
                if is_nogroup(exc):
                    raise nogroup_error(self.keys.namespace, exc) from exc
                raise
            finally:
                if not admitted:
                    await self._release(n)
            if status == "empty":
                self._blocked(False)
                await self._wait_for_prompts()
            else:
                self._blocked(True)
                if self.metrics is not None:
                    self.metrics.admission_blocked(status)
                await self._nap(0.2 if status == "backlog" else 1.0)

    async def _wait_for_prompts(self) -> None:
        """Block (on the blocking client) until a new prompt is added, or briefly time out."""
        self._wake.clear()
        read = asyncio.create_task(
            self._blocking.xread({self.keys.prompts: "$"}, count=1, block=1000), name="wait-prompts"
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

    def _start_work(self, prompt_id: bytes, fields: dict[bytes, bytes], version: int) -> None:
        work = _Work(prompt_id=prompt_id, fields=fields)
        self._work[prompt_id] = work
        work.task = asyncio.create_task(self._run_work(work, version), name=f"work-{prompt_id.decode()}")

    # -- one prompt ---------------------------------------------------------------------

    async def _run_work(self, work: _Work, admitted_version: int) -> None:
        n = self.config.n_samples_per_prompt
        finished = False
        try:
            try:
                prompt = decode_prompt_entry(work.fields, DEFAULT_LIMITS)
            except DecodeError as exc:
                await self._dead_letter_prompt(work, f"{exc.reason}: {exc.detail}")
                finished = True
                return
            work.prompt = prompt
            group = await self._generate_group(prompt, admitted_version)
            fields = group_fields(group)
            result = await self._outage.run(lambda: self.scripts.publish(work.prompt_id, fields, now_ms()))
            finished = True
            if result is None:
                self.duplicates += 1
                logger.warning(
                    "producer %s: prompt %d was taken over by another producer; duplicate group discarded",
                    self.name, prompt.index,
                )
            else:
                self.published += 1
                self._publish_times.append(time.monotonic())
                if self.metrics is not None:
                    self.metrics.group_published(group)
        except Exception as exc:  # an engine that keeps failing, a broken reward, ...: fatal
            self._set_fatal(nogroup_error(self.keys.namespace, exc) if is_nogroup(exc) else exc)
        finally:
            if finished:  # otherwise the prompt stays listed, and the shutdown returns it
                self._work.pop(work.prompt_id, None)
            await self._release(n)

    async def _dead_letter_prompt(self, work: _Work, reason: str) -> None:
        logger.warning("producer %s: undecodable prompt entry %s: %s", self.name, work.prompt_id, reason)
        await self._outage.run(
            lambda: self.scripts.dead_letter(
                source=self.keys.prompts, group=PRODUCERS_GROUP, entry_id=work.prompt_id,
                reason=reason, fields=work.fields, now_ms=now_ms(),
            )
        )

    async def _prompt_ids(self, prompt: Prompt) -> array[int] | None:
        if prompt.input_ids is not None:
            return prompt.input_ids
        if isinstance(prompt.prompt, str) and self.settings.tokenize_prompts:
            ids = await self.engine.tokenize(prompt.prompt)
            if ids is not None:
                return array("i", ids)
        elif isinstance(prompt.prompt, list):  # chat messages: the chat template, with a tokenizer
            ids = await self.engine.chat_ids(prompt.prompt)
            if ids is not None:
                return array("i", ids)
        return None

    async def _generate_group(self, prompt: Prompt, admitted_version: int) -> Group:
        n = self.config.n_samples_per_prompt
        prompt_ids = await self._prompt_ids(prompt)
        partial = prompt.partial if self.config.partial_rollout else None
        if partial is None and self.engine.batches_samples:  # one request with n
            samples = await self._generate_together(prompt, prompt_ids, n, admitted_version)
        else:
            samples = await self._generate_each(prompt, prompt_ids, n, admitted_version, partial)
        if all(s.status in (Status.COMPLETED, Status.TRUNCATED) for s in samples):
            rewards = await self.reward.score(prompt.prompt, prompt.label, samples)
            for sample, reward in zip(samples, rewards, strict=True):
                sample.reward = reward
        return Group(
            index=prompt.index,
            epoch=prompt.epoch,
            attempt=prompt.attempt,
            prompt=prompt.prompt,
            label=prompt.label,
            metadata=dict(prompt.metadata),
            samples=samples,
            producer=self.name,
            history=prompt.history,
        )

    async def _generate_each(
        self,
        prompt: Prompt,
        prompt_ids: array[int] | None,
        n: int,
        admitted_version: int,
        partial: list[Sample] | None,
    ) -> list[Sample]:
        """One request per sample, concurrently; the first real error (not the group wrapper) propagates."""
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(
                        self._generate_sample(
                            prompt, prompt_ids, i, admitted_version,
                            partial[i] if partial is not None and i < len(partial) else None,
                        )
                    )
                    for i in range(n)
                ]
        except ExceptionGroup as errors:
            first: BaseException = errors
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from None
        return [t.result() for t in tasks]

    @contextlib.contextmanager
    def _requests(self, count: int) -> Iterator[None]:
        """Account ``count`` engine requests in flight, and their latency, in the metrics."""
        if self.metrics is None:
            yield
            return
        started = time.monotonic()
        for _ in range(count):
            self.metrics.request_started()
        try:
            yield
        finally:
            for _ in range(count):
                self.metrics.request_finished(time.monotonic() - started)

    async def _generate_sample(
        self,
        prompt: Prompt,
        prompt_ids: array[int] | None,
        index: int,
        admitted_version: int,
        partial: Sample | None,
    ) -> Sample:
        if partial is not None and partial.status in (Status.COMPLETED, Status.TRUNCATED):
            return replace(partial, index=index)
        prefix: Sample | None = None
        if partial is not None and partial.status == Status.ABORTED and partial.response_length > 0:
            if prompt_ids is not None and partial.prompt_length == len(prompt_ids):
                prefix = partial
            else:
                logger.debug("prompt %d: partial sample without prompt ids; regenerating", prompt.index)
        max_new = self.engine.settings.max_new_tokens
        if prefix is not None and prefix.response_length >= max_new:
            return replace(prefix, index=index, status=Status.TRUNCATED, finish_reason="length")
        try:
            with self._requests(1):
                if prefix is not None:  # continue the aborted response where it stopped
                    generation = await self.engine.generate(
                        input_ids=prefix.tokens, max_new_tokens=max_new - prefix.response_length
                    )
                else:
                    source = self._prompt_input(prompt, prompt_ids)
                    generation = await self.engine.generate(**source, max_new_tokens=max_new)
        except EngineRejected as exc:
            return _rejected(index, prompt_ids, exc)
        if self.metrics is not None:
            self.metrics.tokens_generated(len(generation.output_ids))
        return _to_sample(index, prompt_ids, generation, admitted_version, prefix)

    async def _generate_together(
        self, prompt: Prompt, prompt_ids: array[int] | None, n: int, admitted_version: int
    ) -> list[Sample]:
        """All ``n`` samples in one request (OpenAI ``n``): the prompt is prefilled once."""
        try:
            with self._requests(n):
                generations = await self.engine.generate_n(
                    n, max_new_tokens=self.engine.settings.max_new_tokens, **self._prompt_input(prompt, prompt_ids)
                )
        except EngineRejected as exc:
            return [_rejected(i, prompt_ids, exc) for i in range(n)]
        if self.metrics is not None:
            self.metrics.tokens_generated(sum(len(g.output_ids) for g in generations))
        return [_to_sample(i, prompt_ids, g, admitted_version, None) for i, g in enumerate(generations)]

    def _prompt_input(self, prompt: Prompt, prompt_ids: array[int] | None) -> dict[str, Any]:
        """How the prompt goes to the engine: token ids, else text, else chat messages."""
        if prompt_ids is not None:
            return {"input_ids": prompt_ids}
        if isinstance(prompt.prompt, str):
            return {"text": prompt.prompt}
        if self.engine.accepts_messages:
            return {"messages": prompt.prompt}
        raise EngineRejected(
            400, "chat prompts need a tokenizer with a chat template (--tokenizer) or the openai engine API"
        )

    # -- leases, reclaim ----------------------------------------------------------------

    async def _adopt_own_pending(self) -> None:
        """Prompts pending under this name (a restart with the same ``--name``) are ours now."""
        try:
            pending = await self._outage.run(
                lambda: self.redis.xpending_range(
                    self.keys.prompts, PRODUCERS_GROUP, min="-", max="+", count=1000, consumername=self.name
                )
            )
        except Exception as exc:
            if is_nogroup(exc):
                raise nogroup_error(self.keys.namespace, exc) from exc
            raise
        if pending:
            ids = [p["message_id"] for p in pending]
            logger.info("producer %s: adopting %d prompts pending under its name", self.name, len(ids))
            claimed = await self.redis.xclaim(self.keys.prompts, PRODUCERS_GROUP, self.name, 0, ids)
            await self._take_over(claimed)

    async def _take_over(self, claimed: list[Any]) -> None:
        n = self.config.n_samples_per_prompt
        version = await self._trainer_version()
        for entry_id, fields in claimed:
            if entry_id is None:
                continue
            if not fields:
                await self._outage.run(lambda e=entry_id: self._ack_deleted(e))
                continue
            if entry_id in self._work:
                continue
            if not await self._acquire(n):
                # Stopping: no room will come. Listed without a task, the shutdown hands it back.
                self._work[entry_id] = _Work(prompt_id=entry_id, fields=fields)
                continue
            self.reclaimed += 1
            self._start_work(entry_id, fields, version)
            # Only a counter, but a Redis outage here must not become a fatal error.
            await self._outage.run(lambda: self.redis.hincrby(self.keys.state, StateField.RECLAIMED, 1))

    async def _ack_claimed_deleted(self) -> None:
        """Redis 6.2's XAUTOCLAIM claims entries deleted from the stream and returns them as nil,
        without their ids: find them among this producer's own pending ids and acknowledge them."""
        rows = await self.redis.xpending_range(
            self.keys.prompts, PRODUCERS_GROUP, min="-", max="+", count=1000, consumername=self.name
        )
        for row in rows:
            entry_id = row["message_id"]
            if entry_id not in self._work and not await self.redis.xrange(self.keys.prompts, entry_id, entry_id):
                await self.redis.xack(self.keys.prompts, PRODUCERS_GROUP, entry_id)

    async def _ack_deleted(self, entry_id: bytes) -> None:
        await self.redis.xack(self.keys.prompts, PRODUCERS_GROUP, entry_id)
        await self.redis.xdel(self.keys.prompts, entry_id)

    async def _trainer_version(self) -> int:
        raw = await self._outage.run(lambda: self.redis.hget(self.keys.state, StateField.WEIGHT_VERSION))
        return int(raw or 0)

    async def _renew_loop(self) -> None:
        interval = self.settings.renew_interval or self.config.lease_seconds / 3
        while True:
            _raise_if_cancel_requested()
            await asyncio.sleep(interval)
            ids = [pid for pid, w in self._work.items() if not w.lease_lost]
            if not ids:
                continue
            try:
                lost = await self.scripts.renew(self.name, ids)
            except TRANSIENT_ERRORS as exc:
                await self._outage.failed(exc)
                continue
            self._outage.recovered()
            for pid in lost:
                work = self._work.get(pid)
                if work is not None and not work.lease_lost:
                    work.lease_lost = True
                    logger.warning(
                        "producer %s: lost the lease of prompt entry %s (taken over after %.0f s idle)",
                        self.name, pid.decode(), self.config.lease_seconds,
                    )

    async def _reclaim_loop(self) -> None:
        """Take over prompts idle past the lease; while some are due, admission holds off so the
        next free capacity goes to them (a dead producer's prompts do not wait behind new ones)."""
        n = self.config.n_samples_per_prompt
        interval = self.settings.reclaim_interval or min(5.0, self.config.lease_seconds / 4)
        lease_ms = int(self.config.lease_seconds * 1000)
        while True:
            _raise_if_cancel_requested()
            if not self._reclaim_due:
                await asyncio.sleep(interval)
            if self._stopping.is_set():
                self._reclaim_due = False
                continue
            try:
                if await self.redis.hget(self.keys.state, StateField.PAUSED) == b"1":
                    self._reclaim_due = False
                    continue
                if not self._reclaim_due:
                    due = await self.redis.xpending_range(
                        self.keys.prompts, PRODUCERS_GROUP, min="-", max="+", count=1, idle=lease_ms
                    )
                    if not due:
                        continue
                    self._reclaim_due = True
                async with self._capacity:
                    await self._capacity.wait_for(lambda: self._free >= n or self._stopping.is_set())
                reply = await self.redis.xautoclaim(
                    self.keys.prompts, PRODUCERS_GROUP, self.name, lease_ms,
                    start_id=self._reclaim_cursor, count=max(1, self._free // n),
                )
            except TRANSIENT_ERRORS as exc:
                self._reclaim_due = False
                await self._outage.failed(exc)
                continue
            self._outage.recovered()
            cursor, claimed = reply[0], reply[1]
            self._reclaim_cursor = cursor.decode() if isinstance(cursor, bytes) else str(cursor)
            if any(c[0] is None for c in claimed):
                await self._outage.run(self._ack_claimed_deleted)
            claimed = [c for c in claimed if c[0] is not None]
            if claimed:
                logger.info(
                    "producer %s: reclaimed %d prompts idle past the %.0f s lease",
                    self.name, len(claimed), self.config.lease_seconds,
                )
                await self._take_over(claimed)
            elif self._reclaim_cursor in ("0-0", "0"):
                self._reclaim_due = False  # scanned to the end: nothing left to take over
            if not self._reclaim_due:
                self._wake.set()

    # -- heartbeat, control -------------------------------------------------------------

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
        beat = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "state": self._state,
            "in_flight_samples": self.in_flight_samples,
            "in_flight_prompts": len(self._work),
            "concurrency": self.settings.concurrency,
            "published": self.published,
            "groups_last_minute": self._groups_last_minute(),
            "duplicates": self.duplicates,
            "reclaimed": self.reclaimed,
            "engine_retries": self.engine.retries,
            "engines": [redact_url(u) for u in self.engine.settings.urls],
            "started_ms": int(self._started * 1000),
            "last_seen_ms": now_ms(),
        }
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(self.keys.producers, self.name, json.dumps(beat))
            if blocked_ms > 0:
                pipe.hincrby(self.keys.state, StateField.ADMISSION_BLOCKED_MS, blocked_ms)
            await pipe.execute()
        self._blocked_reported += blocked_ms / 1000
        if self.metrics is not None and blocked_ms > 0:
            self.metrics.admission_blocked_for(blocked_ms / 1000)

    async def _heartbeat_loop(self) -> None:
        while True:
            _raise_if_cancel_requested()
            await asyncio.sleep(self.settings.heartbeat_interval)
            try:
                await self._heartbeat_once()
            except TRANSIENT_ERRORS as exc:
                await self._outage.failed(exc)
                continue
            self._outage.recovered()

    async def _control_loop(self) -> None:
        """Wake admission at once on pause/resume/version messages (the check itself is in ADMIT)."""
        while True:
            _raise_if_cancel_requested()
            pubsub = self._blocking.pubsub()
            try:
                await pubsub.subscribe(self.keys.control)
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is not None:
                        logger.debug("producer %s: control message %r", self.name, message.get("data"))
                        self._wake.set()
                    _raise_if_cancel_requested()
            except TRANSIENT_ERRORS as exc:
                await self._outage.failed(exc)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    # -- shutdown -----------------------------------------------------------------------

    async def _shutdown(self) -> None:
        work_tasks = [w.task for w in self._work.values() if w.task is not None]
        if self._fatal is None:
            self._state = "draining"
            logger.info(
                "producer %s (ns %s): draining %d prompts (up to %.0f s)",
                self.name, self.keys.namespace, len(work_tasks), self.settings.drain_timeout,
            )
            with contextlib.suppress(Exception):
                await self._heartbeat_once()
                await record_event(self.redis, self.keys, DRAIN, source=self.name)
            if work_tasks:
                await asyncio.wait(work_tasks, timeout=self.settings.drain_timeout)
        else:
            self._state = "failed"
        for task in work_tasks:
            task.cancel()
        await asyncio.gather(*work_tasks, return_exceptions=True)
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
        logger.info(
            "producer %s (ns %s) %s: published %d groups, returned %d prompts, discarded %d duplicates",
            self.name, self.keys.namespace, self._state, self.published, self.returned, self.duplicates,
        )

    async def _return_unfinished(self) -> None:
        """Put the prompts still held back at the end of the stream, with their attempt unchanged."""
        for work in list(self._work.values()):
            fields = {k.decode(): v for k, v in work.fields.items()}
            try:
                returned = await self._outage.run(
                    lambda f=fields, w=work: self.scripts.return_prompt(w.prompt_id, f), give_up_after=30
                )
            except TRANSIENT_ERRORS:
                logger.error(
                    "producer %s: could not return prompt entry %s; it will be reclaimed after the lease",
                    self.name, work.prompt_id.decode(),
                )
                continue
            if returned:
                self.returned += 1
            self._work.pop(work.prompt_id, None)


def _raise_if_cancel_requested() -> None:
    """redis-py can swallow a task's cancellation (seen under load, in pub/sub reads and
    pipelines): a loop that went on after it kept the producer from ever finishing its shutdown.
    The long-running loops check for a pending cancellation on every turn."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _to_sample(
    index: int,
    prompt_ids: array[int] | None,
    generation: Generation,
    admitted_version: int,
    prefix: Sample | None,
) -> Sample:
    metadata: dict[str, Any] = {"engine": generation.engine}
    if prompt_ids is None and prefix is None and generation.prompt_ids is not None:
        prompt_ids = array("i", generation.prompt_ids)  # the engine said (vLLM return_token_ids)
    version = generation.weight_version
    if version is None:
        version = admitted_version
        metadata["weight_version_source"] = "trainer_at_admission"
    if prompt_ids is None:
        metadata["prompt_ids"] = "unknown"
    status = Status.from_finish_reason(generation.finish_reason)
    if prefix is not None:
        log_probs = None
        if prefix.rollout_log_probs is not None and generation.log_probs is not None:
            log_probs = prefix.rollout_log_probs + array("f", generation.log_probs)
        metadata["continued_from"] = prefix.response_length
        return Sample(
            index=index,
            tokens=prefix.tokens + array("i", generation.output_ids),
            response=prefix.response + generation.text,
            response_length=prefix.response_length + len(generation.output_ids),
            status=status,
            finish_reason=generation.finish_reason,
            weight_versions=[*prefix.weight_versions, version],
            rollout_log_probs=log_probs,
            metadata={**prefix.metadata, **metadata},
        )
    tokens = (prompt_ids if prompt_ids is not None else array("i")) + array("i", generation.output_ids)
    return Sample(
        index=index,
        tokens=tokens,
        response=generation.text,
        response_length=len(generation.output_ids),
        status=status,
        finish_reason=generation.finish_reason,
        weight_versions=[version],
        rollout_log_probs=None if generation.log_probs is None else array("f", generation.log_probs),
        metadata=metadata,
    )


def _rejected(index: int, prompt_ids: array[int] | None, exc: EngineRejected) -> Sample:
    """A FAILED sample: the engine refused the request; the consumer recycles the group."""
    return Sample(
        index=index,
        tokens=prompt_ids if prompt_ids is not None else array("i"),
        status=Status.FAILED,
        finish_reason="rejected",
        metadata={"error": str(exc)[:1000]},
    )
