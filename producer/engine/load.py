"""An engine's own load, and the in-flight limit adapted to it (``--adaptive-concurrency``).

KV memory, not a request count, is what limits an engine: past what fits, requests queue at the
engine (where no other engine can take them) and, as the running ones grow, the engine preempts
some and recomputes them later, which stalls its whole batch. So each engine gets a limit of
samples in flight, between a floor and the producer's ``--concurrency``, moved by what the engine
itself reports (read by the client's monitor every ``load_interval``, the first time as the first
request goes out):

* it **starts** at the floor and doubles at each reading while it holds requests back and the
  KV cache is far from full (below a quarter of :data:`KV_TARGET`: requests grow as they
  generate, so a cache a quarter full may be twice as full once they end, and doubling them
  twice that);
* past that it is **raised** at most once per mean request time (an engine's "round trip": what
  a new limit does to the cache shows only as its requests grow) while it holds requests back:
  in proportion to the room in the cache (to :data:`KV_TARGET` of the fullest reading since the
  last change, at most x :data:`MAX_RAISE`), and by 1/:data:`PROBE_DIVISOR` when the cache was
  fuller than that, probing for the point where the engine starts to preempt;
* it is **cut** to :data:`DECREASE` x the requests the engine runs (or x its limit, if fewer), at
  most once per mean request time, when the engine preempted since the last reading (vLLM's
  ``num_preemptions_total`` grew) or, from an engine that counts no preemptions, when its KV
  cache is full (:data:`KV_FULL`) with requests waiting;
* **held** otherwise. An engine that reports no KV usage (SGLang's ``/get_load``), or no load at
  all, is not limited: it is driven exactly as without the option.

Requests over every engine's limit wait in the client (FIFO), not at an engine, and go to the
first engine with room. Each dialect declares its load endpoints (``loads``, first that answers):
a :class:`LoadEndpoint` is a path and the parser of its reply. :data:`METRICS` (Prometheus
``GET /metrics``: vLLM's ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` (``gpu_cache_usage_perc`` before v0.10), ``vllm:num_preemptions_total``;
SGLang's ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage``) is shared;
SGLang's JSON endpoints are read in :mod:`.sglang`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

LOAD_BYTES = 4 << 20
"""Bound of a load reply (vLLM's ``/metrics`` holds histograms: about 100 KiB per model)."""
DECREASE = 0.9
KV_FULL = 0.95
KV_TARGET = 0.9
MAX_RAISE = 1.25
PROBE_DIVISOR = 16


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What an engine reports of its load; None where its endpoint does not say."""

    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    """Fraction of the KV cache in use, 0..1."""
    preemptions: float | None = None
    """A counter: requests preempted since the engine started."""


_METRICS = {
    "vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage", "vllm:gpu_cache_usage_perc": "kv_usage",
    "vllm:num_preemptions_total": "preemptions",
    "sglang:num_running_reqs": "running", "sglang:num_queue_reqs": "waiting", "sglang:token_usage": "kv_usage",
}


def parse_metrics(text: str) -> EngineLoad | None:
    """The load in Prometheus text (vLLM's or SGLang's ``/metrics``): counts summed over label sets
    (one per engine core or DP rank), KV usage their maximum; None when no load metric is there."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(("vllm:", "sglang:")):
            continue
        brace = line.find("{")
        name = line[: brace if brace >= 0 else line.find(" ")]
        field = _METRICS.get(name)
        if field is None:
            continue
        rest = line[line.rfind("}") + 1 :] if brace >= 0 else line[len(name) :]
        parts = rest.split()
        try:
            value = float(parts[0]) if parts else math.nan
        except ValueError:
            continue
        if not math.isfinite(value) or value < 0:
            continue
        found[field] = max(found.get(field, 0.0), value) if field == "kv_usage" else found.get(field, 0.0) + value
    if not found:
        return None
    running, waiting = found.get("running"), found.get("waiting")
    return EngineLoad(
        None if running is None else int(running), None if waiting is None else int(waiting),
        found.get("kv_usage"), found.get("preemptions"),
    )


@dataclass(frozen=True, slots=True)
class LoadEndpoint:
    """One endpoint where an engine reports its load: ``GET path``, its 200 reply read by ``parse``
    (None when unusable: the next endpoint is tried)."""

    path: str
    parse: Callable[[bytes], EngineLoad | None]


def _metrics_reply(raw: bytes) -> EngineLoad | None:
    return parse_metrics(raw.decode("utf-8", "replace"))


METRICS = LoadEndpoint("/metrics", _metrics_reply)
"""Prometheus text, vLLM's or SGLang's (``--enable-metrics``)."""


class AdaptiveLimit:
    """The in-flight limit of one engine, moved by its load (module docstring)."""

    __slots__ = ("_changed", "_peak", "_preemptions", "floor", "limit")

    def __init__(self, floor: int) -> None:
        self.floor = floor
        self.limit: int | None = floor
        """Samples in flight at most; None: not limited (the engine reports no KV usage)."""
        self._preemptions: float | None = None
        self._peak = 0.0
        """The fullest KV cache read since the limit last changed."""
        self._changed = -math.inf

    def release(self) -> None:
        """No usable load from the engine: it is not limited."""
        self.limit = None

    def update(self, load: EngineLoad, in_flight: int, held: bool, now: float, round_trip: float | None) -> bool:
        """Move the limit on a fresh reading at ``now`` (``held``: requests waited for room on
        this engine since the last one; ``round_trip``: its mean request time, None before the
        first reply); True when it rose or went (waiting requests may go now)."""
        usage = load.kv_usage
        if usage is None:
            opened = self.limit is not None
            self.release()
            return opened
        limit = self.limit if self.limit is not None else max(self.floor, in_flight)
        preemptions, before = load.preemptions, self._preemptions
        counts = preemptions is not None
        preempted = preemptions is not None and before is not None and preemptions > before
        if counts:
            self._preemptions = preemptions
        self._peak = max(self._peak, usage)
        settled = round_trip is not None and now - self._changed >= round_trip
        full = not counts and usage >= KV_FULL and (load.waiting or 0) > 0
        if preempted or full:
            if settled or round_trip is None:
                base = min(limit, max(in_flight, self.floor))
                if load.running is not None:
                    base = min(base, max(load.running, self.floor))
                self._set(max(self.floor, int(base * DECREASE)), now)
            return False
        if not held:
            return False
        if self._peak < KV_TARGET / 4:
            self._set(limit * 2, now)
        elif settled:
            room = min(MAX_RAISE, KV_TARGET / self._peak)  # <= 1 when the cache was that full
            self._set(max(limit + max(1, limit // PROBE_DIVISOR), int(limit * room)), now)
        return self.limit != limit

    def _set(self, limit: int, now: float) -> None:
        self.limit, self._changed, self._peak = limit, now, 0.0
