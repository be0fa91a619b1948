"""The producers' heartbeat: its fields, how it is parsed (tolerant of older and newer producers),
the one liveness rule and the one fold of a fleet's heartbeats (:func:`fold`). Pure: no Redis
here (:mod:`.protocol.heartbeats` writes and reads it).

A new field is one edit: a typed field of :class:`Heartbeat` (``int``, ``float``, ``str`` or
``list[str]``); parsing, the damage check and JSON follow from the dataclass.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .keys import ALIVE_STATES


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _heartbeat_object(raw: bytes | str) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except ValueError:  # UnicodeDecodeError included
        raise ValueError("heartbeat is not JSON") from None
    if not isinstance(obj, dict):
        raise ValueError("heartbeat is not a JSON object")
    return obj


@dataclass(slots=True)
class Heartbeat:
    """What a producer reports every ``heartbeat_interval`` in the ``producers`` hash (JSON)."""

    host: str = ""
    pid: int = 0
    state: str = "unknown"
    in_flight_samples: int = 0
    in_flight_prompts: int = 0
    concurrency: int = 0
    published: int = 0
    groups_last_minute: int = 0
    duplicates: int = 0
    reclaimed: int = 0
    engine_retries: int = 0
    engines: list[str] = field(default_factory=list)
    started_ms: int = 0
    last_seen_ms: int = 0
    admission: str = ""
    """The last ADMIT refusal (``paused``, ``backlog``, ``staleness``) while it lasts, else ``""``
    (admitting, or waiting for prompts: ``empty``)."""
    admission_since_ms: int = 0
    """When the refusal in ``admission`` began."""
    long_requests: int = 0
    """Samples whose engine request has been in flight longer than ``long_request_s``."""
    oldest_request_s: float = 0.0
    """Age of the oldest engine request in flight (0 when none)."""
    long_request_s: float = 0.0
    """The producer's threshold for ``long_requests`` (``--long-request-after``)."""
    episodes: int = 0
    """Episodes running now (inside the generate function), engine call or tool time."""
    episodes_peak: int = 0
    engine_requests: int = 0
    """Engine requests in flight now: tool time holds none (``--engine-concurrency`` caps it)."""
    engine_requests_peak: int = 0
    episodes_failed: int = 0
    """Episodes whose generate function raised, timed out or returned an invalid result."""
    aborts_continued: int = 0
    """Aborted engine calls continued inside their episode (partial rollout on)."""
    journal_steps: int = 0
    """Durable episodes: steps this producer journaled."""
    replayed_steps: int = 0
    """Steps answered from a journal (no engine call or ``once`` function made again)."""
    episodes_resumed: int = 0
    """Episodes started with a journal (taken over from a killed or drained producer)."""
    resume_diverged: int = 0
    """Of those, the ones whose replay met a different step and went on live."""
    loop_stalls: int = 0
    """Stalls of the producer's event loop over ``loop_stall_after_s`` (user code that blocked it:
    a synchronous tool, a heavy reward), since it started (:mod:`.watchdog`)."""
    loop_stall_s: float = 0.0
    """Seconds the loop stood still in those stalls, in all."""
    loop_stall_longest_s: float = 0.0
    loop_stall_where: str = ""
    """The longest stall: its length, the task that ran and the code that held the loop."""
    loop_lag_max_s: float = 0.0
    """The loop's largest lag since the previous heartbeat."""
    loop_stall_after_s: float = 0.0
    """The producer's stall threshold (``--loop-stall-after``; default a fifth of the lease, at most 5 s)."""
    weight_versions_from: str = ""
    """Where its samples' weight versions come from: ``engine replies`` (SGLang ``meta_info``, vLLM
    spans), an endpoint it asks (``GET /weight_info``, ``GET /model_info``), or ``trainer at
    admission`` when its engines report none (``producer/engine/discovery.py``)."""
    engine_fleet: list[dict[str, Any]] = field(default_factory=list)
    """Each engine's ``url``, ``state`` (joining, healthy, suspect, ejected, wedged, behind, draining),
    ``reason``, ``in_flight``, ``version``, ``errors``, ``replies``, ``tokens``, ``since_s`` and,
    where the engine reports it, ``prefix_hit_rate`` (``producer/engine/fleet.py``)."""

    def troubled_engines(self) -> list[dict[str, Any]]:
        """The engines not healthy (for ``inspect`` and ``take()``'s waiting warning)."""
        return [e for e in self.engine_fleet if e.get("state") not in ("healthy", None)]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def parse(cls, raw: bytes | str) -> Heartbeat:
        """The heartbeat in ``raw``; ValueError when it is not a JSON object. Unknown keys are
        ignored and missing or damaged ones take their defaults (older and newer producers both
        parse); :meth:`damage` says what was damaged."""
        obj = _heartbeat_object(raw)
        beat = cls()
        for name, kind in _field_kinds(cls).items():
            if name in obj and _fits(kind, value := obj[name]):
                if kind is dict:
                    setattr(beat, name, [e for e in value if isinstance(e, dict)])
                else:
                    setattr(beat, name, [str(e) for e in value] if kind is list else kind(value))
        return beat

    @classmethod
    def damage(cls, raw: bytes | str) -> str | None:
        """What is wrong with a raw heartbeat (for ``inspect``), or None."""
        try:
            obj = _heartbeat_object(raw)
        except ValueError as exc:
            return str(exc)
        bad = [
            n for n, kind in _field_kinds(cls).items()
            if n in obj and kind not in (list, dict) and not _fits(kind, obj[n])
        ]
        return f"fields {', '.join(bad)} have the wrong type" if bad else None

    def fresh(self, now: int, timeout_s: float) -> bool:
        """Seen within ``timeout_s`` seconds before ``now`` (ms)."""
        return self.last_seen_ms >= now - timeout_s * 1000

    def alive(self, now: int, timeout_s: float) -> bool:
        """The liveness rule: a fresh heartbeat of a live state (starting, running, draining)."""
        return self.fresh(now, timeout_s) and self.state in ALIVE_STATES


