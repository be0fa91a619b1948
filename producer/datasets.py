"""Datasets streamed from disk: JSONL, Parquet, and folders or globs of shards of either.

Nothing here holds a dataset in memory. A source is a list of shards cut into *units* (about
1 MiB of lines of a JSONL file, found by one sequential scan; a row group of a Parquet file, from
its footer), so the feeder knows every row's place without reading the rows. An epoch's order is
computed from row ids alone: the units in a seeded permutation, their rows through a seeded
shuffle buffer (see :class:`EpochWalk`), which is what makes resuming at any position exact
without reading what came before.

Trade-off of the buffered shuffle: a row moves at most about ``shuffle_buffer`` places from where
its unit put it, so rows of one unit stay closer together than a full permutation would keep
them. A dataset that fits in the buffer gets a full permutation (the same as before streaming);
slime's scheme always does (it is slime's order, and costs 8 bytes per row as slime's does).
Smaller Parquet row groups (say 10k-50k rows) make the buffered shuffle closer to a full one.
"""

from __future__ import annotations

import bisect
import glob
import hashlib
import json
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rollstream.common.errors import ConfigError, RowError
from rollstream.common.models import as_prompt_content

MAX_LINE_BYTES = 16 * 1024 * 1024
UNIT_BYTES = 1024 * 1024
"""A JSONL unit: this many bytes, then to the end of the line."""
PARQUET_BATCH = 1024
"""Rows decoded at a time from a Parquet row group (memory per read, not per row group)."""
CHECK_ROWS = 8
"""Rows of every shard parsed before feeding: a wrong key or format fails at start, not mid-epoch."""
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


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


class Shard(Protocol):
    path: str
    units: list[int]
    """Rows per unit."""

    def read(self, unit: int, start: int) -> Iterator[Any]:
        """The unit's raw rows from row ``start`` on, streamed."""
        ...

    def decode(self, raw: Any, row: int) -> Any:
        """A raw row as a JSON-like object; RowError naming the file and ``row`` (0-based in the shard)."""
        ...

    def row_of(self, unit: int, offset: int) -> int:
        """The row number in the shard of ``offset`` rows into ``unit``."""
        ...

    def fingerprint(self) -> str:
        """Changes when the file does (size, units, first bytes); cheap."""
        ...


class JsonlShard:
    """A JSONL file; a row is a line (blank lines keep their number and are skipped)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offsets: list[int] = []
        self.units: list[int] = []
        try:
            with open(path, "rb") as handle:
                start = 0
                while data := handle.read(UNIT_BYTES):
                    if len(data) == UNIT_BYTES and not data.endswith(b"\n"):
                        data += handle.readline(MAX_LINE_BYTES + 1)
                    self.offsets.append(start)
                    self.units.append(data.count(b"\n") + (0 if data.endswith(b"\n") else 1))
                    start += len(data)
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read the dataset: {exc}") from None
        self.size = start
        self._firsts = [0]
        for count in self.units:
            self._firsts.append(self._firsts[-1] + count)

    def read(self, unit: int, start: int) -> Iterator[Any]:
        with open(self.path, "rb") as handle:
            handle.seek(self.offsets[unit])
            for number in range(self.units[unit]):
                line = handle.readline(MAX_LINE_BYTES + 1)
                if number >= start:
                    yield line

    def decode(self, raw: Any, row: int) -> Any:
        where = f"{self.path}:{row + 1}"
        if len(raw) > MAX_LINE_BYTES:
            raise RowError(f"{where}: line longer than {MAX_LINE_BYTES} bytes")
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RowError(f"{where}: not JSON: {exc}") from None

    def row_of(self, unit: int, offset: int) -> int:
        return self._firsts[unit] + offset

    def fingerprint(self) -> str:
        with open(self.path, "rb") as handle:
            head = handle.read(65536)
        return f"{os.path.basename(self.path)}:{self.size}:{len(self.units)}:{hashlib.sha1(head).hexdigest()[:12]}"


class ParquetShard:
    """A Parquet file; a unit is a row group, read in batches of :data:`PARQUET_BATCH` rows."""

    def __init__(self, path: str) -> None:
        pq = _pyarrow_parquet()
        self.path = path
        try:
            metadata = pq.ParquetFile(path).metadata
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise ConfigError(f"{path}: cannot read the Parquet file: {exc}") from None
        self.units = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
        self._schema = metadata.schema.to_arrow_schema().to_string(show_schema_metadata=False)
        self._firsts = [0]
        for count in self.units:
            self._firsts.append(self._firsts[-1] + count)

    def read(self, unit: int, start: int) -> Iterator[Any]:
        pq = _pyarrow_parquet()
        with pq.ParquetFile(self.path) as reader:
            skip = start
            # one thread: arrow's pool threads each keep an arena (25 MB more RSS, bench/data.py)
            for batch in reader.iter_batches(batch_size=PARQUET_BATCH, row_groups=[unit], use_threads=False):
                if skip >= batch.num_rows:
                    skip -= batch.num_rows
                    continue
                rows = batch.slice(skip).to_pylist()
                skip = 0
                yield from rows

    def decode(self, raw: Any, row: int) -> Any:
        return raw

    def row_of(self, unit: int, offset: int) -> int:
        return self._firsts[unit] + offset

    def fingerprint(self) -> str:
        digest = hashlib.sha1(self._schema.encode()).hexdigest()[:12]
        return f"{os.path.basename(self.path)}:{os.path.getsize(self.path)}:{self.units}:{digest}"


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("feeding Parquet needs pyarrow: pip install 'rollstream[parquet]'") from None
    return pq


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


def open_shard(path: str) -> JsonlShard | ParquetShard:
    return ParquetShard(path) if path.endswith(".parquet") else JsonlShard(path)


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
            yield rid, next(rows)
            rid += 1

    def record(self, row_id: int, raw: Any) -> Record | None:
        """The row's record, None for a blank line; RowError naming file and row."""
        unit = self.units[self.unit_of(row_id)]
        shard = self.shards[unit.shard]
        row = shard.row_of(unit.unit, unit.start + row_id - unit.first_id)
        obj = shard.decode(raw, row)
        if obj is None:
            return None
        where = f"{shard.path}:{row + 1}" if isinstance(shard, JsonlShard) else f"{shard.path} row {row}"
        return self.row_format.record(obj, where)

    def check(self) -> None:
        """Parse the first rows of every shard: ConfigError now rather than dead letters later."""
        seen: set[int] = set()
        for index, unit in enumerate(self.units):
            if unit.shard in seen:
                continue
            seen.add(unit.shard)
            for rid, raw in self.read(index, 0):
                try:
                    self.record(rid, raw)
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


