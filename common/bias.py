"""What the trainer saw against what was fed (issue 38, DESIGN §4.17): the bias ledger.

Every prompt of an epoch falls in one bucket per *dimension*: its prompt length, its response
length, how many times it went back (``attempts``: the lines of its history, whatever the
cause) and its named source (``rollstream feed NAME=PATH``; unnamed sources are not counted).
For each bucket the ledger counts, per epoch, in the ``state`` hash
(``bias:<epoch>:<dimension>:<bucket>:<kind>``):

* ``fed``: the prompt entered the ledger, once, as soon as its value in that dimension is known
  for good: its prompt length with the first group ``take()`` judged of it, its response length
  with its first *complete* group (or its dead letter, a lower bound), its attempts at its end;
* ``trained``: committed in a batch;
* ``dead``: dead-lettered (by ``take()`` or by the producer that ran its last attempt);
* ``filtered``: dropped by the trainer's keep filter (dynamic sampling: a bias it chose);
* ``recycled``: a group of it went back (aborted, stale, failed, filtered), each time.

``fed - trained - dead - filtered`` is what is late: fed, not trained yet. The trained share of a bucket
falling below :data:`WARN_RATIO` of its fed share, by more than chance explains for the counts
(:data:`WARN_P`), is logged by ``take()`` with the counts and the likeliest cause (dead letters,
recycles, lateness) and shown by ``inspect`` and Prometheus.

A dimension is one entry of :data:`DIMENSIONS` (a name and a function of the group). Pure
functions, no I/O.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from .keys import StateField
from .models import Group, Status

PREFIX = StateField.BIAS_PREFIX
"""State hash fields of the ledger: ``bias:<epoch>:<dimension>:<bucket>:<kind>``."""
KINDS = ("fed", "trained", "dead", "filtered", "recycled")
WARN_RATIO = 0.8
"""A bucket whose trained share is below this fraction of its fed share is reported."""
WARN_MIN_TRAINED = 32
"""Groups trained in the epoch before a bucket is judged (the first steps are always the fast half)."""
WARN_MIN_FED = 4
"""Prompts fed in a bucket before it is judged."""
WARN_P = 0.001
"""A shortfall is reported only when a fair trainer would train this few of the bucket with
probability below this (the hypergeometric lower tail: the trained groups drawn from the fed
ones without regard to the bucket); a handful of prompts is noise, not a bias. Strict, as the
test is made at every take, for every bucket."""
KEEP_EPOCHS = 2
"""Epochs kept in the state hash: the current one and the one before."""

PROMPT_EDGES = (64, 256, 1024, 4096)
RESPONSE_EDGES = (128, 512, 2048, 8192)
ATTEMPT_EDGES = (1, 2, 3)


def bucket(value: int, edges: tuple[int, ...]) -> str:
    """The label of ``value``'s bucket: ``<e0``, ``e0-e1``, ..., ``>=eN`` (edges ascending)."""
    if value < edges[0]:
        return f"<{edges[0]}"
    for low, high in itertools.pairwise(edges):
        if value < high:
            return f"{low}-{high - 1}"
    return f">={edges[-1]}"


def _attempts(value: int) -> str:
    return str(value) if value < ATTEMPT_EDGES[-1] else f"{ATTEMPT_EDGES[-1]}+"


def prompt_tokens(group: Group) -> int:
    """Prompt length in tokens (the first sample's prompt ids; else the text's characters / 4)."""
    length = group.samples[0].prompt_length if group.samples else 0
    if length > 0:
        return length
    return len(group.prompt) // 4 if isinstance(group.prompt, str) else 0


def response_tokens(group: Group) -> int:
    """The group's longest response, in tokens."""
    return max((s.response_length for s in group.samples), default=0)


DIMENSIONS: tuple[tuple[str, Callable[[Group], str | None]], ...] = (
    ("prompt", lambda g: bucket(prompt_tokens(g), PROMPT_EDGES)),
    ("response", lambda g: bucket(response_tokens(g), RESPONSE_EDGES)),
    ("attempts", lambda g: _attempts(len(g.history))),
    ("source", lambda g: g.source or None),
)
"""Name -> the bucket of a group (None: not counted in that dimension, e.g. an unnamed source).
A new dimension is one more entry; one whose value is known at first sight is fed like
``prompt`` and ``source`` (:func:`_fed_now`)."""


