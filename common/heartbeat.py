"""The producers' heartbeat: its fields, how it is parsed (tolerant of older and newer producers),
the one liveness rule and the one fold of a fleet's heartbeats (:func:`fold`). Pure: no Redis
here (:mod:`.protocol.heartbeats` writes and reads it).

A new field is one declaration: a typed field of :class:`Heartbeat` (``int``, ``float``, ``str`` or
``list[str]``) made with :func:`stat` (its meaning, unit and kind). Parsing, the damage check and
JSON follow from the dataclass; the Prometheus series (``producer/metrics.py``), ``inspect``'s rows
and ``--json`` (``ops/snapshot.py``, ``cli/inspect.py``) from :func:`stats`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .checked import is_number
from .keys import ALIVE_STATES


def _is_number(value: object) -> bool:
    return is_number(value) and math.isfinite(value)


def _heartbeat_object(raw: bytes | str) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except ValueError:  # UnicodeDecodeError included
        raise ValueError("heartbeat is not JSON") from None
    if not isinstance(obj, dict):
        raise ValueError("heartbeat is not a JSON object")
    return obj


COUNTER = "counter"
"""Grows over the producer's life (Prometheus counter)."""
GAUGE = "gauge"
"""A value now (Prometheus gauge)."""
SETTING = "setting"
"""The producer's configuration (a Prometheus gauge)."""
TIME = "time"
"""A moment, epoch milliseconds (a Prometheus gauge; ``inspect`` shows its age)."""
TEXT = "text"
"""A word or a line (a label of the ``rollstream_producer_info`` series)."""
DETAIL = "detail"
"""A list (``inspect`` shows it; Prometheus has the per-engine series instead)."""
NUMERIC = (COUNTER, GAUGE, SETTING, TIME)


@dataclass(frozen=True, slots=True)
class Stat:
    """One producer statistic: what it means, its unit and its kind (:data:`COUNTER`, :data:`GAUGE`,
    ...). The heartbeat, the Prometheus series, ``inspect``'s rows and its ``--json`` follow from it."""

    name: str
    meaning: str
    unit: str
    kind: str

    @property
    def metric(self) -> str:
        """Its Prometheus series (``_total`` added to a counter by the client)."""
        return f"rollstream_producer_{self.name}"


def stat(default: Any, meaning: str, *, kind: str = GAUGE, unit: str = "") -> Any:
    """A :class:`Heartbeat` field with its declaration (a mutable default is given as its factory)."""
    metadata = {"stat": (meaning, unit, kind)}
    if callable(default):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(slots=True)
