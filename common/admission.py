"""Staleness-aware admission: the rule, in Python, for everyone who shows or explains it.

The ADMIT script (:data:`.lua.ADMIT`) evaluates the same arithmetic atomically inside Redis;
``tests/test_admission_rule.py`` checks on random inputs that both agree. Terms:

* ``outstanding``: prompt attempts that will become groups the trainer has not taken yet =
  prompts in flight (pending in ``prompts`` and ``retry``) + groups ready (``XLEN groups`` -
  pending in ``groups``). Read from the streams, so it cannot drift like counters.
* ``consumed``: groups the trainer took (``committed`` + pending in ``groups``); ``c`` = consumed
  since the current weight version began (``version_start_consumed``, stored at each change).
* ``G``: groups per version = ``max(K * B, min(prev, MEASURED_CADENCE_CAP * K * B))`` with ``K``
  the declared ``steps_per_version``, ``B`` the batch size and ``prev`` the groups consumed during
  the previous version.
* admit while ``outstanding < capacity = max(1, (S + 1) * G - min(c, G))``.

A group admitted now is then consumed within what the trainer consumes before its version
passes ``version + S`` (``G - c`` more in this version, ``G`` in each of the next ``S``), and a
version that stands still keeps ``S * G`` (at least 1) groups flowing: admission never stops
for good while the trainer takes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

MEASURED_CADENCE_CAP = 4
"""The measured cadence raises ``G`` to at most this many times the declared ``K * B``: a version
that stood still for 1000 steps must not open the gates for the next one."""


@dataclass(frozen=True, slots=True)
class AdmissionTerms:
    """The terms of the admission rule at one moment, and its verdict."""

    outstanding: int
    consumed: int
    c: int
    groups_per_version: int
    capacity: int
    steps_per_version: int
    max_staleness: int
    batch_size: int
    ready: int

    @property
    def room(self) -> int:
        """Prompts the rule admits now (0: refused)."""
        return max(0, self.capacity - self.outstanding)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "room": self.room}

    def describe(self) -> str:
        return (
            f"outstanding {self.outstanding} >= capacity {self.capacity} = max(1, (S {self.max_staleness} + 1) "
            f"x G {self.groups_per_version} - min(c {self.c}, G)); G = groups per version "
            f"(K {self.steps_per_version} x B {self.batch_size}, or the previous version's)"
        )


def groups_per_version(steps_per_version: int, batch_size: int, prev_version_consumed: int) -> int:
    declared = steps_per_version * batch_size
    return max(declared, min(prev_version_consumed, MEASURED_CADENCE_CAP * declared))


def admission_capacity(
    *,
    prompts_pending: int,
    retry_pending: int,
    groups_length: int,
    groups_pending: int,
    committed: int,
    version_start_consumed: int,
    prev_version_consumed: int,
    steps_per_version: int,
    max_staleness: int,
    batch_size: int,
) -> AdmissionTerms:
    """The admission rule's terms (see the module docstring); the one Python copy of ADMIT's
    arithmetic."""
    ready = max(0, groups_length - groups_pending)
    outstanding = prompts_pending + retry_pending + ready
    consumed = committed + groups_pending
    c = max(0, consumed - version_start_consumed)
    g = groups_per_version(steps_per_version, batch_size, prev_version_consumed)
    capacity = max(1, (max_staleness + 1) * g - min(c, g))
    return AdmissionTerms(
        outstanding=outstanding, consumed=consumed, c=c, groups_per_version=g, capacity=capacity,
        steps_per_version=steps_per_version, max_staleness=max_staleness, batch_size=batch_size, ready=ready,
    )


DEFAULT_STALL_AFTER = 60.0
"""Seconds without an admission (prompts queued, nothing ready, producers refused) before
``rollstream inspect`` reports "admission stalled"."""

REFUSALS = ("paused", "backlog", "backlog_bytes", "staleness", "source_backlog")
"""ADMIT's refusals a producer reports in its heartbeat (``empty`` is not one: nothing to admit)."""


