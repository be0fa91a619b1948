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
import traceback
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from redis.asyncio import Redis
from redis.exceptions import RedisError
from rollstream.common.codec import decode_prompt_entry, prompt_fields
from rollstream.common.connection import Outage, connect
from rollstream.common.datasets import Dataset, MemoryDataset, Record, RowFormat, open_dataset
from rollstream.common.errors import ConfigError, DecodeError, RowError
from rollstream.common.eval_lane import EVAL_KEY, strip_eval_mark
from rollstream.common.keys import Keys, SourceField
from rollstream.common.logs import Prefixed
from rollstream.common.mix import check_source_name, normalised, parse_mix
from rollstream.common.models import Prompt, multimodal_of
from rollstream.common.namespace import load_config
from rollstream.common.protocol import Feed, Sources
from rollstream.common.redis_values import int_or
from rollstream.common.shards import MAX_LINE_BYTES
from rollstream.common.walks import EpochWalk, Order
from rollstream.common.watchdog import LoopWatchdog, default_stall_after

from .curriculum import RowStats, Sampler, draw, row_field

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


class Item(NamedTuple):
    """One row of a source's walk, as the feeder hands it out."""

    epoch: int
    position: int
    """The position in the epoch's order after this row (the cursor once it is fed)."""
    row: int
    """The row id in the (sliced) dataset."""
    raw: Any
    """The row as read, before decoding."""


class _Source:
    """One source being fed: its dataset, id, and where its walk stands."""

    def __init__(self, name: str, dataset: Dataset, order: Order, epochs: int | None) -> None:
        self.name = name
        self.dataset = dataset
        self.order = order
        self.epochs = epochs
        self.id = f"{dataset.fingerprint()}:{order.tag(dataset.rows)}"
        self.epoch = 0
        self.position = 0
        self.done = False
        self.walk: Iterator[Item] = iter(())
        self.buffered: list[Item] = []

    def start(self, epoch: int, position: int) -> None:
        if position >= self.dataset.rows:
            epoch, position = epoch + 1, 0
        self.epoch, self.position = epoch, position
        self.done = self.epochs is not None and epoch >= self.epochs
        self.walk = self._walk(epoch, position)
        self.buffered = []

    def _walk(self, epoch: int, position: int) -> Iterator[Item]:
        while self.epochs is None or epoch < self.epochs:
            for after, rid, raw in EpochWalk(self.dataset, self.order, epoch, position):
                yield Item(epoch, after, rid, raw)
            epoch, position = epoch + 1, 0

    def fill(self, count: int) -> None:
        """Read ahead until ``count`` rows are buffered (or the walk ends): the feeder calls this
        in a thread, so reading the dataset (a full permutation's blocks, a unit, a row group)
        never holds its event loop."""
        if self.done:
            return
        while len(self.buffered) < count and (item := next(self.walk, None)) is not None:
            self.buffered.append(item)

    def peek(self) -> Item | None:
        if not self.buffered:
            item = next(self.walk, None)
            if item is None:
                return None
            self.buffered.append(item)
        return self.buffered[0]


