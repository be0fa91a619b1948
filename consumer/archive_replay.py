"""Replay: a trainer takes batches from an archive exactly as they were trained.

The archive (``rollstream archive``, :mod:`rollstream.common.archive_schema`) records every
trained group with the commit it was in (``step``) and its place there (``position``).
:class:`ArchiveReplay` hands those commits back in step order as the same :class:`~.batch.Batch`
the trainer took then: the same groups in the same order, the same ``Batch.id`` (a digest of the
original entry ids), the weight version of the time, and numpy views on the recorded bytes. No
Redis and no engines: slime's train-only debugging (``--load-debug-rollout-data``) for rollstream;
the slime/miles integrations use it with ``ROLLSTREAM_REPLAY_ARCHIVE``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from rollstream.common.archive_schema import ArchivePart, missing_runs, one_namespace, read_part, scan_parts
from rollstream.common.checked import is_int
from rollstream.common.codec import decode_group
from rollstream.common.config import PipelineConfig
from rollstream.common.errors import ConfigError, ReplayExhausted

from .batch import Batch, batch_id

logger = logging.getLogger(__name__)

_INDEX_COLUMNS = ("step", "position", "entry_id", "trainer_version", "actor", "fate")
"""What ``open`` reads: every column but the payloads, which ``take`` reads a step at a time."""


@dataclass(frozen=True, slots=True)
class RecordedStep:
    """One recorded commit: where its groups' payloads are, in batch order."""

    step: int
    entry_ids: list[bytes]
    rows: list[tuple[int, int]]
    """(part file number, row in it) of each group, in batch order."""
    weight_version: int
    actor: str
    incomplete: str | None = None
    """Why some of its groups may be missing (a part file is), else None."""


class _Payloads:
    """The ``data`` column of one row group at a time (a step's row groups are read when it is taken)."""

    def __init__(self, parts: Sequence[ArchivePart]) -> None:
        self.parts = parts
        self._cached: tuple[int, int, int, Any] | None = None
        """(part, first row, end, its data column)"""

    def get(self, rows: list[tuple[int, int]]) -> list[bytes]:
        out = []
        for part, row in rows:
            cached = self._cached
            if cached is None or cached[0] != part or not cached[1] <= row < cached[2]:
                self._cached = None  # the previous row group's payloads go before the next's are read
                start, end = self.parts[part].row_group_of(row)
                column = read_part(self.parts[part].path, ["data"], rows=slice(start, end)).column("data")
                self._cached = cached = (part, start, end, column)
            out.append(cached[3][row - cached[1]].as_py())
        return out


