"""Datasets streamed from disk: JSONL, Parquet, and folders or globs of shards of either.

Nothing here holds a dataset in memory. A dataset is a list of shards (:mod:`~rollstream.common.shards`:
one reader per format) cut into units, with a row slice (slime's ``path@[start:stop]``); its rows
are numbered 0.. across the shards, so the feeder knows every row's place without reading the rows,
and an epoch's order (:mod:`~rollstream.common.walks`) is a function of the row ids alone. A row
becomes a :class:`Record` by its :class:`RowFormat` (slime's and miles' keys); :meth:`Dataset.check`
parses the first rows of every shard at start, so a wrong key or format fails then, not mid-epoch.
"""

from __future__ import annotations

import bisect
import glob
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from rollstream.common.errors import ConfigError, RowError
from rollstream.common.models import as_prompt_content
from rollstream.common.shards import Shard, file_changed, open_shard

CHECK_ROWS = 8
"""Rows of every shard parsed before feeding: a wrong key or format fails at start, not mid-epoch."""
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
_END = object()


@dataclass(frozen=True, slots=True)
class Record:
    prompt: Any
    label: Any
    metadata: dict[str, Any]


@dataclass(frozen=True, slots=True)
class RowFormat:
    """How a row becomes a prompt: slime's and miles' ``--input-key``, ``--label-key``,
    ``--metadata-key``, ``--tool-key`` and ``--apply-chat-template``."""

    prompt_key: str = "prompt"
    label_key: str | None = "label"
    metadata_key: str | None = None
    tool_key: str | None = None
    as_chat: bool = False

    def record(self, obj: Any, where: str) -> Record:
        """The row's record; RowError naming ``where`` when it does not fit."""
        if not isinstance(obj, dict) or self.prompt_key not in obj:
            raise RowError(f"{where}: expected an object with a {self.prompt_key!r} field")
        raw_prompt = obj[self.prompt_key]
        if self.as_chat and isinstance(raw_prompt, str):
            raw_prompt = [{"role": "user", "content": raw_prompt}]
        try:
            prompt = as_prompt_content(raw_prompt)
        except ValueError as exc:
            raise RowError(f"{where}: {exc}") from None
        label = obj.get(self.label_key) if self.label_key is not None else None
        if self.metadata_key is None:
            metadata = {k: v for k, v in obj.items() if k not in (self.prompt_key, self.label_key)}
        else:
            metadata = self._metadata(obj, self.metadata_key, where)
        return Record(prompt, label, metadata)

    def _metadata(self, obj: dict[str, Any], key: str, where: str) -> dict[str, Any]:
        metadata = obj.get(key) or {}
        if not isinstance(metadata, dict):
            raise RowError(f"{where}: field {key!r} must be an object, got {type(metadata).__name__}")
        metadata = dict(metadata)
        if self.tool_key is not None and obj.get(self.tool_key) is not None:
            tools = obj[self.tool_key]
            if isinstance(tools, str):
                try:
                    tools = json.loads(tools)
                except json.JSONDecodeError as exc:
                    raise RowError(f"{where}: field {self.tool_key!r} is a string but not JSON: {exc}") from None
            if not isinstance(tools, list):
                raise RowError(f"{where}: field {self.tool_key!r} must be a list of tools, got {type(tools).__name__}")
            metadata["tools"] = tools
        return metadata


_SLICE_CHARS = ("*", "?", "[")


def shard_paths(path: str) -> list[str]:
    """A file, a folder (its .jsonl, .json and .parquet files) or a glob, as sorted shard paths."""
    if os.path.isdir(path):
        found = sorted(str(p) for p in Path(path).iterdir() if p.is_file() and p.suffix in DATA_SUFFIXES)
        if not found:
            raise ConfigError(f"{path}: a folder with no {', '.join(DATA_SUFFIXES)} files")
        return found
    if any(c in path for c in _SLICE_CHARS) and not os.path.exists(path):
        found = sorted(p for p in glob.glob(path) if os.path.isfile(p))
        if not found:
            raise ConfigError(f"{path}: the glob matches no file")
        return found
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such dataset file")
    return [path]


