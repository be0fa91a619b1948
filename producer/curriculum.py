"""A curriculum from each row's history: the feeder asks a sampler whether to feed a row now.

The trainer keeps per-row statistics in Redis (``Keys.rows``, field ``<source>:<row>``, kept by
the ROW_STATS script when a group of the row is committed or filtered, with ``init --row-stats K``):
times trained, the mean reward and the reward variance of its last K groups, the last weight
version and epoch. A sampler is one function of them: ``sampler(stats, epoch, draw) -> bool``
(``stats`` None for a row with no history yet, ``draw`` a uniform number in [0, 1) seeded by
the row and the epoch, so a restarted feeder decides the same). A deferred row is skipped for
this epoch only: it comes back in the next one.

:class:`ZeroVarianceDeferral` (``--curriculum zero-variance``) defers a row whose last K groups
all had zero reward variance (always solved, or never): they teach nothing and the
dynamic-sampling filter would drop them after generation. It is still offered with probability
``offer`` each epoch and fed whatever its history once ``max_gap`` epochs have passed since its
last group, so no row is dropped forever. Defaults measured in ``python -m bench data``.

:class:`Deferrals` is the feeder's side: it asks the sampler about each row of a chunk and, when
it defers whole epochs in a row, makes the feed wait between them.
"""

from __future__ import annotations

import json
import logging
import random
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollstream.common.errors import ConfigError
from rollstream.common.imports import import_callable


@dataclass(frozen=True, slots=True)
class RowStats:
    """What the pipeline knows of one row."""

    trained: int
    """Groups of the row that finished (committed or filtered)."""
    rewards: tuple[float, ...]
    """Mean reward of each of its last K groups, oldest first."""
    variances: tuple[float, ...]
    """Reward variance of each of its last K groups."""
    last_version: int
    """The trainer's weight version when its last group finished."""
    last_epoch: int
    """The epoch its last group was fed in."""

    @classmethod
    def parse(cls, raw: bytes | str | None) -> RowStats | None:
        """The stats ROW_STATS wrote, None when absent or unreadable (a row with no history)."""
        if raw is None:
            return None
        try:
            obj = json.loads(raw)
            rewards = obj.get("r") or []
            variances = obj.get("v") or []
            return cls(
                trained=int(obj.get("t", 0)),
                rewards=tuple(float(r) for r in (rewards if isinstance(rewards, list) else [])),
                variances=tuple(float(v) for v in (variances if isinstance(variances, list) else [])),
                last_version=int(obj.get("w", 0)),
                last_epoch=int(obj.get("e", 0)),
            )
        except (ValueError, TypeError, AttributeError):
            return None


Sampler = Callable[[RowStats | None, int, float], bool]
"""``sampler(stats, epoch, draw) -> feed now?``."""


@dataclass(frozen=True, slots=True)
class ZeroVarianceDeferral:
    """Defer rows whose last ``k`` groups had zero reward variance (see the module docstring)."""

    k: int = 1
    offer: float = 0.1
    """Probability a deferred row is fed anyway, each epoch."""
    max_gap: int = 4
    """A row whose last group is this many epochs old is fed whatever its history."""

    def __post_init__(self) -> None:
        if self.k < 1 or self.max_gap < 1 or not 0 < self.offer <= 1:
            raise ConfigError("zero-variance curriculum: k and max_gap must be >= 1, offer in (0, 1]")

    def __call__(self, stats: RowStats | None, epoch: int, draw: float) -> bool:
        if stats is None or len(stats.variances) < self.k:
            return True
        if any(v > 1e-12 for v in stats.variances[-self.k:]):
            return True
        if epoch - stats.last_epoch >= self.max_gap:
            return True
        return draw < self.offer


def load_sampler(spec: str, **options: Any) -> Sampler:
    """``zero-variance`` (with ``options``: k, offer, max_gap) or ``module:function`` (a sampler)."""
    if spec == "zero-variance":
        return ZeroVarianceDeferral(**options)
    sampler: Sampler = import_callable(spec, "curriculum sampler")
    return sampler


def draw(seed: int, epoch: int, source: str, row: int) -> float:
    """The row's uniform draw for ``epoch``: the same on every restart."""
    return random.Random(f"{seed}:{epoch}:{source}:{row}").random()


def row_field(source: str, row: int) -> str:
    """The row's field in ``Keys.rows``."""
    return f"{source}:{row}"


DEFER_WAIT_MAX = 60.0
"""The longest wait between two epochs whose every row the curriculum deferred."""


class Deferrals:
    """The feeder's side of a curriculum: which rows of a chunk ``sampler`` defers (its error a
    ConfigError naming it and the row), and how long to wait when it defers whole epochs."""

    def __init__(self, sampler: Sampler, seed: int, log: logging.LoggerAdapter[logging.Logger]) -> None:
        self.sampler = sampler
        self.seed = seed
        self.log = log
        self.deferred = 0
        """Rows deferred so far."""
        self._run = 0
        self._wait = 0.0

    def decide(self, rows: list[tuple[str, int, int]], stats: list[Any]) -> set[int]:
        """The indexes of ``rows`` (source, epoch, row id) to defer, given each one's raw
        ``rows`` hash value in ``stats``."""
        deferred = set()
        for i, ((source, epoch, rid), raw) in enumerate(zip(rows, stats, strict=True)):
            try:
                feed_now = self.sampler(RowStats.parse(raw), epoch, draw(self.seed, epoch, source, rid))
            except Exception as exc:  # the user's function: its error named, not a traceback from the feeder
                raise ConfigError(
                    f"the curriculum {_name_of(self.sampler)} raised {type(exc).__name__}: {exc} "
                    f"({_where_raised(exc)}) on row {source + ':' if source else ''}{rid} of epoch {epoch}: fix it, "
                    "or feed without --curriculum"
                ) from exc
            if not feed_now:
                deferred.add(i)
        self.deferred += len(deferred)
        return deferred

    def wait_after(self, rows: int, deferred: int, epoch_rows: int, epochs: str) -> float:
        """Seconds to wait after a chunk of ``rows`` of which ``deferred`` were: a curriculum
        that defers every row would walk epoch after epoch at full speed feeding nothing, so after
        ``epoch_rows`` (a whole epoch of every live source) deferred in a row, warn (``epochs``:
        where the sources are) and wait 1 s, doubling to :data:`DEFER_WAIT_MAX` while it lasts, so
        the trainer's statistics can change meanwhile; else 0."""
        if deferred < rows:
            self._run, self._wait = 0, 0.0
            return 0.0
        self._run += rows
        if self._run < epoch_rows:
            return 0.0
        self._wait = min(DEFER_WAIT_MAX, max(1.0, 2 * self._wait))
        self.log.warning(
            "the curriculum deferred every one of the last %d rows (a whole epoch of every source; now at epoch %s): "
            "nothing fed. Waiting %.0f s before going on; a curriculum that defers every row feeds nothing",
            self._run, epochs, self._wait,
        )
        self._run = 0
        return self._wait


def _name_of(function: Any) -> str:
    """A callable as ``module:qualname`` (an instance: its class's)."""
    target = function if hasattr(function, "__qualname__") else type(function)
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', repr(target))}"


def _where_raised(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    return f"at {frames[-1].filename}:{frames[-1].lineno}" if frames else "where unknown"
