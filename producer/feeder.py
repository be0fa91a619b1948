"""The feeder: a dataset streamed into the prompt stream, epoch after epoch, within a window.

At most ``window`` prompts are queued (``XLEN prompts``, in-flight ones included). Every prompt
gets a global increasing ``index`` and its ``epoch``. The XADDs and the cursor (next index,
epoch, position in the epoch's order) move together in one Lua script that first checks the
cursor it started from, so a restarted feeder resumes exactly where it stopped and a re-sent
call after a dropped connection adds nothing twice. The dataset is read from disk as it is fed
(:mod:`~rollstream.producer.datasets`: JSONL, Parquet, shards), its order a seeded function of
the epoch, so the order survives restarts too. A row that cannot be fed is a dead letter with
its file and row, written by the same script; the epoch goes on.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from rollstream.common.codec import prompt_fields
from rollstream.common.connection import Outage, connect
from rollstream.common.errors import ConfigError
from rollstream.common.keys import Keys
from rollstream.common.logs import Prefixed
from rollstream.common.models import Prompt, multimodal_of
from rollstream.common.namespace import load_config
from rollstream.common.protocol import Feed
from rollstream.common.watchdog import LoopWatchdog, default_stall_after

from .datasets import (
    MAX_LINE_BYTES,
    Dataset,
    EpochWalk,
    MemoryDataset,
    Order,
    Record,
    RowError,
    RowFormat,
    open_dataset,
)

logger = logging.getLogger(__name__)

__all__ = ["MAX_LINE_BYTES", "FeedSettings", "Feeder", "Record", "feed", "load_jsonl", "split_row_slice"]

_SLICE = re.compile(r"^(?P<path>.*)@\[(?P<start>-?\d*):(?P<stop>-?\d*)\]$")


def split_row_slice(path: str | Path) -> tuple[str, slice | None]:
    """slime's and miles' ``--prompt-data path@[start:stop]``: the path and the row slice."""
    match = _SLICE.match(str(path))
    if match is None:
        return str(path), None
    start, stop = match.group("start"), match.group("stop")
    return match.group("path"), slice(int(start) if start else None, int(stop) if stop else None)


def load_jsonl(
    path: str | Path,
    prompt_key: str = "prompt",
    label_key: str | None = "label",
    *,
    metadata_key: str | None = None,
    tool_key: str | None = None,
    as_chat: bool = False,
) -> list[Record]:
    """Read and validate a whole dataset into memory (small ones: tests, tools); ConfigError names
    the first bad row. The feeder streams instead (:func:`~rollstream.producer.datasets.open_dataset`).

    By default a record's metadata is every other field. With ``metadata_key`` it is that field's
    object (missing or null: empty), plus ``tools`` from ``tool_key`` (a list, or a JSON string of
    one), and ``as_chat`` makes a text prompt one user message: what slime's and miles' ``Dataset``
    build from ``--metadata-key``, ``--tool-key`` and ``--apply-chat-template`` (the chat template
    itself is rendered by the producer's ``--tokenizer``). ``label_key=None``: no label, as there.
    A ``path@[start:stop]`` keeps those rows, as their ``--prompt-data`` does.
    """
    dataset = open_dataset(path, RowFormat(prompt_key, label_key, metadata_key, tool_key, as_chat))
    records = []
    for index in range(len(dataset.units)):
        for rid, raw in dataset.read(index):
            try:
                record = dataset.record(rid, raw)
            except RowError as exc:
                raise ConfigError(str(exc)) from None
            if record is not None:
                records.append(record)
    if not records:
        raise ConfigError(f"{path}: no records")
    return records


SHUFFLE_SCHEMES = ("rollstream", "slime")


@dataclass(frozen=True, slots=True)
class FeedSettings:
    namespace: str
    epochs: int | None = 1
    """None feeds forever."""
    shuffle: bool = False
    seed: int = 0
    window: int = 256
    poll_interval: float = 0.1
    chunk: int = 128
    shuffle_scheme: str = "rollstream"
    """``rollstream``: a permutation seeded by ``"{seed}:{epoch}"``; ``slime``: the one slime's and
    miles' ``Dataset.shuffle`` makes (``random.seed(seed + epoch)``), so a run switched to
    rollstream sees its prompts in the order it saw them before."""
    shuffle_buffer: int = 65536
    """``rollstream`` shuffle of a dataset with more rows than this: units (JSONL megabytes,
    Parquet row groups) in a seeded order, rows through a seeded shuffle buffer of this many rows
    (held in memory). A dataset that fits gets a full permutation."""

    def __post_init__(self) -> None:
        if self.epochs is not None and (isinstance(self.epochs, bool) or self.epochs < 1):
            raise ConfigError("epochs must be at least 1 (or None to feed forever)")
        if self.window < 1:
            raise ConfigError("window must be at least 1")
        if self.chunk < 1 or self.poll_interval <= 0:
            raise ConfigError("chunk and poll_interval must be positive")
        if self.shuffle_buffer < 1:
            raise ConfigError("shuffle_buffer must be at least 1")
        if self.shuffle_scheme not in SHUFFLE_SCHEMES:
            raise ConfigError(
                f"shuffle scheme must be one of {', '.join(SHUFFLE_SCHEMES)}, got {self.shuffle_scheme!r}"
            )


def _order(settings: FeedSettings) -> Order:
    return Order(settings.shuffle, settings.seed, settings.shuffle_scheme, settings.shuffle_buffer)


class Feeder:
    """Feeds a dataset into a namespace; ``await feeder.run()`` returns when the epochs are done."""

    def __init__(self, redis: Redis, dataset: Dataset | list[Record], settings: FeedSettings) -> None:
        self.redis = redis
        self.source = dataset if isinstance(dataset, Dataset) else MemoryDataset(dataset)
        self.settings = settings
        self.keys = Keys(settings.namespace)
        self.log = Prefixed(logger, "feeder", namespace=settings.namespace)
        self.feed = Feed(redis, self.keys)
        self.order = _order(settings)
        self.dataset = f"{self.source.fingerprint()}:{self.order.tag(self.source.rows)}"
        self.fed = 0
        self.rejected = 0
        self._outage = Outage(logger, f"feeder (ns {settings.namespace})")
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    def _walk(self, epoch: int, position: int) -> Iterator[tuple[int, int, int, Any]]:
        """(epoch, position after, row id, raw row) from a cursor onwards."""
        while self.settings.epochs is None or epoch < self.settings.epochs:
            for after, rid, raw in EpochWalk(self.source, self.order, epoch, position):
                yield epoch, after, rid, raw
            epoch, position = epoch + 1, 0

    async def _cursor(self) -> tuple[int, int, int]:
        cursor = await self._outage.run(self.feed.cursor)
        next_index, epoch, position, fed_dataset = cursor.next_index, cursor.epoch, cursor.position, cursor.dataset
        if fed_dataset is not None and fed_dataset != self.dataset:
            raise ConfigError(
                f"namespace {self.keys.namespace!r} was fed from another dataset or order ({fed_dataset}, "
                f"this one is {self.dataset}); use a new namespace to feed a different dataset"
            )
        if fed_dataset is not None and position >= self.source.rows:
            epoch, position = epoch + 1, 0
        return next_index, epoch, position

    async def run(self) -> int:
        """Feed until the epochs are done (or :meth:`stop`); returns the prompts fed by this call.
        A loop-lag watchdog runs meanwhile (a stall is logged with the code that held the loop)."""
        config = await load_config(self.redis, self.keys)
        watchdog = LoopWatchdog(
            f"feeder (ns {self.keys.namespace})", default_stall_after(config.lease_seconds), logger
        )
        watching = asyncio.create_task(watchdog.run(), name="watchdog")
        try:
            return await self._feed()
        finally:
            watching.cancel()
            await asyncio.wait([watching], timeout=5)

    async def _feed(self) -> int:
        next_index, epoch, position = await self._cursor()
        self.log.info(
            "starting at index %d, epoch %d, position %d of %d rows (window %d)",
            next_index, epoch, position, self.source.rows, self.settings.window,
        )
        self.source.check()
        walk = self._walk(epoch, position)
        pending: list[tuple[int, int, int, Any]] = []
        while not self._stop.is_set():
            queued = await self._outage.run(self.feed.queued)
            room = min(self.settings.window - queued, self.settings.chunk)
            if room <= 0:
                await self._sleep()
                continue
            while len(pending) < room:
                item = next(walk, None)
                if item is None:
                    break
                pending.append(item)
            if not pending:
                break
            chunk = pending[:room]
            entries, dead = self._entries(chunk, next_index)
            last_epoch, last_position, _, _ = chunk[-1]
            added = await self._outage.run(
                lambda e=entries, d=dead, le=last_epoch, lp=last_position, ni=next_index: self.feed.add(
                    expected_next=ni, next_after=ni + len(e), epoch=le, position=lp,
                    dataset=self.dataset, entries=e, dead=d,
                )
            )
            if added is None:
                # The cursor moved under us: a re-sent call that had gone through, or another feeder.
                self.log.warning("cursor moved concurrently; re-reading it")
                next_index, epoch, position = await self._cursor()
                walk = self._walk(epoch, position)
                pending = []
                continue
            next_index += added
            self.fed += added
            self.rejected += len(dead)
            pending = pending[room:]
        self.log.info("fed %d prompts; next index %d", self.fed, next_index)
        return self.fed

    def _entries(
        self, chunk: list[tuple[int, int, int, Any]], next_index: int
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The chunk's prompt entries, and dead letters for its rows that cannot be fed."""
        entries: list[dict[str, Any]] = []
        dead: list[dict[str, Any]] = []
        for ep, _, rid, raw in chunk:
            try:
                record = self.source.record(rid, raw)
            except RowError as exc:
                self.log.warning("row dead-lettered: %s", exc)
                dead.append({
                    "source": "feed", "reason": str(exc), "entry_id": "", "ts_ms": int(time.time() * 1000),
                    "epoch": ep, "dataset_index": rid, "row": _row_text(raw),
                })
                continue
            if record is None:
                continue
            prompt = Prompt(
                index=next_index + len(entries), prompt=record.prompt, label=record.label, epoch=ep,
                metadata={**record.metadata, "dataset_index": rid},
                multimodal_inputs=multimodal_of(record.prompt, record.metadata.get("images")),
            )
            entries.append(prompt_fields(prompt))
        return entries, dead

    async def _sleep(self) -> None:
        try:
            async with asyncio.timeout(self.settings.poll_interval):
                await self._stop.wait()
        except TimeoutError:
            pass


def _row_text(raw: Any, limit: int = 4096) -> str:
    if isinstance(raw, bytes):
        return raw[:limit].decode("utf-8", "replace")
    return repr(raw)[:limit]


async def feed(
    url: str,
    path: str | Path,
    settings: FeedSettings,
    *,
    prompt_key: str = "prompt",
    label_key: str | None = "label",
) -> int:
    """Library entry point: stream a dataset (JSONL, Parquet, shards) into a namespace; returns
    the prompts fed."""
    dataset = open_dataset(path, RowFormat(prompt_key, label_key))
    redis = connect(url, name="rollstream-feeder")
    try:
        return await Feeder(redis, dataset, settings).run()
    finally:
        await redis.aclose()