class Feeder:
    """Feeds a dataset, or several named ones (``{name: dataset}``, mixed as the namespace's
    ``mix`` says), into a namespace; ``await feeder.run()`` returns when the epochs are done.

    With named sources each keeps its own epochs and cursor (the ``sources`` hash), and every
    prompt goes to the source furthest behind its share of the prompts that are still alive or
    trained (fed + requeued - dead-lettered - filtered), so what producers generate follows the
    mix whatever each source's generation speed; a source that runs dry leaves the mix."""

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
        if not named:
            raise ConfigError("no source to feed")
        self.sources = [
            _Source(check_source_name(name) if name else name, _as_dataset(d), self.order, settings.epochs)
            for name, d in named.items()
        ]
        self.named = not (len(self.sources) == 1 and self.sources[0].name == "")
        self.source = self.sources[0].dataset
        self.dataset = (
            "sources:" + ",".join(sorted(s.name for s in self.sources)) if self.named else self.sources[0].id
        )
        self.weights: dict[str, float] = {}
        self._dry: list[str] = []
        self.fed = 0
        self.rejected = 0
        self.deferred = 0
        self.eval_marks_stripped = 0
        """Rows whose metadata carried the eval lane's reserved key: fed without it (it would steer sampling)."""
        self._outage = Outage(logger, f"feeder (ns {settings.namespace})")
        self._stop = asyncio.Event()
        self._token = f"{socket.gethostname()} pid {os.getpid()} {secrets.token_hex(4)}"
        self._mix = ""
        self._beat_ttl = 15.0
        self._beat_at = 0.0
        self._deferred_run = 0
        self._defer_wait = 0.0

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

    async def _alive(self) -> dict[str, int]:
        """Per source: prompts fed that are still alive or trained (fed + requeued - lost)."""
        state = {k: int_or(v, 0) for k, v in (await self._outage.run(self.source_hash.state)).items()}
        return {
            s.name: state.get(SourceField.of(s.name, "fed"), 0) + state.get(SourceField.of(s.name, "requeued"), 0)
            - state.get(SourceField.of(s.name, "lost"), 0)
            for s in self.sources
        }

    async def run(self) -> int:
        """Feed until the epochs are done (or :meth:`stop`); returns the prompts fed by this call.
        A loop-lag watchdog runs meanwhile (a stall is logged with the code that held the loop)."""
        config = await load_config(self.redis, self.keys)
        names = {s.name for s in self.sources}
        if self.named:
            self.weights = config.weights
            if not self.weights:
                raise ConfigError(
                    f"named sources ({', '.join(sorted(names))}) need the namespace's mix: "
                    f"rollstream init --mix {','.join(f'{n}=1' for n in sorted(names))} ..."
                )
            if outside := names - self.weights.keys():
                raise ConfigError(f"source(s) {', '.join(sorted(outside))} not in the namespace's mix {config.mix!r}")
            if unknown := self.weights.keys() - names:
                raise ConfigError(
                    f"the namespace's mix {config.mix!r} names source(s) {', '.join(sorted(unknown))} "
                    "that this feed does not feed"
                )
        elif config.weights:
            raise ConfigError(
                f"the namespace mixes sources ({config.mix}): feed them by name, "
                f"rollstream feed {' '.join(f'{n}=PATH' for n in config.weights)}"
            )
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
        self._mix = config.mix
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
        mix = await self._outage.run(self.feed.mix)
        if mix != self._mix:
            self._mix_changed(mix)

    def _mix_changed(self, mix: str) -> None:
        weights = parse_mix(mix)
        names = {s.name for s in self.sources}
        if self.named and weights.keys() == names:
            self.log.warning("the namespace's mix changed from %r to %r: feeding by the new weights", self._mix, mix)
            self.weights, self._mix = weights, mix
            return
        if not self.named:
            why = "this feed feeds one unnamed source"
        elif not weights:
            why = "the namespace has no mix any more"
        else:
            missing, extra = sorted(weights.keys() - names), sorted(names - weights.keys())
            why = "; ".join(
                ([f"source(s) {', '.join(missing)} not fed by this feed"] if missing else [])
                + ([f"source(s) {', '.join(extra)} fed here not in it"] if extra else [])
            )
        raise ConfigError(
            f"the namespace's mix changed while feeding, from {self._mix!r} to {mix!r} ({why}): the feed stops. "
            "Restart it with the sources of the new mix (rollstream feed NAME=PATH ...)"
        )

    def _fill(self, room: int) -> None:
        for source in self.sources:
            source.fill(room)

    def _pick(self, alive: dict[str, int]) -> _Source | None:
        """The live source furthest behind its share (the only one when unnamed)."""
        live = [s for s in self.sources if not s.done and s.peek() is not None]
        for s in self.sources:
            if not s.done and s not in live:
                s.done = True
                self._dry.append(s.name)
                if self.named:
                    self.log.warning(
                        "source %r ran dry (%s epoch(s) fed): it leaves the mix, the others take its share",
                        s.name, s.epochs,
                    )
        if not live:
            return None
        if not self.named:
            return live[0]
        shares = normalised({s.name: self.weights[s.name] for s in live})
        have = sum(alive[s.name] for s in live) + 1
        return max(live, key=lambda s: shares[s.name] * have - alive[s.name])

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
            alive = await self._alive() if self.named else {}
            await asyncio.to_thread(self._fill, room)
            chunk: list[tuple[_Source, Item]] = []
            while len(chunk) < room:
                picked = self._pick(alive)
                if picked is None:
                    break
                chunk.append((picked, picked.buffered.pop(0)))
                alive[picked.name] = alive.get(picked.name, 0) + 1
            if not chunk:
                await self._mark_done()
                break
            deferred = await self._deferred(chunk)
            entries, dead = self._entries(chunk, next_index, deferred)
            updates = self._updates(chunk, entries)
            last = chunk[-1][1]
            epoch, position = (last[0], last[1]) if not self.named else (0, 0)
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
    def _check_encoding(source: _Source, rid: int, record: Record) -> None:
        _encoded(source.dataset, rid, record, {**record.metadata, "dataset_index": rid}, 0, 0, source.name)

    def _updates(self, chunk: list[tuple[_Source, Item]], entries: list[dict[str, Any]]) -> list[tuple[str, str, Any]]:
        """The named sources' cursor moves and fed counts of a chunk."""
        if not self.named:
            return []
        last: dict[str, Item] = {}
        for source, item in chunk:
            last[source.name] = item
        fed = Counter(str(e.get("source", "")) for e in entries)
        updates: list[tuple[str, str, Any]] = []
        for name, (epoch, position, _, _) in last.items():
            source = next(s for s in self.sources if s.name == name)
            updates += [
                ("s", SourceField.of(name, "epoch"), epoch), ("s", SourceField.of(name, "position"), position),
                ("s", SourceField.of(name, "dataset"), source.id), ("i", SourceField.of(name, "fed"), fed[name]),
            ]
        updates += [("s", SourceField.of(name, "done"), 1) for name in self._dry]
        self._dry = []
        return updates

    async def _mark_done(self) -> None:
        if self.named:
            mapping = {SourceField.of(s.name, "done"): 1 for s in self.sources}
            await self._outage.run(lambda: self.source_hash.set(mapping))

    async def _deferred(self, chunk: list[tuple[_Source, Item]]) -> set[int]:
        """The chunk's items (their indexes) the curriculum defers to a later epoch."""
        sampler = self.settings.curriculum
        if sampler is None:
            return set()
        fields = [row_field(source.name, rid) for source, (_, _, rid, _) in chunk]
        raw = await self._outage.run(lambda: self.source_hash.rows(fields))
        deferred = set()
        for i, ((source, (epoch, _, rid, _)), stats) in enumerate(zip(chunk, raw, strict=True)):
            try:
                feed_now = sampler(RowStats.parse(stats), epoch, draw(self.settings.seed, epoch, source.name, rid))
            except Exception as exc:  # the user's function: its error named, not a traceback from the feeder
                raise ConfigError(
                    f"the curriculum {_name_of(sampler)} raised {type(exc).__name__}: {exc} ({_where_raised(exc)}) "
                    f"on row {source.name + ':' if source.name else ''}{rid} of epoch {epoch}: fix it, or feed "
                    "without --curriculum"
                ) from exc
            if not feed_now:
                deferred.add(i)
        self.deferred += len(deferred)
        return deferred

    def _entries(
        self, chunk: list[tuple[_Source, Item]], next_index: int, deferred: set[int],
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
    def _dead_letter(source: _Source, epoch: int, rid: int, raw: Any, exc: RowError) -> dict[str, Any]:
        return {
            "source": "feed", "reason": str(exc), "entry_id": "", "ts_ms": int(time.time() * 1000),
            "epoch": epoch, "dataset_index": rid, "row": _row_text(raw),
            **({"dataset_source": source.name} if source.name else {}),
        }

    async def _back_off_if_all_deferred(self, chunk: list[tuple[_Source, Item]], deferred: int) -> None:
        """A curriculum that defers every row would walk epoch after epoch at full speed feeding
        nothing: after a whole epoch of every live source deferred in a row, warn and wait (1 s,
        doubling to 60 s while it lasts), so the trainer's statistics can change meanwhile."""
        if deferred < len(chunk):
            self._deferred_run, self._defer_wait = 0, 0.0
            return
        self._deferred_run += len(chunk)
        epoch_rows = sum(s.dataset.rows for s in self.sources if not s.done)
        if self._deferred_run < epoch_rows:
            return
        self._defer_wait = min(_DEFER_WAIT_MAX, max(1.0, 2 * self._defer_wait))
        self.log.warning(
            "the curriculum deferred every one of the last %d rows (a whole epoch of every source; now at epoch %s): "
            "nothing fed. Waiting %.0f s before going on; a curriculum that defers every row feeds nothing",
            self._deferred_run, ", ".join(f"{name} {epoch}" if name else str(epoch)
                                          for name, epoch in {s.name: item[0] for s, item in chunk}.items()),
            self._defer_wait,
        )
        self._deferred_run = 0
        await self._sleep(self._defer_wait)

    async def _sleep(self, seconds: float | None = None) -> None:
        try:
            async with asyncio.timeout(self.settings.poll_interval if seconds is None else seconds):
                await self._stop.wait()
        except TimeoutError:
            pass


_DEFER_WAIT_MAX = 60.0
"""The longest wait between two epochs whose every row the curriculum deferred."""

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


def _name_of(function: Any) -> str:
    """A callable as ``module:qualname`` (an instance: its class's)."""
    target = function if hasattr(function, "__qualname__") else type(function)
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', repr(target))}"


def _where_raised(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    return f"at {frames[-1].filename}:{frames[-1].lineno}" if frames else "where unknown"


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
