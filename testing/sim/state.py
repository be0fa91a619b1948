"""The simulated engine's shared state and scheduler: generation slots, the queue, aborts, the
pause, weight versions and their spans, the armed faults. Every API module's handlers drive it
through ``request.app[STATE_KEY]``."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from rollstream.testing.sim.model import SimConfig, _Plan

CACHE_BLOCK = 16
"""Tokens per prefix-cache block (vLLM's default block size)."""


def _block_keys(ids: list[int]) -> list[tuple[int, int]]:
    """``(end, hash of ids[:end])`` for every whole block of ``ids``."""
    out = []
    key = 0
    for end in range(CACHE_BLOCK, len(ids) + 1, CACHE_BLOCK):
        key = hash((key, tuple(ids[end - CACHE_BLOCK : end])))
        out.append((end, key))
    return out


@dataclass(eq=False)
class _Job:
    """One generation holding (or waiting for) a slot."""

    rid: str
    abort: asyncio.Event = field(default_factory=asyncio.Event)


KV_STEP_TOKENS = 4
"""Tokens every running request gains per scheduler step with a KV capacity (a step lasts
``latency_per_token`` x this, so a request's speed is the same as without a capacity)."""


@dataclass(eq=False)
class _Seq:
    """A request in the KV scheduler: its tokens, and the future its handler waits on."""

    job: _Job
    prompt: int
    target: int
    prefill: int
    """Tokens to compute when it is next admitted (its uncached prompt; all it holds after a preemption)."""
    done: asyncio.Future[None]
    produced: int = 0
    started: float = 0.0

    @property
    def tokens(self) -> int:
        return self.prompt + self.produced


@dataclass(frozen=True)
class _Outcome:
    output_ids: list[int]
    logprobs: list[float]
    finish: str
    """``stop``, ``length`` or ``abort``."""
    abort_message: str = ""
    started: float = 0.0
    """Monotonic time the first token started accruing (after the slot and ``base_latency``)."""


@dataclass
class SimState:
    """Mutable state of one simulated engine (exposed for tests as ``SimEngine.state``)."""

    config: SimConfig
    weight_version: int = 0
    report_weight_version: bool = True
    rng: random.Random = field(default_factory=random.Random)
    semaphore: asyncio.Semaphore = field(default_factory=asyncio.Semaphore)
    resumed: asyncio.Event = field(default_factory=asyncio.Event)
    closing: asyncio.Event = field(default_factory=asyncio.Event)
    jobs: set[_Job] = field(default_factory=set)
    running: int = 0
    waiting: int = 0
    max_running_seen: int = 0
    requests: int = 0
    aborted: int = 0
    aborted_outputs: list[list[int]] = field(default_factory=list)
    """The tokens each generation aborted mid-way had produced (a continuation must keep them)."""
    generated_tokens: int = 0
    version_log: list[tuple[float, int]] = field(default_factory=list)
    """(monotonic time, version) of every weight version change: the vLLM API's spans."""
    reloads: list[str] = field(default_factory=list)
    """Weight paths of reloads (vLLM ``reload_weights``, SGLang ``/update_weights_from_disk``), in order."""
    pauses: list[tuple[str, str | None]] = field(default_factory=list)
    """``(mode, clear_cache)`` of every vLLM ``/pause``, as sent (``clear_cache`` None when absent)."""
    sglang_pause: str | None = None
    """The mode of the SGLang ``/pause_generation`` in force (None: not paused that way)."""
    faults_injected: int = 0
    generate_errors: int = 0
    generate_error_status: int = 500
    model_info_mode: str = "ok"
    bad_replies: int = 0
    bad_reply_mode: str = "not_json"
    bad_reply_bytes: int = 2**20
    bad_replies_sent: int = 0
    prefix_cache: OrderedDict[int, int] = field(default_factory=OrderedDict)
    """Hashes of cached token blocks (a block's hash covers its whole prefix), LRU first -> the
    weights they were computed with (the count of reloads then: :attr:`weights_loaded`)."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    stale_cached_tokens: int = 0
    """Cached tokens reused whose KV was computed with weights since replaced: a reload that kept
    the cache (vLLM's ``reload_weights`` does; its ``/reset_prefix_cache`` and a pause with
    ``clear_cache`` empty it, as SGLang's reload does)."""
    weights_loaded: int = 0
    """Reloads that took (each makes the cached KV before it stale)."""
    cache_resets: int = 0
    """Times the prefix cache was emptied on request (vLLM ``/reset_prefix_cache``, SGLang's flush)."""
    reload_seconds: float = 0.0
    """Seconds a weight reload takes (``/sim/faults`` ``reload_seconds``): a large checkpoint."""
    unwedged: asyncio.Event = field(default_factory=asyncio.Event)
    """Cleared while wedged: every request but ``/sim/*`` waits, and so does every reply."""
    restarts: int = 0
    kv_running: list[_Seq] = field(default_factory=list)
    kv_waiting: deque[_Seq] = field(default_factory=deque)
    kv_used: int = 0
    """Tokens held by the running requests (of ``config.kv_capacity_tokens``)."""
    preemptions: int = 0
    load_endpoints: bool = True
    """Whether ``/get_load``, ``/v1/loads`` and ``/metrics`` answer (else 404, as an engine without them)."""
    _kv_task: asyncio.Task[None] | None = None

    @classmethod
    def from_config(cls, config: SimConfig) -> SimState:
        state = cls(
            config=config,
            weight_version=config.weight_version,
            report_weight_version=config.report_weight_version,
            rng=random.Random(config.seed),
            semaphore=asyncio.Semaphore(config.max_running),
        )
        state.resumed.set()
        state.unwedged.set()
        return state

    @property
    def paused(self) -> bool:
        return not self.resumed.is_set()

    def abort(self, rid: str | None = None) -> int:
        """Abort the in-flight generations (all, or those of ``rid``); returns how many."""
        count = 0
        for job in list(self.jobs):
            if (rid is None or job.rid == rid) and not job.abort.is_set():
                job.abort.set()
                count += 1
        return count

    def stats(self) -> dict[str, Any]:
        if self.config.kv_capacity_tokens:
            self.running, self.waiting = len(self.kv_running), len(self.kv_waiting)
        return {
            "running": self.running,
            "waiting": self.waiting,
            "in_flight": len(self.jobs),
            "max_running_seen": self.max_running_seen,
            "requests": self.requests,
            "aborted": self.aborted,
            "generated_tokens": self.generated_tokens,
            "faults_injected": self.faults_injected,
            "bad_replies_sent": self.bad_replies_sent,
            "weight_version": self.weight_version,
            "paused": self.paused,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "stale_cached_tokens": self.stale_cached_tokens,
            "cache_resets": self.cache_resets,
            "wedged": not self.unwedged.is_set(),
            "restarts": self.restarts,
            "kv_used": self.kv_used,
            "preemptions": self.preemptions,
        }

    def kv_usage(self) -> float | None:
        """The fraction of the KV capacity in use (None without a capacity: not reported)."""
        capacity = self.config.kv_capacity_tokens
        return min(1.0, self.kv_used / capacity) if capacity else None

    def cached_prefix(self, ids: list[int]) -> int:
        """Tokens of ``ids`` found in the prefix cache (whole blocks from the start), counted."""
        cached = stale = 0
        if self.config.prefix_cache_tokens:
            for end, key in _block_keys(ids):
                weights = self.prefix_cache.get(key)
                if weights is None:
                    break
                self.prefix_cache.move_to_end(key)
                if weights != self.weights_loaded:
                    stale += end - cached
                cached = end
        self.prompt_tokens += len(ids)
        self.cached_tokens += cached
        self.stale_cached_tokens += stale
        return cached

    def cache(self, ids: list[int]) -> None:
        """Keep ``ids``' blocks (prompt and output of a finished request), evicting the oldest."""
        capacity = self.config.prefix_cache_tokens // CACHE_BLOCK
        if not capacity:
            return
        for _, key in _block_keys(ids):
            self.prefix_cache.setdefault(key, self.weights_loaded)  # a block found is kept as it was
            self.prefix_cache.move_to_end(key)
        while len(self.prefix_cache) > capacity:
            self.prefix_cache.popitem(last=False)

    def reset_cache(self) -> None:
        """Empty the prefix cache (vLLM ``/reset_prefix_cache``, SGLang's flush after a reload)."""
        self.prefix_cache.clear()
        self.cache_resets += 1

    async def reload(self) -> None:
        """A weight reload that takes: :attr:`reload_seconds` long, and the cached KV is stale."""
        if self.reload_seconds:
            await asyncio.sleep(self.reload_seconds)
        self.weights_loaded += 1

    def restart(self, version: int) -> None:
        """What an engine restarted from its base checkpoint looks like: in-flight requests end
        (aborted), the cache is empty, the version is ``version``, nothing paused or wedged."""
        self.abort()
        self.prefix_cache.clear()
        self.set_version(version)
        self.resumed.set()
        self.unwedged.set()
        self.restarts += 1

    def take_fault(self) -> int | None:
        """Count a generation request; the HTTP status to fail it with, if a fault is armed."""
        self.requests += 1
        if self.generate_errors == 0:
            return None
        if self.generate_errors > 0:
            self.generate_errors -= 1
        self.faults_injected += 1
        return self.generate_error_status

    def take_bad_reply(self) -> str | None:
        """The unusable-reply mode to answer this request with, if that fault is armed."""
        if self.bad_replies == 0:
            return None
        if self.bad_replies > 0:
            self.bad_replies -= 1
        self.bad_replies_sent += 1
        return self.bad_reply_mode

    async def wait_resumed(self) -> bool:
        """Wait while paused; ``False`` when the engine is shutting down."""
        while not self.resumed.is_set() and not self.closing.is_set():
            waiter = asyncio.ensure_future(self.resumed.wait())
            closer = asyncio.ensure_future(self.closing.wait())
            try:
                await asyncio.wait({waiter, closer}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
                closer.cancel()
        return not self.closing.is_set()

    async def generate(self, rid: str, plan: _Plan, max_new_tokens: int, prompt_tokens: int = 0,
                       prefill_tokens: int | None = None) -> _Outcome:
        """Run one generation: queue for a slot, then let tokens accrue until done or aborted.
        ``prompt_tokens`` (and the uncached ``prefill_tokens`` of them) count with a KV capacity."""
        n_out = min(len(plan.response_ids), max_new_tokens)
        finish = "stop" if n_out == len(plan.response_ids) else "length"
        job = _Job(rid)
        self.jobs.add(job)
        if self.config.kv_capacity_tokens:
            try:
                seq = await self._schedule(job, prompt_tokens, n_out,
                                           prompt_tokens if prefill_tokens is None else prefill_tokens)
            finally:
                self.jobs.discard(job)
            self.generated_tokens += seq.produced
            if seq.produced < n_out:
                self.aborted += 1
                self.aborted_outputs.append(plan.response_ids[: seq.produced])
                message = "Abort in the middle of generation" if seq.started else "Abort in waiting queue"
                return _Outcome(plan.response_ids[:seq.produced], plan.logprobs[:seq.produced], "abort", message,
                                started=seq.started)
            return _Outcome(plan.response_ids[:n_out], plan.logprobs[:n_out], finish, started=seq.started)
        try:
            if not await self._acquire_slot(job):
                self.aborted += 1
                return _Outcome([], [], "abort", "Abort in waiting queue")
            started = time.monotonic() + self.config.base_latency
            try:
                produced = await self._run(job, n_out)
            finally:
                self.running -= 1
                self.semaphore.release()
        finally:
            self.jobs.discard(job)
        self.generated_tokens += produced
        if produced < n_out:
            self.aborted += 1
            self.aborted_outputs.append(plan.response_ids[:produced])
            return _Outcome(
                plan.response_ids[:produced],
                plan.logprobs[:produced],
                "abort",
                "Abort in the middle of generation",
                started=started,
            )
        return _Outcome(plan.response_ids[:n_out], plan.logprobs[:n_out], finish, started=started)

    def set_version(self, version: int) -> None:
        self.weight_version = version
        self.version_log.append((time.monotonic(), version))

    def spans(self, outcome: _Outcome) -> list[dict[str, Any]]:
        """vLLM's ``weight_versions`` of an outcome: the version in effect as each token accrued
        (a change while it ran splits the span at the tokens produced by then)."""
        count = len(outcome.output_ids)
        start_version = self.config.weight_version
        changes: list[tuple[int, int]] = []
        per_token = self.config.latency_per_token
        for when, version in self.version_log:
            if when <= outcome.started:
                start_version = version
            else:
                at = count if per_token <= 0 else min(count, int((when - outcome.started) / per_token))
                changes.append((at, version))
        spans = [{"version": str(start_version), "start": 0, "end": count}]
        for at, version in changes:
            if at >= count:
                break
            last = spans[-1]
            if at == last["start"]:
                last["version"] = str(version)
            elif str(version) != last["version"]:
                last["end"] = at
                spans.append({"version": str(version), "start": at, "end": count})
        return spans

    async def _acquire_slot(self, job: _Job) -> bool:
        """Take a slot unless aborted first (then ``False``, holding nothing)."""
        self.waiting += 1
        acquire = asyncio.ensure_future(self.semaphore.acquire())
        aborted = asyncio.ensure_future(job.abort.wait())
        try:
            await asyncio.wait({acquire, aborted}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled (client gone, shutdown): never keep a slot
            if acquire.done() and not acquire.cancelled() and acquire.exception() is None:
                self.semaphore.release()
            raise
        finally:
            self.waiting -= 1
            aborted.cancel()
            if not acquire.done():
                acquire.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await acquire
        if acquire.cancelled():
            return False
        if job.abort.is_set():
            self.semaphore.release()
            return False
        self.running += 1
        self.max_running_seen = max(self.max_running_seen, self.running)
        return True

    async def _run(self, job: _Job, n_out: int) -> int:
        """Hold the slot while ``n_out`` tokens accrue; the number produced before any abort."""
        config = self.config
        duration = config.base_latency + config.latency_per_token * n_out
        start = time.monotonic()
        try:
            await asyncio.wait_for(job.abort.wait(), timeout=duration)
        except TimeoutError:
            return n_out
        elapsed = time.monotonic() - start - config.base_latency
        if elapsed < 0:
            return 0
        if config.latency_per_token <= 0:
            return n_out
        return min(n_out, int(elapsed / config.latency_per_token))


    # -- the KV scheduler (with config.kv_capacity_tokens) ---------------------------------

    async def _schedule(self, job: _Job, prompt: int, target: int, prefill: int) -> _Seq:
        """Queue ``job`` in the KV scheduler; its seq once finished, aborted or dropped."""
        seq = _Seq(job, prompt, target, prefill, asyncio.get_running_loop().create_future())
        self.kv_waiting.append(seq)
        if self._kv_task is None or self._kv_task.done():
            self._kv_task = asyncio.create_task(self._kv_loop(), name="sim-kv-scheduler")
        try:
            await seq.done
        finally:
            self._kv_drop(seq)  # cancelled (client gone): frees its tokens
        return seq

    def _kv_drop(self, seq: _Seq) -> None:
        if seq in self.kv_running:
            self.kv_running.remove(seq)
            self.kv_used -= seq.tokens
        elif seq in self.kv_waiting:
            self.kv_waiting.remove(seq)
        if not seq.done.done():
            seq.done.set_result(None)

    async def _kv_loop(self) -> None:
        """vLLM's scheduling in steps: running requests first, the newest preempted when their next
        tokens do not fit (its tokens recomputed when readmitted); waiting ones admitted in order
        while they fit and nothing was preempted this step. A step lasts ``latency_per_token`` x
        :data:`KV_STEP_TOKENS` plus ``prefill_per_token`` per token computed on admission."""
        config = self.config
        capacity = config.kv_capacity_tokens
        running, waiting = self.kv_running, self.kv_waiting
        while running or waiting:
            for seq in [*running, *waiting]:
                if seq.job.abort.is_set():
                    self._kv_drop(seq)
            preempted = False
            grow = sum(min(KV_STEP_TOKENS, s.target - s.produced) for s in running)
            while len(running) > 1 and self.kv_used + grow > capacity:
                victim = running.pop()
                self.kv_used -= victim.tokens
                grow -= min(KV_STEP_TOKENS, victim.target - victim.produced)
                victim.prefill = victim.tokens
                waiting.appendleft(victim)
                self.preemptions += 1
                preempted = True
            prefill = 0
            while not preempted and waiting and len(running) < config.max_running:
                seq = waiting[0]
                step = min(KV_STEP_TOKENS, seq.target - seq.produced)
                if running and self.kv_used + grow + seq.tokens + step > capacity:
                    break
                waiting.popleft()
                running.append(seq)
                self.kv_used += seq.tokens
                grow += step
                prefill += seq.prefill
                seq.started = seq.started or time.monotonic()
            self.max_running_seen = max(self.max_running_seen, len(running))
            if not running:  # every request was aborted
                break
            await asyncio.sleep(config.latency_per_token * KV_STEP_TOKENS + config.prefill_per_token * prefill)
            for seq in list(running):
                step = min(KV_STEP_TOKENS, seq.target - seq.produced)
                seq.produced += step
                self.kv_used += step
                if seq.produced >= seq.target:
                    self._kv_drop(seq)


STATE_KEY = web.AppKey("rollstream_sim_state", SimState)