@dataclass(frozen=True, slots=True)
class Unit:
    shard: int
    unit: int
    start: int
    """First row of the unit taken (a slice can start inside it)."""
    count: int
    first_id: int
    """The row id (position in the sliced dataset) of its first row taken."""


class Dataset:
    """A streamed source: shards, their units, and a row slice; rows are numbered 0.. across shards."""

    def __init__(self, spec: str, shards: list[Shard], rows: slice | None,
                 row_format: RowFormat) -> None:
        self.spec = spec
        self.shards = shards
        self.row_format = row_format
        total = sum(sum(s.units) for s in shards)
        lo, hi, _ = (rows or slice(None)).indices(total)
        self.slice = (lo, max(lo, hi))
        self.units: list[Unit] = []
        base = 0
        for si, shard in enumerate(shards):
            for ui, count in enumerate(shard.units):
                a, b = max(base, lo), min(base + count, hi)
                if a < b:
                    self.units.append(Unit(si, ui, a - base, b - a, a - lo))
                base += count
        self.rows = max(0, hi - lo)
        if self.rows == 0:
            raise ConfigError(f"{spec}: no records")
        self._unit_firsts = [u.first_id for u in self.units]

    def unit_of(self, row_id: int) -> int:
        return bisect.bisect_right(self._unit_firsts, row_id) - 1

    def read(self, index: int, offset: int = 0) -> Iterator[tuple[int, Any]]:
        """(row id, raw row) of unit ``index`` from ``offset`` rows into it."""
        unit = self.units[index]
        shard = self.shards[unit.shard]
        rid = unit.first_id + offset
        rows = shard.read(unit.unit, unit.start + offset)
        for _ in range(unit.count - offset):
            raw = next(rows, _END)
            if raw is _END:
                row = shard.row_of(unit.unit, unit.start + rid - unit.first_id)
                what = f"it ends before row {row + 1}, {sum(shard.units)} rows counted at start"
                raise file_changed(shard.path, what)
            yield rid, raw
            rid += 1

    def pick(self, ids: Sequence[int]) -> dict[int, Any]:
        """The raw rows of ``ids`` (row ids), by id: each unit they fall in is read once, for just those rows."""
        by_unit: dict[int, list[int]] = {}
        for rid in ids:
            by_unit.setdefault(self.unit_of(rid), []).append(rid)
        out: dict[int, Any] = {}
        for index in sorted(by_unit):
            unit = self.units[index]
            wanted = sorted(by_unit[index])
            raws = self.shards[unit.shard].pick(unit.unit, [unit.start + rid - unit.first_id for rid in wanted])
            for rid, raw in zip(wanted, raws, strict=True):
                out[rid] = raw
        return out

    def _shard_row(self, row_id: int) -> tuple[Shard, int]:
        """The shard of a row id and its row number there."""
        unit = self.units[self.unit_of(row_id)]
        shard = self.shards[unit.shard]
        return shard, shard.row_of(unit.unit, unit.start + row_id - unit.first_id)

    def record(self, row_id: int, raw: Any) -> Record | None:
        """The row's record, None for a blank line; RowError naming file and row."""
        shard, row = self._shard_row(row_id)
        obj = shard.decode(raw, row)
        if obj is None:
            return None
        return self.row_format.record(obj, shard.where(row))

    def where(self, row_id: int) -> str:
        """The row's file and row, as errors name it (``file:line`` for JSONL, 1-based)."""
        shard, row = self._shard_row(row_id)
        return shard.where(row)

    def every_row(self) -> Iterator[tuple[int, Any]]:
        """(row id, raw row) of every row in the dataset's own order, read a unit at a time."""
        for unit in range(len(self.units)):
            yield from self.read(unit)

    def records(self) -> Iterator[Record]:
        """Every row's record in the dataset's own order (blank lines skipped); a row that does
        not fit is a ``ConfigError`` naming its file and row (an eval set or a dataset loaded whole
        is refused rather than dead-lettered row by row)."""
        for row_id, raw in self.every_row():
            try:
                record = self.record(row_id, raw)
            except RowError as exc:
                raise ConfigError(str(exc)) from None
            if record is not None:
                yield record

    def check(self, encode: Callable[[int, Record], None] | None = None) -> None:
        """Parse the first rows of every shard (and ``encode(row id, record)`` them, which raises
        RowError for one that cannot be fed): ConfigError now rather than dead letters later."""
        seen: set[int] = set()
        for index, unit in enumerate(self.units):
            if unit.shard in seen:
                continue
            seen.add(unit.shard)
            for rid, raw in self.read(index, 0):
                try:
                    record = self.record(rid, raw)
                    if record is not None and encode is not None:
                        encode(rid, record)
                except RowError as exc:
                    raise ConfigError(str(exc)) from None
                if rid - unit.first_id + 1 >= min(CHECK_ROWS, unit.count):
                    break

    def fingerprint(self) -> str:
        digest = hashlib.sha1(usedforsecurity=False)
        for shard in self.shards:
            digest.update(shard.fingerprint().encode())
        digest.update(f"{self.slice}".encode())
        return f"{digest.hexdigest()[:12]}:{self.rows}"


