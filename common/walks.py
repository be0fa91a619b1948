"""An epoch's order over a dataset's rows, computed from row ids alone: the units in a seeded
permutation, their rows through a seeded shuffle buffer (:class:`BufferedWalk`), or a full
permutation (:class:`PermutedWalk`), which is what makes resuming at any position exact without
reading what came before. :class:`EpochWalk` picks the one an :class:`Order` asks for.

Trade-off of the buffered shuffle: a row moves at most about ``shuffle_buffer`` places from where
its unit put it, so rows of one unit stay closer together than a full permutation would keep
them. A dataset that fits in the buffer gets a full permutation (the same as before streaming);
slime's scheme always does (it is slime's order). A full permutation costs 8 bytes per row (the
permuted ids, and for JSONL each row's start in its unit) and reads its rows a block at a time.
Smaller Parquet row groups (say 10k-50k rows) make the buffered shuffle closer to a full one.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rollstream.common.datasets import Dataset


@dataclass(frozen=True, slots=True)
class Order:
    shuffle: bool = False
    seed: int = 0
    scheme: str = "rollstream"
    buffer: int = 65536

    def tag(self, rows: int) -> str:
        if not self.shuffle:
            return "o"
        if self.scheme == "slime":
            return f"slime{self.seed}"
        return f"s{self.seed}" if rows <= self.buffer else f"s{self.seed}b{self.buffer}"


class EpochWalk:
    """One epoch's rows from a position: ``(position after, row id, raw row)``.

    The order is a function of row ids only, so a walk resumed at position ``p`` gives what the
    walk from 0 gave after ``p``. Two orders, a class each: a full permutation
    (:class:`PermutedWalk`: slime's scheme, or a shuffled dataset that fits the buffer) and the
    units read in sequence through a shuffle buffer (:class:`BufferedWalk`: in order when not
    shuffled)."""

    def __init__(self, dataset: Dataset, order: Order, epoch: int, position: int) -> None:
        full = order.shuffle and (order.scheme == "slime" or dataset.rows <= order.buffer)
        self.walk: PermutedWalk | BufferedWalk = (
            PermutedWalk(dataset, order, epoch, position) if full else BufferedWalk(dataset, order, epoch, position)
        )

    def __iter__(self) -> Iterator[tuple[int, int, Any]]:
        return iter(self.walk)


class PermutedWalk:
    """A full permutation: an array of row ids (4 or 8 bytes a row), its rows read a block at a
    time (:meth:`Dataset.pick`), never all at once. Resuming slices the array: no I/O."""

    def __init__(self, dataset: Dataset, order: Order, epoch: int, position: int) -> None:
        self.dataset = dataset
        self.position = position
        rows = dataset.rows
        self.ids = array("I" if rows < 1 << 32 else "q", range(rows))
        seed: Any = order.seed + epoch if order.scheme == "slime" else f"{order.seed}:{epoch}"
        random.Random(seed).shuffle(self.ids)  # slime: random.seed(seed + epoch); random.shuffle

    def __iter__(self) -> Iterator[tuple[int, int, Any]]:
        block = min(shard.pick_rows for shard in self.dataset.shards)
        for start in range(self.position, len(self.ids), block):
            chunk = self.ids[start:start + block]
            rows = self.dataset.pick(chunk)
            for position, rid in enumerate(chunk, start + 1):
                yield position, rid, rows.pop(rid)


class ShuffleBuffer:
    """The buffered order's row ids, one per :meth:`__next__`: units in ``sequence``, rows through
    a buffer of ``size`` (0: in order). ``held`` (the ids in the buffer) and ``entered`` (the rows
    taken in so far) say where it stands, which is all a resumed walk needs to read."""

    def __init__(self, dataset: Dataset, sequence: list[int], size: int, rng: random.Random) -> None:
        self.held: list[int] = []
        self.entered = 0
        self._ids = self._walk(dataset, sequence, size, rng)

    def __iter__(self) -> Iterator[int]:
        return self._ids

    def __next__(self) -> int:
        return next(self._ids)

    def _walk(self, dataset: Dataset, sequence: list[int], size: int, rng: random.Random) -> Iterator[int]:
        buffer = self.held
        for index in sequence:
            unit = dataset.units[index]
            for rid in range(unit.first_id, unit.first_id + unit.count):
                self.entered += 1
                if len(buffer) < size:
                    buffer.append(rid)
                    continue
                if size == 0:
                    yield rid
                    continue
                j = rng.randrange(size)
                out, buffer[j] = buffer[j], rid
                yield out
        rng.shuffle(buffer)
        while buffer:
            yield buffer.pop()


class BufferedWalk:
    """Units in sequence (shuffled when the order shuffles), rows through a :class:`ShuffleBuffer`.
    Resuming at ``position`` replays the ids (cheap, no I/O), then reads just the units that still
    hold rows the buffer had not given out, and goes on from the first row it had not taken in."""

    def __init__(self, dataset: Dataset, order: Order, epoch: int, position: int) -> None:
        self.dataset = dataset
        self.position = position
        self.sequence = list(range(len(dataset.units)))
        size = 0
        if order.shuffle:
            random.Random(f"{order.seed}:{epoch}:units").shuffle(self.sequence)
            size = order.buffer
        self.ids = ShuffleBuffer(dataset, self.sequence, size, random.Random(f"{order.seed}:{epoch}"))
        for _ in range(position):
            next(self.ids)
        self.loaded = self._pending(set(self.ids.held))
        self.reader = self._read_from(self.ids.entered)

    def _pending(self, pending: set[int]) -> dict[int, Any]:
        """The rows of the units before the resume point that the buffer still holds."""
        loaded: dict[int, Any] = {}
        for index in sorted({self.dataset.unit_of(rid) for rid in pending}):
            for rid, raw in self.dataset.read(index):
                if rid in pending:
                    loaded[rid] = raw
        return loaded

    def _read_from(self, entered: int) -> Iterator[tuple[int, Any]]:
        """Rows in sequence from the ``entered``-th on (the ones the buffer has not taken in)."""
        skip = entered
        for index in self.sequence:
            count = self.dataset.units[index].count
            if skip >= count:
                skip -= count
                continue
            yield from self.dataset.read(index, skip)
            skip = 0

    def __iter__(self) -> Iterator[tuple[int, int, Any]]:
        position = self.position
        for rid in self.ids:
            while rid not in self.loaded:
                got, raw = next(self.reader)
                self.loaded[got] = raw
            position += 1
            yield position, rid, self.loaded.pop(rid)