def complete(group: Group) -> bool:
    return group.status in (Status.COMPLETED, Status.TRUNCATED)


def _seen_complete(group: Group) -> bool:
    """An earlier attempt of the prompt ended complete (it was recycled as stale or filtered)."""
    return any(line.startswith(("stale", "filtered")) for line in group.history)


def _fed_now(dimension: str, group: Group, ended: bool) -> bool:
    """Whether this group is the one that enters the prompt in ``dimension``'s ``fed`` count."""
    if dimension in ("prompt", "source"):
        return not group.history
    if dimension == "response":
        if _seen_complete(group):
            return False
        return complete(group) or ended
    return ended


@functools.lru_cache(maxsize=4096)
def field(epoch: int, dimension: str, label: str, kind: str) -> str:
    """The state hash field of one count (cached: ``take()`` names a few dozen, again and again)."""
    return f"{PREFIX}{epoch}:{dimension}:{label}:{kind}"


def deltas(group: Group, fate: str, into: Counter[str] | None = None) -> Counter[str]:
    """The ledger's increments for one ``fate`` of ``group`` (``trained``, ``dead``, ``filtered``
    or ``recycled``), added to ``into`` (a new counter when None) and returned."""
    out: Counter[str] = Counter() if into is None else into
    ended = fate != "recycled"
    epoch = group.epoch
    for name, of in DIMENSIONS:
        label = of(group)
        if label is None:
            continue
        key = field(epoch, name, label, fate)
        out[key] = out.get(key, 0) + 1
        if _fed_now(name, group, ended):
            key = field(epoch, name, label, "fed")
            out[key] = out.get(key, 0) + 1
    return out


@dataclass(slots=True)
class Bucket:
    """One bucket of one dimension in one epoch."""

    fed: int = 0
    trained: int = 0
    dead: int = 0
    filtered: int = 0
    recycled: int = 0
    fed_share: float = 0.0
    trained_share: float = 0.0
    fed_total: int = 0
    """Prompts fed in the bucket's dimension (every bucket), this epoch."""
    trained_total: int = 0
    """Groups trained in the bucket's dimension, this epoch."""

    @property
    def late(self) -> int:
        return max(0, self.fed - self.trained - self.dead - self.filtered)

    def cause(self) -> str:
        """The likeliest reason the bucket is under-trained."""
        counts = {"dead letters": self.dead, "lateness": self.late, "the keep filter": self.filtered}
        name = max(counts, key=lambda k: counts[k])
        return (
            f"{name} ({self.dead} dead-lettered, {self.late} fed and not trained yet, {self.filtered} filtered; "
            f"{self.recycled} recycles)"
        )

    def short(self, trained_total: int) -> bool:
        """Trained share below :data:`WARN_RATIO` of the fed share, with enough to judge, and a
        shortfall a fair trainer would show with probability below :data:`WARN_P`."""
        return (
            trained_total >= WARN_MIN_TRAINED
            and self.fed >= WARN_MIN_FED
            and self.trained_share < WARN_RATIO * self.fed_share
            and self.p_value() < WARN_P
        )

    def expected(self) -> float:
        """Groups of this bucket a fair trainer would have trained (its fed share of the trained)."""
        return self.trained_total * self.fed / self.fed_total if self.fed_total else 0.0

    def p_value(self) -> float:
        """How likely a fair trainer trains at most :attr:`trained` of this bucket: the trained
        groups drawn without regard to bucket from the fed prompts."""
        total = max(self.fed_total, self.trained_total, self.fed)
        return lower_tail(total, max(self.fed, self.trained), min(self.trained_total, total), self.trained)


Ledger = dict[int, dict[str, dict[str, Bucket]]]
"""epoch -> dimension -> bucket label -> counts."""