class Heartbeat:
    """One producer's stats: what it reports every ``heartbeat_interval`` in the ``producers`` hash
    (JSON), its Prometheus series and its ``inspect`` row. Each field is declared once
    (:func:`stat`); :func:`stats` lists them."""

    host: str = stat("", "the producer's host name", kind=TEXT)
    pid: int = stat(0, "the producer's process id", kind=TEXT)
    state: str = stat("unknown", "starting, running, draining, stopped or failed", kind=TEXT)
    in_flight_samples: int = stat(0, "samples admitted and not yet published", unit="samples")
    in_flight_prompts: int = stat(0, "prompts admitted and not yet published", unit="prompts")
    concurrency: int = stat(0, "the producer's prompt concurrency (--concurrency)", kind=SETTING, unit="prompts")
    published: int = stat(0, "groups this producer published", kind=COUNTER, unit="groups")
    groups_last_minute: int = stat(0, "groups published in the last minute", unit="groups")
    duplicates: int = stat(0, "groups not published because another producer had published the prompt",
                           kind=COUNTER, unit="groups")
    reclaimed: int = stat(0, "prompts taken over from a dead producer's leases", kind=COUNTER, unit="prompts")
    engine_retries: int = stat(0, "engine requests retried", kind=COUNTER, unit="requests")
    engines: list[str] = stat(list, "the engine URLs, without credentials", kind=DETAIL)  # noqa: RUF009 (a field)
    started_ms: int = stat(0, "when the producer started", kind=TIME, unit="ms")
    last_seen_ms: int = stat(0, "when this heartbeat was written", kind=TIME, unit="ms")
    admission: str = stat("", "the last ADMIT refusal (paused, backlog, staleness) while it lasts, else empty "
                              "(admitting, or waiting for prompts)", kind=TEXT)
    admission_since_ms: int = stat(0, "when the refusal in admission began", kind=TIME, unit="ms")
    long_requests: int = stat(0, "samples whose engine request has been in flight longer than long_request_s",
                              unit="samples")
    oldest_request_s: float = stat(0.0, "age of the oldest engine request in flight (0 when none)", unit="s")
    long_request_s: float = stat(0.0, "the threshold of long_requests (--long-request-after)", kind=SETTING,
                                 unit="s")
    episodes: int = stat(0, "episodes running now (inside the generate function), engine call or tool time",
                         unit="episodes")
    episodes_peak: int = stat(0, "the most episodes running at once", unit="episodes")
    engine_requests: int = stat(0, "engine requests in flight now; tool time holds none "
                                   "(--engine-concurrency caps it)", unit="requests")
    engine_requests_peak: int = stat(0, "the most engine requests in flight at once", unit="requests")
    episodes_failed: int = stat(0, "episodes whose generate function raised, timed out or returned an invalid "
                                   "result", kind=COUNTER, unit="episodes")
    aborts_continued: int = stat(0, "aborted engine calls continued inside their episode (partial rollout on)",
                                 kind=COUNTER, unit="calls")
    journal_steps: int = stat(0, "durable episodes: steps this producer journaled", kind=COUNTER, unit="steps")
    replayed_steps: int = stat(0, "steps answered from a journal (no engine call or once function made again)",
                               kind=COUNTER, unit="steps")
    episodes_resumed: int = stat(0, "episodes started with a journal (taken over from a killed or drained "
                                    "producer)", kind=COUNTER, unit="episodes")
    resume_diverged: int = stat(0, "of those, the ones whose replay met a different step and went on live",
                                kind=COUNTER, unit="episodes")
    payload_objects_put: int = stat(0, "payload store: objects this producer put (arrays past payload_min_bytes)",
                                    kind=COUNTER, unit="objects")
    payload_bytes_put: int = stat(0, "payload store: bytes of those objects", kind=COUNTER, unit="bytes")
    payload_put_failures: int = stat(0, "payload store: puts that failed (store full or unreachable; retried, "
                                        "then fatal)", kind=COUNTER, unit="puts")
    payload_orphans_swept: int = stat(0, "payload store: objects this producer's reclaim turns swept (put, never "
                                         "published: a producer killed in between)", kind=COUNTER, unit="objects")
    loop_stalls: int = stat(0, "stalls of the event loop over loop_stall_after_s (user code that blocked it: a "
                               "synchronous tool, a heavy reward)", kind=COUNTER, unit="stalls")
    loop_stall_s: float = stat(0.0, "seconds the loop stood still in those stalls, in all", kind=COUNTER,
                               unit="s")
    loop_stall_longest_s: float = stat(0.0, "the longest stall", unit="s")
    loop_stall_where: str = stat("", "the longest stall: its length, the task that ran and the code that held "
                                     "the loop", kind=TEXT)
    loop_lag_max_s: float = stat(0.0, "the loop's largest lag since the previous heartbeat", unit="s")
    loop_stall_after_s: float = stat(0.0, "the stall threshold (--loop-stall-after; default a fifth of the "
                                          "lease, at most 5 s)", kind=SETTING, unit="s")
    weight_versions_from: str = stat("", "where its samples' weight versions come from: engine replies, an "
                                         "endpoint it asks (GET /weight_info, GET /model_info), or trainer at "
                                         "admission (producer/engine/discovery.py)", kind=TEXT)
    engine_fleet: list[dict[str, Any]] = stat(  # noqa: RUF009 (a field with a factory)
        list, "each engine's url, state (joining, healthy, suspect, ejected, wedged, behind, draining), reason, "
              "in_flight, version, errors, replies, tokens, since_s and, where the engine reports it, "
              "prefix_hit_rate (producer/engine/fleet.py)", kind=DETAIL)

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


def stats(cls: type[Heartbeat] = Heartbeat) -> tuple[Stat, ...]:
    """The declared stats, in field order (a field declared without :func:`stat`, as in a test's
    subclass, is a gauge or text with no meaning)."""
    out = []
    for f in fields(cls):
        kind = {"str": TEXT, "int": GAUGE, "float": GAUGE}.get(str(f.type), DETAIL)
        meaning, unit, kind = f.metadata.get("stat", ("", "", kind))
        out.append(Stat(f.name, meaning, unit, kind))
    return tuple(out)


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