def admission_stall(
    *,
    producers_alive: int,
    prompts_waiting: int,
    in_flight_prompts: int,
    ready: int,
    last_admit_age_s: float | None,
    refusals: dict[str, float],
    terms: AdmissionTerms | None,
    stall_after: float,
) -> str | None:
    """The "admission stalled" problem, or None: producers are alive, prompts are queued, no
    group is ready and nothing was admitted for longer than ``stall_after`` while a live producer
    was refused that long (or, after an earlier admission, nothing is in flight). ``refusals``:
    refusal -> the longest time a live producer has been getting it. A pause is the operator's
    choice, not a stall."""
    if producers_alive == 0 or prompts_waiting == 0 or ready > 0 or "paused" in refusals:
        return None
    if last_admit_age_s is not None and last_admit_age_s <= stall_after:
        return None
    long_refusals = {reason: age for reason, age in refusals.items() if age > stall_after}
    if not long_refusals and (in_flight_prompts > 0 or last_admit_age_s is None):
        return None  # busy generating (slow, not stalled), or just started
    since = "never admitted" if last_admit_age_s is None else f"nothing admitted for {last_admit_age_s:.0f} s"
    why = ", ".join(f"{reason} for {age:.0f} s" for reason, age in sorted(long_refusals.items())) or "none"
    detail = f"; {terms.describe()}" if "staleness" in long_refusals and terms is not None else ""
    return (
        f"admission stalled: {prompts_waiting} prompts queued, no group ready, {since} (> {stall_after:.0f} s), "
        f"{in_flight_prompts} in flight; producers refused: {why}{detail}"
    )


def wait_cause(
    *,
    producers_alive: int,
    paused: bool,
    prompts_waiting: int,
    in_flight_prompts: int,
    ready: int,
    refusals: dict[str, float],
    terms: AdmissionTerms | None,
    engine_retries: int,
    last_error: str,
) -> str:
    """Why a ``take()`` that waits gets nothing, most likely cause first (one line)."""
    if producers_alive == 0:
        return "no live producer (start `rollstream produce`)"
    if paused or "paused" in refusals:
        return "admission paused (`rollstream resume` or consumer.resume())"
    if "staleness" in refusals:
        detail = terms.describe() if terms is not None else "see `rollstream inspect`"
        return f"admission blocked by staleness: {detail}"
    if "backlog" in refusals:
        return f"admission blocked by the backlog cap ({ready} groups ready, not taken)"
    if "backlog_bytes" in refusals:
        return f"admission blocked by the byte budget max_backlog_bytes ({ready} groups ready, not taken)"
    if "source_backlog" in refusals:
        return "admission holds back a source whose groups reach its share of max_backlog (another source is behind)"
    if last_error:
        return f"engines failing: {last_error}"
    if prompts_waiting == 0 and in_flight_prompts == 0:
        return "no prompts queued (is the feeder running?)"
    if engine_retries:
        return f"generating, {in_flight_prompts} prompts in flight; engines retried {engine_retries} requests"
    return f"generating: {in_flight_prompts} prompts in flight"


WRITE_ROOM = 64 * 1024
"""A write's arguments are in Redis' memory before it checks the limit: closer than this to
``maxmemory``, the feeder's chunk of prompts is refused all the same (``used_memory`` then idles
just below the limit while every write that carries data is refused)."""


def at_maxmemory(memory: dict[str, Any] | None) -> bool:
    """Redis is within a write's room of its ``maxmemory`` (there, writes are refused)."""
    return bool(memory and memory.get("maxmemory") and memory["used_memory"] >= memory["maxmemory"] - WRITE_ROOM)


def memory_deadlock(
    memory: dict[str, Any] | None,
    *,
    prompts_waiting: int,
    in_flight_prompts: int,
    groups_held: int,
    batch_size: int,
) -> str | None:
    """Why nothing can move at ``maxmemory``, or None. Redis refuses the feeder's writes, so with
    no prompt queued or in flight no group can come, and with fewer groups than a batch (waiting
    and taken together) no ``take()`` completes and no commit frees memory: only raising
    ``maxmemory`` or freeing memory outside the pipeline ends it. Shared by ``inspect`` and
    ``take()`` (memory outside every key counts: a limit set just above ``used_memory`` is eaten
    by client buffers and, on Redis 7, by its per-command latency histograms)."""
    if memory is None or not at_maxmemory(memory):
        return None
    if prompts_waiting > 0 or in_flight_prompts > 0 or groups_held >= batch_size:
        return None
    used, limit = memory["used_memory"] / 2**20, memory["maxmemory"] / 2**20
    return (
        f"deadlock at maxmemory: used_memory {used:.2f} MiB of maxmemory {limit:.2f} MiB (less than "
        f"{WRITE_ROOM // 1024} KiB left for a write), no prompt queued or "
        f"in flight (Redis refuses the feeder's writes) and {groups_held} groups, fewer than a batch of "
        f"{batch_size}: no take() completes and no commit frees memory. Raise maxmemory (CONFIG SET maxmemory) "
        "or free memory outside the pipeline (INFO memory, MEMORY USAGE of other keys; client buffers and "
        "Redis 7's per-command latency histograms are memory outside every key)"
    )