def open_dataset(path: str | Path, row_format: RowFormat | None = None) -> Dataset:
    """A file, folder or glob of JSONL/Parquet shards, with slime's ``path@[start:stop]``."""
    from rollstream.producer.feeder import split_row_slice

    real_path, rows = split_row_slice(path)
    shards: list[Shard] = [open_shard(p) for p in shard_paths(real_path)]
    return Dataset(str(path), shards, rows, row_format or RowFormat())


class MemoryShard:
    """Records already in memory (tests, :func:`~rollstream.producer.feeder.load_jsonl`)."""

    def __init__(self, records: list[Record]) -> None:
        self.path = "<memory>"
        self.records = records
        self.units = [len(records)]

    def read(self, unit: int, start: int) -> Iterator[Any]:
        yield from self.records[start:]

    def decode(self, raw: Any, row: int) -> Any:
        return raw

    def row_of(self, unit: int, offset: int) -> int:
        return offset

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
        return raw

    def check(self) -> None:
        return None

    def fingerprint(self) -> str:
        return f"{self.shards[0].fingerprint()}:{self.rows}"


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

    The order is a function of row ids only, so resuming at position ``p`` replays the ids (cheap,
    no I/O), then reads just the units that still hold rows the buffer had not given out.
    """

    def __init__(self, dataset: Dataset, order: Order, epoch: int, position: int) -> None:
        self.dataset = dataset
        self.position = position
        rows = dataset.rows
        if order.shuffle and (order.scheme == "slime" or rows <= order.buffer):
            ids = list(range(rows))
            seed: Any = order.seed + epoch if order.scheme == "slime" else f"{order.seed}:{epoch}"
            random.Random(seed).shuffle(ids)  # slime: random.seed(seed + epoch); random.shuffle
            self._ids: Iterator[int] = iter(ids[position:])
            self._entered = rows
            pending = set(ids[position:])
            self._sequence = list(range(len(dataset.units)))
        else:
            self._sequence = list(range(len(dataset.units)))
            buffer = 0
            if order.shuffle:
                random.Random(f"{order.seed}:{epoch}:units").shuffle(self._sequence)
                buffer = order.buffer
            self._state: list[int] = []
            self._count = 0
            ids_iter = self._buffered(random.Random(f"{order.seed}:{epoch}"), buffer)
            for _ in range(position):
                next(ids_iter)
            self._ids = ids_iter
            self._entered = self._count
            pending = set(self._state)
        self._loaded: dict[int, Any] = {}
        self._load_pending(pending)
        self._reader = self._read_from(self._entered)

    def _buffered(self, rng: random.Random, size: int) -> Iterator[int]:
        """Row ids in order: units in sequence, rows through a shuffle buffer of ``size``."""
        buffer = self._state
        for index in self._sequence:
            unit = self.dataset.units[index]
            for rid in range(unit.first_id, unit.first_id + unit.count):
                self._count += 1
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

    def _load_pending(self, pending: set[int]) -> None:
        """Read the units before the resume point that still hold rows to give out."""
        if not pending:
            return
        units = sorted({self.dataset.unit_of(rid) for rid in pending})
        for index in units:
            for rid, raw in self.dataset.read(index):
                if rid in pending:
                    self._loaded[rid] = raw

    def _read_from(self, entered: int) -> Iterator[tuple[int, Any]]:
        """Rows in sequence from the ``entered``-th on (the ones the buffer has not taken in)."""
        skip = entered
        for index in self._sequence:
            count = self.dataset.units[index].count
            if skip >= count:
                skip -= count
                continue
            yield from self.dataset.read(index, skip)
            skip = 0

    def __iter__(self) -> Iterator[tuple[int, int, Any]]:
        position = self.position
        for rid in self._ids:
            while rid not in self._loaded:
                got, raw = next(self._reader)
                self._loaded[got] = raw
            position += 1
            yield position, rid, self._loaded.pop(rid)
