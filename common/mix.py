"""Several named sources mixed exactly: the mix's syntax and the apportionment of a batch.

A batch of ``target`` groups gives source ``s`` its ideal share ``w_s * target`` plus what it was
owed from earlier batches (``carry``), rounded by largest remainder; the carry is
``w_s * committed_total - committed_s`` since the mix (or its set of live sources) last changed,
so it lies in (-1, 1) and the long-run ratio is exact to the group. Derived from committed counts
in Redis, it survives trainer restarts.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping

from .errors import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def check_source_name(name: str) -> str:
    if not _NAME.match(name):
        raise ConfigError(f"source name {name!r}: use 1-64 letters, digits, '_', '.' or '-'")
    return name


def parse_mix(text: str) -> dict[str, float]:
    """``"math=0.7,code=0.3"`` as ``{"math": 0.7, "code": 0.3}`` (weights need not sum to 1)."""
    weights: dict[str, float] = {}
    if not text.strip():
        return weights
    for part in text.split(","):
        name, sep, raw = part.strip().partition("=")
        if not sep:
            raise ConfigError(f"mix {text!r}: {part!r} is not NAME=WEIGHT")
        check_source_name(name)
        try:
            weight = float(raw)
        except ValueError:
            raise ConfigError(f"mix {text!r}: weight {raw!r} of {name!r} is not a number") from None
        if not math.isfinite(weight) or weight <= 0:
            raise ConfigError(f"mix {text!r}: weight of {name!r} must be positive, got {raw!r}")
        if name in weights:
            raise ConfigError(f"mix {text!r}: source {name!r} is named twice")
        weights[name] = weight
    return weights


def format_mix(weights: Mapping[str, float]) -> str:
    return ",".join(f"{name}={weight:g}" for name, weight in weights.items())


def normalised(weights: Mapping[str, float]) -> dict[str, float]:
    """The weights as shares summing to 1; scaled by the largest first, so weights near the float
    maximum (``a=1e308,b=1e308``) do not overflow their sum to infinity and every share to 0."""
    largest = max(weights.values(), default=0.0)
    if not largest > 0 or not math.isfinite(largest):
        return {}
    scaled = {name: weight / largest for name, weight in weights.items()}
    total = sum(scaled.values())
    return {name: weight / total for name, weight in scaled.items()}


def carries(weights: Mapping[str, float], committed: Mapping[str, int]) -> dict[str, float]:
    """What each source is owed (or ahead by, negative) after ``committed`` groups per source."""
    shares = normalised(weights)
    total = sum(committed.get(name, 0) for name in shares)
    return {name: share * total - committed.get(name, 0) for name, share in shares.items()}


def apportion(target: int, weights: Mapping[str, float], carry: Mapping[str, float] | None = None) -> dict[str, int]:
    """``target`` split by ``weights`` (plus ``carry``), by largest remainder; every share >= 0."""
    shares = normalised(weights)
    if not shares:
        return {}
    ideal = {name: max(0.0, share * target + (carry or {}).get(name, 0.0)) for name, share in shares.items()}
    scale = sum(ideal.values())
    if scale <= 0:
        ideal = {name: share * target for name, share in shares.items()}
    else:
        ideal = {name: value * target / scale for name, value in ideal.items()}
    out = {name: math.floor(value) for name, value in ideal.items()}
    left = target - sum(out.values())
    by_remainder = sorted(ideal, key=lambda name: (-(ideal[name] - out[name]), -shares[name], name))
    for name in by_remainder[:left]:
        out[name] += 1
    return out


def source_caps(mix: str, max_backlog: int, batch_size: int) -> str:
    """ADMIT's per-source caps on groups held, JSON ``{name: cap}``: each source's share of
    ``max_backlog`` rounded up, and never under its quota of a batch plus one (the carry), so a
    take can always fill its quota ('' without a mix of two sources or more)."""
    shares = normalised(parse_mix(mix))
    if len(shares) < 2:
        return ""
    return json.dumps({
        name: max(math.ceil(max_backlog * share - 1e-9), math.ceil(batch_size * share - 1e-9) + 1)
        for name, share in shares.items()
    })