_SLICE = re.compile(r"^(?P<path>.*)@\[(?P<start>-?\d*):(?P<stop>-?\d*)\]$")
_BAD_SLICE = re.compile(r"^.*(?P<slice>@\[[^\]]*\])$")


def split_row_slice(path: str | Path) -> tuple[str, slice | None]:
    """slime's and miles' ``--prompt-data path@[start:stop]``: the path and the row slice."""
    match = _SLICE.match(str(path))
    if match is None:
        if (bad := _BAD_SLICE.match(str(path))) is not None and not os.path.exists(path):
            raise ConfigError(
                f"{path}: row slice {bad.group('slice')!r}: expected PATH@[START:STOP] with START and STOP "
                "integers or empty (e.g. data.jsonl@[0:1000], data.jsonl@[-500:])"
            )
        return str(path), None
    start, stop = match.group("start"), match.group("stop")
    return match.group("path"), slice(int(start) if start else None, int(stop) if stop else None)


def open_dataset(path: str | Path, row_format: RowFormat | None = None) -> Dataset:
    """A file, folder or glob of JSONL/Parquet shards, with slime's ``path@[start:stop]``."""
    real_path, rows = split_row_slice(path)
    shards: list[Shard] = [open_shard(p) for p in shard_paths(real_path)]
    return Dataset(str(path), shards, rows, row_format or RowFormat())


class MemoryShard:
    """Records already in memory (tests, :func:`~rollstream.producer.feeder.load_jsonl`)."""

    pick_rows = 1 << 30

    def __init__(self, records: list[Record]) -> None:
        self.path = "<memory>"
        self.records = records
        self.units = [len(records)]

    def read(self, unit: int, start: int) -> Iterator[Any]:
        yield from self.records[start:]

    def pick(self, unit: int, rows: list[int]) -> Iterator[Any]:
        return (self.records[row] for row in rows)

    def decode(self, raw: Any, row: int) -> Any:
        return raw

    def row_of(self, unit: int, offset: int) -> int:
        return offset

    def where(self, row: int) -> str:
        return f"{self.path} row {row}"

    def fingerprint(self) -> str:
        digest = hashlib.sha1(usedforsecurity=False)
        for record in self.records:
            digest.update(json.dumps([record.prompt, record.label], sort_keys=True, default=str).encode())
        return digest.hexdigest()[:12]


class MemoryDataset(Dataset):
    """A dataset of records in memory; rows are records already."""

    def __init__(self, records: list[Record]) -> None:
        super().__init__("<memory>", [MemoryShard(records)], None, RowFormat())

    def record(self, row_id: int, raw: Any) -> Record | None:
        return cast(Record, raw)

    def check(self, encode: Callable[[int, Record], None] | None = None) -> None:
        return None

    def fingerprint(self) -> str:
        return f"{self.shards[0].fingerprint()}:{self.rows}"

