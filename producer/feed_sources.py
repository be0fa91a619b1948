"""The sources of one feed and their mix: each source's walk through its epochs, which source
feeds the next prompt, and what the namespace's mix may say about them.

A feed has one unnamed source, or several named ones mixed as the namespace's ``mix`` says
(``init --mix NAME=WEIGHT,...``). Each named source keeps its own epochs and cursor (the
``sources`` hash), and every prompt goes to the source furthest behind its share of the prompts
that are still alive or trained (fed + requeued - lost), so what producers generate follows the
mix whatever each source's generation speed; a source that runs dry leaves the mix. The feeding
loop (:mod:`~rollstream.producer.feeder`) asks :class:`SourceMix` for each chunk.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

from rollstream.common.config import PipelineConfig
from rollstream.common.datasets import Dataset
from rollstream.common.errors import ConfigError
from rollstream.common.keys import SourceField
from rollstream.common.mix import check_source_name, normalised, parse_mix
from rollstream.common.redis_values import int_or
from rollstream.common.walks import EpochWalk, Order


class Item(NamedTuple):
    """One row of a source's walk, as the feeder hands it out."""

    epoch: int
    position: int
    """The position in the epoch's order after this row (the cursor once it is fed)."""
    row: int
    """The row id in the (sliced) dataset."""
    raw: Any
    """The row as read, before decoding."""


class FeedSource:
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


Chunk = list[tuple[FeedSource, Item]]
"""The rows of one FEED call, each with its source."""


class SourceMix:
    """The sources of one feed (``{name: dataset}``; ``{"": dataset}``: one unnamed source) and
    the weights they are mixed by. ``dataset`` is the feed's id as the cursor stores it."""

    def __init__(self, datasets: Mapping[str, Dataset], order: Order, epochs: int | None,
                 log: logging.LoggerAdapter[logging.Logger]) -> None:
        if not datasets:
            raise ConfigError("no source to feed")
        self.sources = [
            FeedSource(check_source_name(name) if name else name, dataset, order, epochs)
            for name, dataset in datasets.items()
        ]
        self.named = not (len(self.sources) == 1 and self.sources[0].name == "")
        self.dataset = (
            "sources:" + ",".join(sorted(s.name for s in self.sources)) if self.named else self.sources[0].id
        )
        self.weights: dict[str, float] = {}
        self.mix = ""
        """The namespace's mix as last read (``init --mix``)."""
        self.log = log
        self._dry: list[str] = []

    def adopt(self, config: PipelineConfig) -> None:
        """The namespace's mix at start: ConfigError unless it names exactly these sources (and
        none when the one source is unnamed)."""
        names = {s.name for s in self.sources}
        if self.named:
            if not config.weights:
                raise ConfigError(
                    f"named sources ({', '.join(sorted(names))}) need the namespace's mix: "
                    f"rollstream init --mix {','.join(f'{n}=1' for n in sorted(names))} ..."
                )
            if outside := names - config.weights.keys():
                raise ConfigError(f"source(s) {', '.join(sorted(outside))} not in the namespace's mix {config.mix!r}")
            if unknown := config.weights.keys() - names:
                raise ConfigError(
                    f"the namespace's mix {config.mix!r} names source(s) {', '.join(sorted(unknown))} "
                    "that this feed does not feed"
                )
            self.weights = config.weights
        elif config.weights:
            raise ConfigError(
                f"the namespace mixes sources ({config.mix}): feed them by name, "
                f"rollstream feed {' '.join(f'{n}=PATH' for n in config.weights)}"
            )
        self.mix = config.mix

    def changed(self, mix: str) -> None:
        """The namespace's mix read while feeding: a reweighting of these sources is adopted, any
        other change is a ConfigError saying what changed (the feed stops)."""
        if mix == self.mix:
            return
        weights = parse_mix(mix)
        names = {s.name for s in self.sources}
        if self.named and weights.keys() == names:
            self.log.warning("the namespace's mix changed from %r to %r: feeding by the new weights", self.mix, mix)
            self.weights, self.mix = weights, mix
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
            f"the namespace's mix changed while feeding, from {self.mix!r} to {mix!r} ({why}): the feed stops. "
            "Restart it with the sources of the new mix (rollstream feed NAME=PATH ...)"
        )

    def alive(self, state: Mapping[str, Any]) -> dict[str, int]:
        """Per source, from the ``sources`` hash: prompts fed that are still alive or trained
        (fed + requeued - lost)."""
        counts = {k: int_or(v, 0) for k, v in state.items()}
        return {
            s.name: counts.get(SourceField.of(s.name, "fed"), 0) + counts.get(SourceField.of(s.name, "requeued"), 0)
            - counts.get(SourceField.of(s.name, "lost"), 0)
            for s in self.sources
        }

    def fill(self, room: int) -> None:
        """Read ahead ``room`` rows of every source (in a thread: see :meth:`FeedSource.fill`)."""
        for source in self.sources:
            source.fill(room)

    def take(self, room: int, alive: dict[str, int]) -> Chunk:
        """Up to ``room`` rows, each from the source furthest behind its share (``alive`` counts
        them as they are taken); empty once every source ran dry."""
        chunk: Chunk = []
        while len(chunk) < room:
            picked = self._pick(alive)
            if picked is None:
                break
            chunk.append((picked, picked.buffered.pop(0)))
            alive[picked.name] = alive.get(picked.name, 0) + 1
        return chunk

    def _pick(self, alive: dict[str, int]) -> FeedSource | None:
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

    def updates(self, chunk: Chunk, entries: list[dict[str, Any]]) -> list[tuple[str, str, Any]]:
        """The named sources' cursor moves and fed counts of a chunk (and the sources run dry)."""
        if not self.named:
            return []
        last: dict[str, Item] = {}
        for source, item in chunk:
            last[source.name] = item
        fed = Counter(str(e.get("source", "")) for e in entries)
        updates: list[tuple[str, str, Any]] = []
        for name, item in last.items():
            source = next(s for s in self.sources if s.name == name)
            updates += [
                ("s", SourceField.of(name, "epoch"), item.epoch),
                ("s", SourceField.of(name, "position"), item.position),
                ("s", SourceField.of(name, "dataset"), source.id),
                ("i", SourceField.of(name, "fed"), fed[name]),
            ]
        updates += [("s", SourceField.of(name, "done"), 1) for name in self._dry]
        self._dry = []
        return updates

    def done_fields(self) -> dict[str, int]:
        """The ``sources`` hash fields that say every named source is done."""
        return {SourceField.of(s.name, "done"): 1 for s in self.sources} if self.named else {}
