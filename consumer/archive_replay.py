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
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from rollstream.common.archive_schema import read_table
from rollstream.common.codec import decode_group
from rollstream.common.config import PipelineConfig
from rollstream.common.errors import ConfigError, ReplayExhausted

from .batch import Batch, batch_id

logger = logging.getLogger(__name__)

_COLUMNS = ("step", "position", "entry_id", "trainer_version", "data", "actor", "arrays_kept", "fate")


@dataclass(frozen=True, slots=True)
class RecordedStep:
    """One recorded commit: its groups' payloads in batch order."""

    step: int
    entry_ids: list[bytes]
    payloads: list[bytes]
    weight_version: int
    actor: str


class ArchiveReplay:
    """The trained batches of an archive, in step order, with the consumer's ``take`` / ``commit``.

    ``take(target)`` returns the next recorded batch and raises ``ConfigError`` when it held
    another number of groups (a replay changes nothing), :class:`ReplayExhausted` after the last
    one. ``consumer`` keeps the batches of one trainer consumer name when several trained.
    """

    def __init__(self, steps: list[RecordedStep], source: str) -> None:
        if not steps:
            raise ConfigError(f"{source}: the archive holds no trained batch to replay")
        self.steps = steps
        self.source = source
        self.next = 0
        self._version = steps[0].weight_version
        sizes = {len(decode_group(steps[0].payloads[0]).samples)}
        self.config = PipelineConfig(n_samples_per_prompt=sizes.pop(), batch_size=len(steps[0].payloads))
        """What the replayed run looked like (group size and batch size of its first step)."""

    @classmethod
    def open(cls, path: str | Path, *, consumer: str | None = None, from_step: int | None = None) -> ArchiveReplay:
        """Read the trained records of the archive folder ``path`` (``from_step``: start there)."""
        table = read_table(path, _COLUMNS)
        by_step: dict[int, list[tuple[int, str, bytes, int, str]]] = {}
        for row in table.to_pylist():
            if row["fate"] != "trained" or row["step"] is None:
                continue
            if consumer is not None and row["actor"] != consumer:
                continue
            by_step.setdefault(row["step"], []).append(
                (row["position"], row["entry_id"], row["data"], row["trainer_version"], row["actor"])
            )
        steps = []
        for step in sorted(by_step):
            if from_step is not None and step < from_step:
                continue
            rows = sorted(by_step[step])
            steps.append(RecordedStep(
                step=step, entry_ids=[r[1].encode() for r in rows], payloads=[r[2] for r in rows],
                weight_version=rows[0][3], actor=rows[0][4],
            ))
        missing = [s for s, t in itertools.pairwise(steps) if t.step != s.step + 1]
        if missing:
            logger.warning(
                "archive %s: trained steps are missing after step(s) %s (archive_dropped? another archive?): "
                "the replay goes on with the next recorded one", path, [s.step for s in missing][:10],
            )
        return cls(steps, str(path))

    def __len__(self) -> int:
        return len(self.steps)

    def take_next(self, target: int) -> Batch:
        """The next recorded batch (synchronous: nothing here waits)."""
        if isinstance(target, bool) or not isinstance(target, int) or target < 1:
            raise ValueError(f"target must be a positive integer, got {target!r}")
        if self.next >= len(self.steps):
            raise ReplayExhausted(f"{self.source}: all {len(self.steps)} recorded batches were replayed")
        step = self.steps[self.next]
        if len(step.payloads) != target:
            raise ConfigError(
                f"{self.source}: step {step.step} trained {len(step.payloads)} groups but take({target}) asks "
                f"for {target}: a replay hands out the batches exactly as they were recorded"
            )
        self.next += 1
        self._version = step.weight_version
        groups = [decode_group(data, views=True) for data in step.payloads]
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