class ArchiveReplay:
    """The trained batches of an archive, in step order, with the consumer's ``take`` / ``commit``.

    ``take(target)`` returns the next recorded batch and raises ``ConfigError`` when it held
    another number of groups (a replay changes nothing) or when some of its groups are missing
    from the folder (a part file is gone), :class:`ReplayExhausted` after the last one.
    ``consumer`` keeps the batches of one trainer consumer name when several trained. Only the
    small columns are read on ``open``; each step's payloads are read when it is taken.
    """

    def __init__(self, steps: list[RecordedStep], source: str, payloads: _Payloads) -> None:
        if not steps:
            raise ConfigError(f"{source}: the archive holds no trained batch to replay")
        self.steps = steps
        self.source = source
        self.next = 0
        self._payloads = payloads
        self._version = steps[0].weight_version
        first = payloads.get(steps[0].rows[:1])[0]
        self.config = PipelineConfig(n_samples_per_prompt=len(decode_group(first).samples),
                                     batch_size=len(steps[0].rows))
        """What the replayed run looked like (group size and batch size of its first step)."""

    @classmethod
    def open(cls, path: str | Path, *, consumer: str | None = None, from_step: int | None = None) -> ArchiveReplay:
        """Read the trained records of the archive folder ``path`` (``from_step``: start there)."""
        parts = scan_parts(path)
        one_namespace(parts, path)
        by_step: dict[int, list[tuple[int, str, int, str, int, int]]] = {}
        edges: dict[tuple[int, int], int | None] = {}  # (part, row) of each file's first and last row: its step
        for number, part in enumerate(parts):
            table = read_part(part.path, _INDEX_COLUMNS)
            for row, record in enumerate(table.to_pylist()):
                trained = record["fate"] == "trained" and record["step"] is not None
                if row in (0, part.rows - 1):
                    edges[(number, row)] = record["step"] if trained else None
                if not trained or (consumer is not None and record["actor"] != consumer):
                    continue
                by_step.setdefault(record["step"], []).append(
                    (record["position"], record["entry_id"], record["trainer_version"], record["actor"], number, row)
                )
        incomplete = _bordering_gaps(parts, edges)
        steps = []
        for step in sorted(by_step):
            if from_step is not None and step < from_step:
                continue
            rows = sorted(by_step[step])
            steps.append(RecordedStep(
                step=step, entry_ids=[r[1].encode() for r in rows], rows=[(r[4], r[5]) for r in rows],
                weight_version=rows[0][2], actor=rows[0][3], incomplete=incomplete.get(step),
            ))
        missing = [s for s, t in itertools.pairwise(steps) if t.step != s.step + 1]
        if missing:
            logger.warning(
                "archive %s: trained steps are missing after step(s) %s (archive_dropped? another archive?): "
                "the replay goes on with the next recorded one", path, [s.step for s in missing][:10],
            )
        if broken := [s.step for s in steps if s.incomplete]:
            logger.warning("archive %s: step(s) %s may be incomplete (a part file is missing): take() refuses them, "
                           "seek() past them", path, broken[:10])
        return cls(steps, str(path), _Payloads(parts))

    def __len__(self) -> int:
        return len(self.steps)

    def take_next(self, target: int) -> Batch:
        """The next recorded batch (synchronous: nothing here waits)."""
        if not is_int(target) or target < 1:
            raise ValueError(f"target must be a positive integer, got {target!r}")
        if self.next >= len(self.steps):
            raise ReplayExhausted(f"{self.source}: all {len(self.steps)} recorded batches were replayed")
        step = self.steps[self.next]
        if step.incomplete:
            raise ConfigError(
                f"{self.source}: step {step.step} is incomplete: {len(step.rows)} of its groups are in the archive "
                f"and more may have been trained ({step.incomplete}); restore the file, or seek({step.step + 1}) "
                "to go on after it"
            )
        if len(step.rows) != target:
            raise ConfigError(
                f"{self.source}: step {step.step} trained {len(step.rows)} groups but take({target}) asks "
                f"for {target}: a replay hands out the batches exactly as they were recorded"
            )
        groups = [decode_group(data, views=True) for data in self._payloads.get(step.rows)]
        self.next += 1
        self._version = step.weight_version
        return Batch(
            id=batch_id(step.entry_ids), groups=groups, entry_ids=list(step.entry_ids),
            metrics={"replayed": 1.0, "replay_step": float(step.step), "batch_size": float(len(groups))},
            weight_version=step.weight_version,
        )

    def seek(self, step: int) -> None:
        """Make the recorded step ``step`` (or the first after it) the next one taken."""
        self.next = next((i for i, s in enumerate(self.steps) if s.step >= step), len(self.steps))

    # -- the consumer's API ---------------------------------------------------------------

    async def take(self, target: int, **_: object) -> Batch:
        return self.take_next(target)

    async def commit(self, batch: Batch) -> int:
        """Nothing to acknowledge: the batch's size, as a commit would report."""
        return len(batch)

    async def weight_version(self) -> int:
        """The trainer version the last batch taken was trained at."""
        return self._version

    async def set_weight_version(self, version: int) -> None:
        """Ignored: the recorded versions are replayed."""

    async def aclose(self) -> None:
        """Nothing to close."""

    async def __aenter__(self) -> ArchiveReplay:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


def _bordering_gaps(parts: Sequence[ArchivePart], edges: dict[tuple[int, int], int | None]) -> dict[int, str]:
    """The steps whose records touch a missing part file: a commit's records are one contiguous
    run of the archive stream, so a step may have lost groups only where its first or last
    record is a file's edge next to a break in the chain of files (``missing_runs``)."""
    out: dict[int, str] = {}
    gaps = missing_runs(list(parts))
    for number, before, after in gaps:
        said = f"the records after {before} up to {after} are not in the folder"
        for edge in ((number - 1, parts[number - 1].rows - 1) if number > 0 else None, (number, 0)):
            if edge is not None and (step := edges.get(edge)) is not None:
                out.setdefault(step, said)
    return out
