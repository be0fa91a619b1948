"""Mooncake store: put and get MB/s of one object through ``MooncakeStore`` (``mooncake://``),
against Mooncake's own client calls underneath it, the ``fs`` store on ``/dev/shm`` and
``numpy.fromfile`` of the same bytes (the physical bound of a read here), on loopback TCP with a
real ``mooncake_master`` and one store process (``rollstream.testing.mooncake_cluster``).

``python -m bench mooncake_store`` (50 MB objects); ``--quick``: 4 MB.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rollstream.common.payload import open_store
from rollstream.common.payload.mooncake import address
from rollstream.testing.mooncake_cluster import MooncakeCluster, mooncake_unavailable

from bench.common import Table

MB = 1 << 20


async def _timed(reps: int, fn: Callable[[int], Awaitable[Any]]) -> tuple[list[float], float]:
    """Seconds of each of ``reps`` calls, and the event loop's worst stall meanwhile (a ticker
    asking for 1 ms sleeps: what other coroutines, a producer's other prompts, would wait)."""
    times = []
    worst = 0.0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            worst = max(worst, now - last)
            last = now

    ticking = asyncio.create_task(ticker())
    try:
        for rep in range(reps):
            started = time.perf_counter()
            await fn(rep)
            times.append(time.perf_counter() - started)
    finally:
        done.set()
        await ticking
    return times, worst


def _row(path: str, op: str, size: int, timed: tuple[list[float], float], note: str = "") -> list[Any]:
    times, worst = timed
    rates = sorted(size / t / 1e6 for t in times)
    return [path, op, size // MB, statistics.median(rates), rates[-1], statistics.median(times) * 1e3,
            worst * 1e3, note]


async def _measure(size: int, reps: int, shm: str | None) -> list[list[Any]]:
    import numpy as np
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    data = os.urandom(size)
    half = memoryview(data)[: size // 2], memoryview(data)[size // 2 :]
    rows: list[list[Any]] = []
    segment = f"{max(256, (reps * 3 + 4) * size // MB * 2)}MB"
    with MooncakeCluster(segment=segment) as cluster:
        store = open_store(cluster.url)
        await store.put("b/warm", [b"joined"])  # joining the cluster is not a put
        rows.append(_row("MooncakeStore", "put (2 parts)", size,
                         await _timed(reps, lambda rep: store.put(f"b/put/{rep}", list(half)))))
        got: list[memoryview] = []

        async def get(rep: int) -> None:
            got.append(await store.get(f"b/put/{rep}", size))

        rows.append(_row("MooncakeStore", "get", size, await _timed(reps, get)))
        assert all(view == data for view in got)

        raw = MooncakeDistributedStore()
        assert raw.setup("127.0.0.1", cluster.metadata, 0, 2 * size + MB, "tcp", "", f"127.0.0.1:{cluster.rpc_port}") == 0
        config = ReplicateConfig()
        config.with_hard_pin = True
        whole = memoryview(data)

        async def raw_put(rep: int) -> None:
            await asyncio.sleep(0.005)  # the ticker ticks between calls: its worst gap is one call
            codes = raw.batch_put_from_multi_buffers([f"b/raw/{rep}"], [[address(whole)]], [[size]], config)
            assert codes == [0], codes

        rows.append(_row("Mooncake client", "batch_put_from_multi_buffers", size, await _timed(reps, raw_put)))

        async def raw_put_copy(rep: int) -> None:
            await asyncio.sleep(0.005)  # the ticker ticks between calls: its worst gap is one call
            assert raw.put(f"b/rawcopy/{rep}", data, config) == 0

        rows.append(_row("Mooncake client", "put (via its local buffer)", size, await _timed(reps, raw_put_copy)))
        target = bytearray(size)
        pointer = ctypes.addressof((ctypes.c_char * size).from_buffer(target))

        async def raw_get_into(rep: int) -> None:
            await asyncio.sleep(0.005)  # the ticker ticks between calls: its worst gap is one call
            assert raw.get_into(f"b/raw/{rep}", pointer, size) == size

        rows.append(_row("Mooncake client", "get_into (preallocated)", size, await _timed(reps, raw_get_into)))

        async def raw_get_buffer(rep: int) -> None:
            await asyncio.sleep(0.005)  # the ticker ticks between calls: its worst gap is one call
            handle = raw.get_buffer(f"b/raw/{rep}")
            assert handle is not None and len(memoryview(handle)) == size
            del handle

        rows.append(_row("Mooncake client", "get_buffer (its local buffer)", size, await _timed(reps, raw_get_buffer)))
        raw.close()
        await store.close()

    with tempfile.TemporaryDirectory(dir=shm) as where:
        fs = open_store(f"fs://{where}")
        rows.append(_row("fs (/dev/shm)", "put (2 parts)", size,
                         await _timed(reps, lambda rep: fs.put(f"b/{rep}", list(half)))))
        rows.append(_row("fs (/dev/shm)", "get (mmap) + touch every page", size,
                         await _timed(reps, lambda rep: _touch(fs.get(f"b/{rep}", size)))))

        async def fromfile(rep: int) -> None:
            await asyncio.sleep(0.005)
            assert np.fromfile(Path(where) / f"b/{rep}", dtype=np.uint8).nbytes == size

        rows.append(_row("numpy.fromfile (/dev/shm)", "read", size, await _timed(reps, fromfile),
                         "the bound of a read on this machine (on the loop)"))
    return rows


async def _touch(view: Awaitable[memoryview]) -> None:
    import numpy as np

    array = np.frombuffer(await view, dtype=np.uint8)
    int(array[:: 4096].sum())  # fault every page in, as a consumer of the bytes would


def run(quick: bool = False) -> list[Table]:
    reason = mooncake_unavailable()
    if reason is not None:
        return [Table("mooncake_store", "Mooncake store (skipped)", ["why"], [[reason]], [])]
    size, reps = (4 * MB, 3) if quick else (50 * MB, 7)
    rows = asyncio.run(_measure(size, reps, "/dev/shm" if Path("/dev/shm").is_dir() else None))
    return [Table(
        "mooncake_store",
        f"Mooncake store: put and get of one {size // MB} MB object, loopback TCP (median of {reps})",
        ["path", "operation", "MB", "MB/s median", "MB/s best", "ms median", "worst loop stall ms", "note"],
        rows,
        [
            "MooncakeStore: one master, one store process (mooncake_client) holding the bytes, this process "
            "joined with a segment of 0; its get reads into an anonymous mapping of its own (get_into), its put "
            "hands Mooncake the parts where they lie (batch_put_from_multi_buffers)",
            "get_buffer returns Mooncake's own local buffer: no allocation, but a held result pins it "
            "(the next get fails once it is full), which is why MooncakeStore does not use it",
            "worst loop stall: the longest an asyncio ticker (1 ms sleeps) waited during the row's calls; "
            "MooncakeStore runs Mooncake's calls on its threads (they release the GIL), the Mooncake client "
            "rows call them on the loop, as a blocking caller would",
            "the machine has 2 cores shared with other work: compare rows of one run, not runs",
        ],
        command="python -m bench mooncake_store",
    )]
