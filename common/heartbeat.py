"""The producers' heartbeat: its fields, how it is parsed (tolerant of older and newer producers)
and the one liveness rule. Pure: no Redis here (:mod:`.protocol.heartbeats` writes and reads it)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .keys import ALIVE_STATES

_HEARTBEAT_INTS = (
    "pid", "in_flight_samples", "in_flight_prompts", "concurrency", "published", "groups_last_minute",
    "duplicates", "reclaimed", "engine_retries", "started_ms", "last_seen_ms", "long_requests",
    "admission_since_ms", "episodes", "episodes_peak", "engine_requests", "engine_requests_peak",
    "episodes_failed", "aborts_continued",
)
_HEARTBEAT_FLOATS = ("oldest_request_s", "long_request_s")


def _is_number(value: Any) -> bool:
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

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def parse(cls, raw: bytes | str) -> Heartbeat:
        """The heartbeat in ``raw``; ValueError when it is not a JSON object. Unknown keys are
        ignored and missing or damaged ones take their defaults (older and newer producers both
        parse); :meth:`damage` says what was damaged."""
        obj = _heartbeat_object(raw)
        beat = cls()
        for name in _HEARTBEAT_INTS:
            value = obj.get(name)
            if isinstance(value, int | float) and _is_number(value):
                setattr(beat, name, int(value))
        for name in _HEARTBEAT_FLOATS:
            value = obj.get(name)
            if isinstance(value, int | float) and _is_number(value):
                setattr(beat, name, float(value))
        for name in ("host", "state", "admission"):
            if isinstance(obj.get(name), str):
                setattr(beat, name, obj[name])
        if isinstance(obj.get("engines"), list):
            beat.engines = [str(e) for e in obj["engines"]]
        return beat

    @staticmethod
    def damage(raw: bytes | str) -> str | None:
        """What is wrong with a raw heartbeat (for ``inspect``), or None."""
        try:
            obj = _heartbeat_object(raw)
        except ValueError as exc:
            return str(exc)
        bad = [n for n in (*_HEARTBEAT_INTS, *_HEARTBEAT_FLOATS) if n in obj and not _is_number(obj[n])]
        bad += [n for n in ("host", "state", "admission") if n in obj and not isinstance(obj[n], str)]
        return f"fields {', '.join(bad)} have the wrong type" if bad else None

    def fresh(self, now: int, timeout_s: float) -> bool:
        """Seen within ``timeout_s`` seconds before ``now`` (ms)."""
        return self.last_seen_ms >= now - timeout_s * 1000

    def alive(self, now: int, timeout_s: float) -> bool:
        """The liveness rule: a fresh heartbeat of a live state (starting, running, draining)."""
        return self.fresh(now, timeout_s) and self.state in ALIVE_STATES


def live_producers(raw: Mapping[bytes, bytes], now: int, timeout_s: float) -> tuple[int, int]:
    """(producers alive, in-flight samples of the alive ones) from the raw ``producers`` hash."""
    alive = in_flight = 0
    for value in raw.values():
        try:
            beat = Heartbeat.parse(value)
        except ValueError:
            continue
        if beat.alive(now, timeout_s):
            alive += 1
            in_flight += beat.in_flight_samples
    return alive, in_flight


def admission_refusals(raw: Mapping[bytes, bytes], now: int, timeout_s: float) -> dict[str, float]:
    """ADMIT refusal -> the longest time (s) a live producer has been getting it, from the raw
    ``producers`` hash."""
    out: dict[str, float] = {}
    for value in raw.values():
        try:
            beat = Heartbeat.parse(value)
        except ValueError:
            continue
        if beat.alive(now, timeout_s) and beat.admission and beat.admission_since_ms:
            age = max(0.0, (now - beat.admission_since_ms) / 1000)
            out[beat.admission] = max(out.get(beat.admission, 0.0), age)
    return out
