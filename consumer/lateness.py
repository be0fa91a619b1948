"""No prompt starves unseen (issue 38, DESIGN §4.17): a prompt admitted at step ``s`` should be
trained by step ``s + g + 1``, ``g`` its generation time in steps; a later one is reported with
its cause. Pure bookkeeping, no I/O: the consumer feeds it each take's time and batch.

Steps are the consumer's ``take()`` calls: step ``k`` is the time after its ``k``-th take
returned. A group carries when its prompt was first admitted (``Group.admitted_ms``, kept across
attempts) and how long its last attempt took (``Group.generated_ms``); ``g`` is that time over
the median step of the last :data:`STEP_WINDOW` steps, rounded up.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import statistics
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from rollstream.common.keys import StateField
from rollstream.common.logs import Prefixed
from rollstream.common.models import Group

logger = logging.getLogger("rollstream.consumer.group_consumer")
"""The consumer's logger: the warning comes from ``take()``."""

STEP_WINDOW = 16
"""Steps whose median length converts a generation time into steps."""
KEEP_STEPS = 100_000
"""Take times kept (8 bytes each): a prompt admitted before the oldest is not judged."""
LATE_GROUPS = StateField.LATE_GROUPS
LATE_PREFIX = StateField.LATE_PREFIX

CAUSES = (
    ("weight_update", "aborted by weight updates"),
    ("stale", "recycled as stale"),
    ("aborted", "aborted by the engine"),
    ("failed", "failed"),
    ("filtered", "filtered and recycled"),
)
"""History line prefix -> what it says about a late prompt, most telling first."""
QUEUED = "queued"
"""The cause when the prompt never went back: it waited for engine slots or in the backlog."""


def cause_of(history: Iterable[str]) -> tuple[str, str]:
    """``(key, text)``: why a prompt with this history is late (its most frequent recycle)."""
    counts: Counter[str] = Counter()
    for line in history:
        for key, _ in CAUSES:
            if line.startswith(key):
                counts[key] += 1
                break
    if not counts:
        return QUEUED, "queued: it never went back (it waited for engine slots, or behind earlier groups)"
    key = max(counts, key=lambda k: (counts[k], -[c for c, _ in CAUSES].index(k)))
    text = dict(CAUSES)[key]
    others = ", ".join(f"{dict(CAUSES)[k]} {n}" for k, n in counts.items() if k != key)
    return key, f"{text} ({counts[key]} times{'; also ' + others if others else ''})"


@dataclass(frozen=True, slots=True)
class Late:
    """One group trained after its deadline."""

    index: int
    epoch: int
    admitted_step: int
    generation_steps: int
    trained_step: int
    cause: str
    why: str

    @property
    def steps(self) -> int:
        return self.trained_step - (self.admitted_step + self.generation_steps + 1)


class StepClock:
    """The consumer's steps in time, and the late groups of each batch."""

    def __init__(self, name: str, namespace: str, interval: float) -> None:
        self.name = name
        self.namespace = namespace
        self.interval = interval
        self.log = Prefixed(logger, "consumer", name, namespace)
        self._started_ms = int(time.time() * 1000)
        self._times: list[int] = []
        self._dropped = 0
        self._warned_at = -math.inf
        self._pending: Counter[str] = Counter()
        """Late groups by cause since the last WARNING."""
        self._worst: Late | None = None
        """The latest of them (most steps late)."""

    @property
    def steps(self) -> int:
        return self._dropped + len(self._times)

    def step_at(self, ms: int) -> int | None:
        """The step ``ms`` fell in; None when it is older than what is known."""
        if ms < self._started_ms or (self._dropped and ms < self._times[0]):
            return None
        return self._dropped + bisect.bisect_right(self._times, ms)

    def step_ms(self) -> float | None:
        recent = self._times[-STEP_WINDOW - 1:]
        if len(recent) < 2:
            return None
        return statistics.median(b - a for a, b in itertools.pairwise(recent))

    def late(self, groups: Iterable[Group]) -> list[Late]:
        """The groups of the batch about to be returned (this step) that are late."""
        trained = self.steps
        step = self.step_ms()
        out = []
        for group in groups:
            if not group.admitted_ms:
                continue
            admitted = self.step_at(group.admitted_ms)
            if admitted is None:
                continue
            generation = math.ceil(group.generated_ms / step) if step and group.generated_ms else 0
            if trained - (admitted + generation + 1) > 0:
                key, why = cause_of(group.history)
                out.append(Late(group.index, group.epoch, admitted, generation, trained, key, why))
        return out

    def took(self, now_ms: int) -> None:
        """A take returned at ``now_ms``: the next step begins."""
        self._times.append(now_ms)
        if len(self._times) > KEEP_STEPS:
            drop = len(self._times) - KEEP_STEPS
            del self._times[:drop]
            self._dropped += drop

    def report(self, late: list[Late]) -> tuple[dict[str, float], Counter[str]]:
        """The batch's ``lateness/...`` metrics and state counters. Each late group is logged at
        DEBUG; at WARNING, at most once per ``interval`` seconds, one line sums up the late groups
        since the last one: how many, by cause, and the worst of them (a long tail of one-step-late
        groups is one line, not one per group)."""
        counts: Counter[str] = Counter(item.cause for item in late)
        worst = max(late, key=lambda item: item.steps, default=None)
        metrics = {
            "lateness/groups": float(len(late)),
            "lateness/steps_max": float(worst.steps if worst is not None else 0),
            **{f"lateness/{key}": float(n) for key, n in counts.items()},
        }
        if worst is not None:
            metrics["lateness/worst_index"] = float(worst.index)
        state: Counter[str] = Counter({f"{LATE_PREFIX}{key}": n for key, n in counts.items()})
        if late:
            state[LATE_GROUPS] = len(late)
        for item in late:
            self.log.debug("%s", _detail(item))
        self._pending.update(counts)
        if worst is not None and (self._worst is None or worst.steps > self._worst.steps):
            self._worst = worst
        now = time.monotonic()
        if self._worst is not None and now - self._warned_at >= self.interval:
            total = sum(self._pending.values())
            since = "" if self._warned_at == -math.inf else f" in the last {now - self._warned_at:.0f} s"
            self.log.warning(
                "%d group%s trained late%s (%s); the worst: %s",
                total, "" if total == 1 else "s", since,
                ", ".join(f"{key} {n}" for key, n in self._pending.most_common()), _detail(self._worst),
            )
            self._warned_at = now
            self._pending.clear()
            self._worst = None
        return metrics, state


def _detail(item: Late) -> str:
    return (
        f"prompt {item.index} (epoch {item.epoch}) trained {item.steps} steps late: admitted at step "
        f"{item.admitted_step}, generation ~{item.generation_steps} steps, trained at step {item.trained_step}; "
        f"cause: {item.why}"
    )
