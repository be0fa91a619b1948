"""The feeder: a dataset streamed into the prompt stream, epoch after epoch, within a window.

At most ``window`` prompts are queued (``XLEN prompts``, in-flight ones included). Every prompt
gets a global increasing ``index`` and its ``epoch``. The XADDs and the cursor (next index,
epoch, position in the epoch's order) move together in one Lua script that first checks the
cursor it started from, so a restarted feeder resumes exactly where it stopped and a re-sent
call after a dropped connection adds nothing twice. The dataset is read from disk as it is fed
(:mod:`~rollstream.common.datasets`: JSONL, Parquet, shards), its order a seeded function of
the epoch, so the order survives restarts too. A row that cannot be fed is a dead letter with
its file and row, written by the same script; the epoch goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import secrets
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError
from rollstream.common.codec import decode_prompt_entry, prompt_fields
from rollstream.common.connection import Outage, connect
from rollstream.common.datasets import Dataset, MemoryDataset, Record, RowFormat, open_dataset
from rollstream.common.errors import ConfigError, DecodeError, RowError
from rollstream.common.eval_lane import EVAL_KEY, strip_eval_mark
from rollstream.common.keys import Keys, SourceField
from rollstream.common.logs import Prefixed
from rollstream.common.models import Prompt, multimodal_of
from rollstream.common.namespace import load_config
from rollstream.common.protocol import Feed, Sources
from rollstream.common.redis_values import int_or
from rollstream.common.shards import MAX_LINE_BYTES
from rollstream.common.walks import Order
from rollstream.common.watchdog import LoopWatchdog, default_stall_after

from .curriculum import Deferrals, Sampler, row_field
from .feed_sources import Chunk, FeedSource, Item, SourceMix

logger = logging.getLogger(__name__)

__all__ = ["MAX_LINE_BYTES", "FeedSettings", "Feeder", "Item", "Record", "feed", "load_jsonl"]

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
    the first bad row. The feeder streams instead (:func:`~rollstream.common.datasets.open_dataset`).

    By default a record's metadata is every other field. With ``metadata_key`` it is that field's
    object (missing or null: empty), plus ``tools`` from ``tool_key`` (a list, or a JSON string of
    one), and ``as_chat`` makes a text prompt one user message: what slime's and miles' ``Dataset``
    build from ``--metadata-key``, ``--tool-key`` and ``--apply-chat-template`` (the chat template
    itself is rendered by the producer's ``--tokenizer``). ``label_key=None``: no label, as there.
    A ``path@[start:stop]`` keeps those rows, as their ``--prompt-data`` does.
    """
    dataset = open_dataset(path, RowFormat(prompt_key, label_key, metadata_key, tool_key, as_chat))
    records = list(dataset.records())
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
    curriculum: Sampler | None = None
    """Asked for every row before it is fed (:mod:`~rollstream.producer.curriculum`): a row it
    defers is skipped for this epoch. Needs the namespace's ``row_stats``."""

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
    """Feeds a dataset, or several named ones (``{name: dataset}``, mixed as the namespace's
    ``mix`` says: :mod:`~rollstream.producer.feed_sources`), into a namespace; ``await
    feeder.run()`` returns when the epochs are done."""

    def __init__(
        self, redis: Redis, dataset: Dataset | list[Record] | Mapping[str, Dataset | list[Record]],
        settings: FeedSettings,
    ) -> None:
        self.redis = redis
        self.settings = settings
        self.keys = Keys(settings.namespace)
        self.log = Prefixed(logger, "feeder", namespace=settings.namespace)
        self.feed = Feed(redis, self.keys)
        self.source_hash = Sources(redis, self.keys)
        self.order = _order(settings)
        named = dataset if isinstance(dataset, Mapping) else {"": dataset}
        self.mix = SourceMix({name: _as_dataset(d) for name, d in named.items()}, self.order, settings.epochs, self.log)
        self.sources = self.mix.sources
        self.named = self.mix.named
        self.dataset = self.mix.dataset
        self.fed = 0
        self.rejected = 0
        self.deferrals = (
            Deferrals(settings.curriculum, settings.seed, self.log) if settings.curriculum is not None else None
        )
        self.eval_marks_stripped = 0
        """Rows whose metadata carried the eval lane's reserved key: fed without it (it would steer sampling)."""
        self._outage = Outage(logger, f"feeder (ns {settings.namespace})")
        self._stop = asyncio.Event()
        self._token = f"{socket.gethostname()} pid {os.getpid()} {secrets.token_hex(4)}"
        self._beat_ttl = 15.0
        self._beat_at = 0.0

    @property
    def weights(self) -> dict[str, float]:
        """The named sources' weights (the namespace's mix) the feed follows now."""
        return self.mix.weights

    @property
    def deferred(self) -> int:
        """Rows the curriculum deferred so far."""
        return self.deferrals.deferred if self.deferrals is not None else 0

    def stop(self) -> None:
        self._stop.set()

    async def _cursor(self) -> int:
        """Read the cursors (the next index, each source's epoch and position); the next index."""
        cursor = await self._outage.run(self.feed.cursor)
        fed_dataset = cursor.dataset
        if fed_dataset is not None and fed_dataset != self.dataset and not await self._legacy(fed_dataset):
            raise ConfigError(
                f"namespace {self.keys.namespace!r} was fed from another dataset or order ({fed_dataset}, "
                f"this one is {self.dataset}); use a new namespace to feed a different dataset"
            )
        if not self.named:
            source = self.sources[0]
            source.start(cursor.epoch, cursor.position)
            await asyncio.to_thread(source.peek)  # a resume replays the epoch's order: off the loop
            return cursor.next_index
        state = await self._outage.run(self.source_hash.state)
        for source in self.sources:
            fed_id = state.get(SourceField.of(source.name, "dataset"))
            if fed_id is not None and fed_id != source.id:
                raise ConfigError(
                    f"source {source.name!r} of namespace {self.keys.namespace!r} was fed from another dataset "
                    f"or order ({fed_id}, this one is {source.id}); use a new namespace to feed a different one"
                )
            source.start(
                int_or(state.get(SourceField.of(source.name, "epoch")), 0),
                int_or(state.get(SourceField.of(source.name, "position")), 0),
            )
            await asyncio.to_thread(source.peek)
        return cursor.next_index

    async def _legacy(self, fed_dataset: str) -> bool:
        """Whether ``fed_dataset`` is this dataset's id as builds before streaming wrote it (a digest
        of every record): such a namespace resumes, its id rewritten by the next FEED. Reads the
        whole dataset once (off the loop), only for an id of that form."""
        if self.named or not _LEGACY_ID.match(fed_dataset):
            return False
        source = self.sources[0]
        settings = self.settings
        order = "o" if not settings.shuffle else ("s" if settings.shuffle_scheme == "rollstream" else "slime")
        order += str(settings.seed) if settings.shuffle else ""
        if not fed_dataset.endswith(f":{order}"):
            return False
        if await asyncio.to_thread(_legacy_id, source.dataset) != fed_dataset.removesuffix(f":{order}"):
            return False
        if self.order.tag(source.dataset.rows) != order:  # the earlier build's permutation of every row
            raise ConfigError(
                f"namespace {self.keys.namespace!r} was fed by an earlier rollstream, shuffled over the whole "
                f"dataset; resume it in the same order with --shuffle-buffer {source.dataset.rows}"
            )
        self.log.warning("resuming a namespace fed by an earlier rollstream (dataset id %s)", fed_dataset)
        return True

    async def run(self) -> int:
        """Feed until the epochs are done (or :meth:`stop`); returns the prompts fed by this call.
        A loop-lag watchdog runs meanwhile (a stall is logged with the code that held the loop)."""
        config = await load_config(self.redis, self.keys)
        self.mix.adopt(config)
        if self.settings.curriculum is not None:
            if not config.row_stats:
                raise ConfigError(
                    "a curriculum reads each row's statistics: the namespace keeps none; rollstream init --row-stats K"
                )
            k = getattr(self.settings.curriculum, "k", 0)
            if k > config.row_stats:
                raise ConfigError(f"the curriculum looks at the last {k} groups of a row; the namespace keeps "
                                  f"{config.row_stats} (rollstream init --row-stats {k})")
        watchdog = LoopWatchdog(
            f"feeder (ns {self.keys.namespace})", default_stall_after(config.lease_seconds), logger
        )
        watching = asyncio.create_task(watchdog.run(), name="watchdog")
        self._beat_ttl = max(1.0, config.heartbeat_timeout)
        try:
            await self._beat(due=True)
            return await self._feed()
        finally:
            watching.cancel()
            await asyncio.wait([watching], timeout=5)
            with contextlib.suppress(RedisError, OSError):  # a beat left behind lapses by itself
                await self.feed.release(self._token)

    async def _beat(self, due: bool = False) -> None:
        """Every third of the heartbeat timeout: say this feeder is alive (``init --force``
        refuses while it is), and re-read the namespace's mix: a changed one is adopted when it
        names the same sources, else the feed stops with a ConfigError saying what changed."""
        now = time.monotonic()
        if not due and now - self._beat_at < self._beat_ttl / 3:
            return
        self._beat_at = now
        await self._outage.run(lambda: self.feed.beat(self._token, int(self._beat_ttl * 1000)))
        self.mix.changed(await self._outage.run(self.feed.mix))

    async def _feed(self) -> int:
        next_index = await self._cursor()
        for source in self.sources:
            self.log.info(
                "source %r starts at epoch %d, position %d of %d rows (next index %d, window %d)",
                source.name, source.epoch, source.position, source.dataset.rows, next_index, self.settings.window,
            )
            await asyncio.to_thread(source.dataset.check, functools.partial(self._check_encoding, source))
        while not self._stop.is_set():
            await self._beat()
            queued = await self._outage.run(self.feed.queued)
            room = min(self.settings.window - queued, self.settings.chunk)
            if room <= 0:
                await self._sleep()
                continue
            alive = self.mix.alive(await self._outage.run(self.source_hash.state)) if self.named else {}
            await asyncio.to_thread(self.mix.fill, room)
            chunk = self.mix.take(room, alive)
            if not chunk:
                await self._mark_done()
                break
            deferred = await self._deferred(chunk)
            entries, dead = self._entries(chunk, next_index, deferred)
            updates = self.mix.updates(chunk, entries)
            last = chunk[-1][1]
            epoch, position = (last.epoch, last.position) if not self.named else (0, 0)
            added = await self._outage.run(
                functools.partial(
                    self.feed.add, expected_next=next_index, next_after=next_index + len(entries), epoch=epoch,
                    position=position, dataset=self.dataset, entries=entries, dead=dead, sources=updates,
                )
            )
            if added is None:
                # The cursor moved under us: a re-sent call that had gone through, or another feeder.
                self.log.warning("cursor moved concurrently; re-reading it")
                next_index = await self._cursor()
                continue
            next_index += added
            self.fed += added
            self.rejected += len(dead)
            await self._back_off_if_all_deferred(chunk, len(deferred))
        self.log.info(
            "fed %d prompts; next index %d%s", self.fed, next_index,
            f"; {self.deferred} rows deferred by the curriculum" if self.settings.curriculum else "",
        )
        if self.eval_marks_stripped:
            self.log.warning(
                "%d rows carried metadata[%r] (reserved for the eval lane): fed without it",
                self.eval_marks_stripped, EVAL_KEY,
            )
        return self.fed

    @staticmethod
    def _check_encoding(source: FeedSource, rid: int, record: Record) -> None:
        _encoded(source.dataset, rid, record, {**record.metadata, "dataset_index": rid}, 0, 0, source.name)

    async def _mark_done(self) -> None:
        if mapping := self.mix.done_fields():
            await self._outage.run(lambda: self.source_hash.set(mapping))

    async def _deferred(self, chunk: Chunk) -> set[int]:
        """The chunk's items (their indexes) the curriculum defers to a later epoch."""
        if self.deferrals is None:
            return set()
        rows = [(source.name, item.epoch, item.row) for source, item in chunk]
        stats = await self._outage.run(lambda: self.source_hash.rows([row_field(name, rid) for name, _, rid in rows]))
        return self.deferrals.decide(rows, stats)

    def _entries(
        self, chunk: Chunk, next_index: int, deferred: set[int],
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The chunk's prompt entries (the ``deferred`` ones left out), and dead letters for its
        rows that cannot be fed."""
        entries: list[dict[str, Any]] = []
        dead: list[dict[str, Any]] = []
        for i, (source, (ep, _, rid, raw)) in enumerate(chunk):
            if i in deferred:
                continue
            try:
                record = source.dataset.record(rid, raw)
            except RowError as exc:
                self.log.warning("row dead-lettered: %s", exc)
                dead.append(self._dead_letter(source, ep, rid, raw, exc))
                continue
            if record is None:
                continue
            metadata = {**record.metadata, "dataset_index": rid}
            if strip_eval_mark(metadata):
                self.eval_marks_stripped += 1
                if self.eval_marks_stripped == 1:
                    self.log.warning(
                        "row %s%d carries metadata[%r], reserved for the eval lane: stripped (a training row "
                        "must not steer sampling); the count is in the summary", f"{source.name}:" if source.name
                        else "", rid, EVAL_KEY,
                    )
            try:
                entries.append(_encoded(source.dataset, rid, record, metadata, next_index + len(entries), ep,
                                        source.name))
            except RowError as exc:
                self.log.warning("row dead-lettered: %s", exc)
                dead.append(self._dead_letter(source, ep, rid, raw, exc))
        return entries, dead

    @staticmethod
    def _dead_letter(source: FeedSource, epoch: int, rid: int, raw: Any, exc: RowError) -> dict[str, Any]:
        return {
            "source": "feed", "reason": str(exc), "entry_id": "", "ts_ms": int(time.time() * 1000),
            "epoch": epoch, "dataset_index": rid, "row": _row_text(raw),
            **({"dataset_source": source.name} if source.name else {}),
        }

    async def _back_off_if_all_deferred(self, chunk: Chunk, deferred: int) -> None:
        """After a whole epoch of every live source deferred in a row, wait (:class:`Deferrals`)."""
        if self.deferrals is None:
            return
        epoch_rows = sum(s.dataset.rows for s in self.sources if not s.done)
        at = {source.name: item.epoch for source, item in chunk}
        epochs = ", ".join(f"{name} {epoch}" if name else str(epoch) for name, epoch in at.items())
        if wait := self.deferrals.wait_after(len(chunk), deferred, epoch_rows, epochs):
            await self._sleep(wait)

    async def _sleep(self, seconds: float | None = None) -> None:
        try:
            async with asyncio.timeout(self.settings.poll_interval if seconds is None else seconds):
                await self._stop.wait()
        except TimeoutError:
            pass


_LEGACY_ID = re.compile(r"^[0-9a-f]{12}:\d+:(o|s\d+|slime\d+)$")


def _legacy_id(dataset: Dataset) -> str:
    """``digest:records`` as builds before streaming computed it (every record's prompt and label)."""
    digest = hashlib.sha1(usedforsecurity=False)
    records = 0
    for rid, raw in dataset.every_row():
        try:
            record = dataset.record(rid, raw)
        except RowError:
            return ""
        if record is not None:
            digest.update(json.dumps([record.prompt, record.label], sort_keys=True, default=str).encode())
            records += 1
    return f"{digest.hexdigest()[:12]}:{records}"


def _encoded(
    dataset: Dataset, rid: int, record: Record, metadata: dict[str, Any], index: int, epoch: int, source: str,
) -> dict[str, Any]:
    """The row's prompt entry; RowError naming its file and row when it cannot be fed: a value
    msgpack cannot carry, an entry over :data:`MAX_LINE_BYTES` (the cap on a JSONL line, for
    Parquet rows too), or one a producer could not read back (the decoder's bounds)."""
    prompt = Prompt(
        index=index, prompt=record.prompt, label=record.label, epoch=epoch, metadata=metadata,
        multimodal_inputs=multimodal_of(record.prompt, record.metadata.get("images")), source=source,
    )
    try:
        fields = prompt_fields(prompt)
    except (TypeError, ValueError, OverflowError) as exc:  # msgpack's refusals of a value
        raise RowError(f"{dataset.where(rid)}: cannot be encoded for the prompt stream: {exc}") from None
    data = fields["data"]
    size = len(data) if isinstance(data, bytes) else 0
    if size > MAX_LINE_BYTES:
        raise RowError(f"{dataset.where(rid)}: the row is {size} bytes encoded, over the {MAX_LINE_BYTES}-byte cap")
    try:
        decode_prompt_entry(fields)
    except DecodeError as exc:
        raise RowError(f"{dataset.where(rid)}: a producer could not read the row back: {exc}") from None
    return fields


def _as_dataset(dataset: Dataset | list[Record]) -> Dataset:
    return dataset if isinstance(dataset, Dataset) else MemoryDataset(dataset)


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