_KINDS: dict[str, type] = {"int": int, "float": float, "str": str, "list[str]": list, "list[dict[str, Any]]": dict}
"""A field's annotation -> the JSON type it is read from (a ``list[str]``'s items are read as
``str``; a ``list[dict[str, Any]]`` keeps its JSON objects, anything else in it dropped)."""
_CLASS_KINDS: dict[type, dict[str, type]] = {}


def _field_kinds(cls: type[Heartbeat]) -> dict[str, type]:
    """Each heartbeat field's JSON kind, from its annotation (once per class); an unsupported type
    fails the import."""
    if (known := _CLASS_KINDS.get(cls)) is not None:
        return known
    out = {}
    for f in fields(cls):
        if f.type not in _KINDS:
            raise TypeError(f"{cls.__name__}.{f.name}: type {f.type!r} is not one of {sorted(_KINDS)}")
        out[f.name] = _KINDS[str(f.type)]
    _CLASS_KINDS[cls] = out
    return out


_field_kinds(Heartbeat)


def _fits(kind: type, value: object) -> bool:
    if kind is dict:
        return isinstance(value, list)
    return _is_number(value) if kind in (int, float) else isinstance(value, kind)


@dataclass(frozen=True, slots=True)
class Member:
    """One entry of the ``producers`` hash, judged once: its raw value, its heartbeat (None when
    unreadable, ``error`` saying why), whether it is fresh and alive."""

    name: str
    raw: bytes | str
    beat: Heartbeat | None
    error: str = ""
    fresh: bool = False
    alive: bool = False


@dataclass(frozen=True, slots=True)
class Fleet:
    """The producers as their heartbeats tell (:func:`fold`)."""

    members: tuple[Member, ...]
    now: int

    @property
    def alive(self) -> list[Member]:
        return [m for m in self.members if m.alive]

    @property
    def alive_names(self) -> list[str]:
        return sorted(m.name for m in self.alive)

    @property
    def in_flight(self) -> int:
        """In-flight samples of the live producers."""
        return sum(m.beat.in_flight_samples for m in self.alive if m.beat is not None)

    @property
    def refusals(self) -> dict[str, float]:
        """ADMIT refusal -> the longest time (s) a live producer has been getting it."""
        out: dict[str, float] = {}
        for m in self.alive:
            if m.beat is not None and m.beat.admission and m.beat.admission_since_ms:
                age = max(0.0, (self.now - m.beat.admission_since_ms) / 1000)
                out[m.beat.admission] = max(out.get(m.beat.admission, 0.0), age)
        return out


def fold(raw: Mapping[bytes, bytes] | Mapping[str, str], now: int, timeout_s: float) -> Fleet:
    """The one fold of the raw ``producers`` hash (name -> heartbeat JSON) under the liveness rule."""
    members = []
    for name, value in raw.items():
        text = name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)
        try:
            beat = Heartbeat.parse(value)
        except ValueError as exc:
            members.append(Member(text, value, None, str(exc)))
            continue
        members.append(Member(text, value, beat, "", beat.fresh(now, timeout_s), beat.alive(now, timeout_s)))
    return Fleet(tuple(members), now)


def live_producers(raw: Mapping[bytes, bytes], now: int, timeout_s: float) -> tuple[int, int]:
    """(producers alive, in-flight samples of the alive ones) from the raw ``producers`` hash."""
    fleet = fold(raw, now, timeout_s)
    return len(fleet.alive), fleet.in_flight


def admission_refusals(raw: Mapping[bytes, bytes], now: int, timeout_s: float) -> dict[str, float]:
    """ADMIT refusal -> the longest time (s) a live producer has been getting it, from the raw
    ``producers`` hash."""
    return fold(raw, now, timeout_s).refusals
