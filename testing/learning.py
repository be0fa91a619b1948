"""The arithmetic of the learning-speed measurement (issue 30), apart from the model and torch.

Three pieces that ``examples/tiny_grpo.py`` and ``bench/learning.py`` share and the fast tests
check without a model: the schedule (sync, one-off, async) a run's flags resolve to, the
off-policy correction's token weights from the behaviour log-probs, and the speed-up bound of
overlapping generation with training.

Correction (``tis``, ``mis``): the trainer recomputes each response token's log-prob with the
weights it holds (the proximal policy), and the behaviour log-prob is what the engine reported
when it sampled the token. Their ratio ``r = exp(trainer - behaviour)`` re-weights the token's
policy-gradient term: truncated (``min(r, cap)``, TIS) or masked (``r`` where ``r <= cap``,
else 0: MIS). At staleness 0 both policies are the same weights, so ``r`` must be 1 within
float error; anything else means the log-probs are not the behaviour policy's.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from rollstream.common.errors import ConfigError

SCHEDULES = ("sync", "one-off", "async")
CORRECTIONS = ("none", "tis", "mis")
STALENESS_ZERO_TOLERANCE = 1e-3
"""|r - 1| a staleness-0 token may show: fp32 vLLM vs transformers agree to ~1e-5 in log-prob."""


@dataclass(frozen=True)
class Schedule:
    """What a ``--schedule`` means for the pipeline's configuration."""

    name: str
    max_staleness: int
    partial_rollout: bool


def resolve_schedule(schedule: str | None, max_staleness: int | None, partial_rollout: bool | None) -> Schedule:
    """The schedule the flags ask for, or a ConfigError that names the contradiction.

    ``sync``: max_staleness 0 (staleness-aware admission then lets batch k in only once version k
    is set: the engine generates on the current weights, then waits while the trainer trains);
    ``one-off``: max_staleness 1; ``async``: max_staleness >= 2 with partial rollout (aborted
    samples continue). Without ``--schedule`` the staleness picks it (0, 1, >= 2)."""
    if schedule is None:
        staleness = 1 if max_staleness is None else max_staleness
        if staleness < 0:
            raise ConfigError(f"--max-staleness must be >= 0, got {staleness}")
        schedule = "sync" if staleness == 0 else "one-off" if staleness == 1 else "async"
    if schedule not in SCHEDULES:
        raise ConfigError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    wanted = {"sync": 0, "one-off": 1, "async": 2}[schedule]
    staleness = wanted if max_staleness is None else max_staleness
    if schedule == "async" and staleness < 2:
        raise ConfigError(
            f"--schedule async needs --max-staleness >= 2 (got {staleness}); use one-off for 1, sync for 0"
        )
    if schedule != "async" and staleness != wanted:
        raise ConfigError(
            f"--schedule {schedule} means --max-staleness {wanted}, got {staleness}: "
            + ("a synchronous run trains only on samples of its current weights" if schedule == "sync"
               else "use --schedule async for 2 or more")
        )
    partial = schedule == "async" if partial_rollout is None else partial_rollout
    if schedule == "sync" and partial:
        raise ConfigError("--schedule sync with --partial-rollout: nothing is in flight at a synchronous update")
    return Schedule(schedule, staleness, partial)


def check_correction(kind: str, cap: float) -> None:
    if kind not in CORRECTIONS:
        raise ConfigError(f"--correction must be one of {', '.join(CORRECTIONS)}, got {kind!r}")
    if not cap > 1.0 or math.isinf(cap):
        raise ConfigError(f"--is-cap must be a finite number above 1, got {cap}")


def importance_weights(trainer_logp: Any, behaviour_logp: Any, kind: str, cap: float) -> tuple[Any, Any]:
    """``(weights, ratio)`` per token, both without gradient: ``ratio = exp(trainer - behaviour)``,
    the weights ``1`` (none), ``min(ratio, cap)`` (tis) or ``ratio * (ratio <= cap)`` (mis).
    Tensors (torch) in, tensors out; the subtraction happens in float64 so a staleness-0 ratio
    is 1 up to the log-probs' own disagreement, not the arithmetic's."""
    import torch

    ratio = torch.exp(trainer_logp.detach().double() - behaviour_logp.double())
    if kind == "none":
        weights = torch.ones_like(ratio)
    elif kind == "tis":
        weights = torch.clamp(ratio, max=cap)
    elif kind == "mis":
        weights = torch.where(ratio <= cap, ratio, torch.zeros_like(ratio))
    else:
        raise ConfigError(f"unknown correction {kind!r}")
    return weights.to(trainer_logp.dtype), ratio


def mask_by_lag(weights: Any, lags: Any, max_lag: int | None) -> tuple[Any, int]:
    """``(weights, masked)``: the token weights with those of tokens whose version lag exceeds
    ``max_lag`` set to 0 (None: unchanged), and how many were. ``lags`` is the sample's
    ``Batch.token_lags_numpy()`` entry (or a tensor of it), aligned with the weights; numpy
    arrays and torch tensors alike."""
    if max_lag is None:
        return weights, 0
    keep = lags <= max_lag
    return weights * keep, int((~keep).sum())


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default) of a non-empty sequence."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def ratio_stats(ratios_by_staleness: dict[int, list[float]]) -> dict[str, dict[str, float]]:
    """Per staleness level: the ratio's mean, p1, p99, max |r - 1| and the token count."""
    out: dict[str, dict[str, float]] = {}
    for stale in sorted(ratios_by_staleness):
        values = ratios_by_staleness[stale]
        if values:
            out[str(stale)] = {
                "mean": statistics.fmean(values), "p1": quantile(values, 0.01), "p99": quantile(values, 0.99),
                "max_dev": max(abs(v - 1.0) for v in values), "tokens": float(len(values)),
            }
    return out


@dataclass(frozen=True)
class Bound:
    """The overlap bound from a step's generation time G and training time T."""

    generate_s: float
    train_s: float

    @property
    def sync_step(self) -> float:
        """A synchronous step: generate, then train."""
        return self.generate_s + self.train_s

    @property
    def async_step(self) -> float:
        """A fully overlapped step: the slower of the two sides."""
        return max(self.generate_s, self.train_s)

    @property
    def speedup(self) -> float:
        return self.sync_step / self.async_step

    def fraction(self, measured_speedup: float) -> float:
        """The measured speed-up as a fraction of the bound (1.0: all the overlap allows)."""
        return measured_speedup / self.speedup


def median_and_range(values: Iterable[float]) -> tuple[float, float, float]:
    """(median, min, max) of the finite values; NaNs when there are none."""
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return math.nan, math.nan, math.nan
    return statistics.median(finite), min(finite), max(finite)


def first_reaching(points: Sequence[tuple[int, float, float]], target: float) -> tuple[int, float] | None:
    """The first ``(step, wall_s)`` whose eval reward is at least ``target``; points are
    ``(step, wall_s, reward)`` in step order. None when none reaches it."""
    for step, wall, reward in points:
        if reward >= target:
            return step, wall
    return None
