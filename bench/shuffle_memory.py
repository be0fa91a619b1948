"""The feeder's shuffle memory: tracemalloc's peak while an epoch's walk starts and gives its first rows.

A 200,000-row JSONL file (``bench/data.py``'s rows, ~80 bytes each), walked by
:class:`~rollstream.common.walks.EpochWalk` (what the feeder iterates) for its first 1,000
rows, from the start and from a resume at position 100,000, in four orders: in order; the
buffered shuffle (``--shuffle-buffer 65536``, smaller than the dataset); a full permutation
(``--shuffle-buffer 200000``, the dataset fits); slime's scheme. Measured: the peak of Python
allocations (``tracemalloc``) from opening the dataset to the 1,000th row, and per row of the
dataset. The walk must not load the dataset (docs/running.md: "never loaded whole").
"""

from __future__ import annotations

import itertools
import time
import tracemalloc
from typing import Any

from rollstream.common.datasets import open_dataset
from rollstream.common.walks import EpochWalk, Order

from bench.common import Table
from bench.data import jsonl_file

ROWS = 200_000
ORDERS = (
    ("in order", Order()),
    ("buffered shuffle, buffer 65536", Order(shuffle=True, seed=1, buffer=65536)),
    ("full permutation, buffer 200000", Order(shuffle=True, seed=1, buffer=200_000)),
    ("slime scheme", Order(shuffle=True, seed=1, scheme="slime")),
)


def _measure(rows: int, order: Order, position: int, take: int = 1000) -> tuple[float, float]:
    path = jsonl_file(rows)
    tracemalloc.start()
    started = time.monotonic()
    dataset = open_dataset(path)
    walk = EpochWalk(dataset, order, 0, position)
    got = sum(1 for _ in itertools.islice(iter(walk), take))
    assert got == take
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak / 2**20, time.monotonic() - started


def run(quick: bool = False) -> list[Table]:
    rows = 20_000 if quick else ROWS
    out: list[list[Any]] = []
    for name, order in ORDERS:
        peak, seconds = _measure(rows, order, 0)
        resumed, resume_s = _measure(rows, order, rows // 2)
        out.append([name, rows, peak, peak * 2**20 / rows, seconds, resumed, resume_s])
    return [Table(
        "shuffle-memory",
        f"The feeder's walk on a {rows:,}-row JSONL: traced memory (tracemalloc peak) to its first 1,000 rows",
        ["order", "rows", "peak MiB", "bytes per dataset row", "s to 1,000 rows", "peak MiB after resume at half",
         "s to 1,000 rows after resume"],
        out,
        ["EpochWalk as the feeder iterates it; tracemalloc from open_dataset to the 1,000th row (Python "
         "allocations: the scan's unit table, the permutation, rows held).",
         "buffer 200000 >= the rows: a full seeded permutation; slime: random.seed(seed + epoch)'s permutation."],
        "python -m bench shuffle_memory",
    )]


if __name__ == "__main__":
    for table in run():
        print(table.markdown())