def ledger(fields: Mapping[str, int]) -> Ledger:
    """The ledger from the state hash's ``bias:`` fields (others are ignored), shares computed."""
    out: Ledger = {}
    for key, value in fields.items():
        if not key.startswith(PREFIX):
            continue
        parts = key[len(PREFIX):].split(":")
        if len(parts) != 4 or not parts[0].isdigit() or parts[3] not in KINDS:
            continue
        epoch, dimension, label, kind = int(parts[0]), parts[1], parts[2], parts[3]
        buckets = out.setdefault(epoch, {}).setdefault(dimension, {})
        entry = buckets.get(label)
        if entry is None:
            entry = buckets[label] = Bucket()
        setattr(entry, kind, getattr(entry, kind) + int(value))
    for dimensions in out.values():
        for buckets in dimensions.values():
            fed = sum(b.fed for b in buckets.values())
            trained = sum(b.trained for b in buckets.values())
            for b in buckets.values():
                b.fed_share = b.fed / fed if fed else 0.0
                b.trained_share = b.trained / trained if trained else 0.0
                b.fed_total, b.trained_total = fed, trained
    return out


def lower_tail(population: int, marked: int, drawn: int, at_most: int) -> float:
    """P(X <= ``at_most``) for X hypergeometric: ``drawn`` of ``population`` without replacement,
    ``marked`` of them marked. Summed down from ``at_most`` while the terms count (a few standard
    deviations), so large ledgers cost little."""
    low, high = max(0, drawn + marked - population), min(drawn, marked)
    if at_most < low:
        return 0.0
    if at_most >= high:
        return 1.0

    def log_comb(n: int, k: int) -> float:
        return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)

    x = at_most
    term = math.exp(log_comb(marked, x) + log_comb(population - marked, drawn - x) - log_comb(population, drawn))
    total = 0.0
    while term > 0.0 and x >= low:
        total += term
        if term < total * 1e-17:
            break
        # term(x - 1) / term(x)
        term *= x * (population - marked - drawn + x) / ((marked - x + 1) * (drawn - x + 1))
        x -= 1
    return min(1.0, total)


def trained_total(dimensions: Mapping[str, Mapping[str, Bucket]]) -> int:
    first = next(iter(dimensions.values()), {})
    return sum(b.trained for b in first.values())


def short_buckets(epoch: int, dimensions: Mapping[str, Mapping[str, Bucket]]) -> list[str]:
    """One line per under-trained bucket of ``epoch``: which, by how much, the likeliest cause."""
    total = trained_total(dimensions)
    return [
        f"epoch {epoch}: {name} {label}: trained share {b.trained_share:.2f} < {WARN_RATIO:g} x fed share "
        f"{b.fed_share:.2f} ({b.trained} of {b.fed} trained, {b.expected():.1f} expected from the {b.trained_total} "
        f"groups trained of {b.fed_total} prompts fed; a fair trainer falls this short with p = {b.p_value():.1e}); "
        f"cause: {b.cause()}"
        for name, buckets in dimensions.items()
        for label, b in sorted(buckets.items())
        if b.short(total)
    ]


def metrics(epoch: int, dimensions: Mapping[str, Mapping[str, Bucket]]) -> dict[str, float]:
    """``Batch.metrics`` entries of one epoch's ledger (``bias/<dimension>/<bucket>/<what>``)."""
    out: dict[str, float] = {"bias/epoch": float(epoch)}
    for name, buckets in dimensions.items():
        for label, b in buckets.items():
            stem = f"bias/{name}/{label}"
            out[f"{stem}/fed"] = float(b.fed)
            out[f"{stem}/trained"] = float(b.trained)
            out[f"{stem}/fed_share"] = b.fed_share
            out[f"{stem}/trained_share"] = b.trained_share
    return out


def old_fields(fields: Iterable[str], newest: int) -> list[str]:
    """Ledger fields of epochs older than the :data:`KEEP_EPOCHS` up to ``newest``."""
    out = []
    for key in fields:
        if key.startswith(PREFIX):
            epoch = key[len(PREFIX):].split(":", 1)[0]
            if epoch.isdigit() and int(epoch) <= newest - KEEP_EPOCHS:
                out.append(key)
    return out
