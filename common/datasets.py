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
slime's scheme always does (it is slime's order). A full permutation costs 8 bytes per row (the
permuted ids, and for JSONL each row's start in its unit) and reads its rows a block at a time.
Smaller Parquet row groups (say 10k-50k rows) make the buffered shuffle closer to a full one.

A file is scanned once, at start: one that shrinks, vanishes or is replaced while it is fed is a
ConfigError naming it (the feed stops rather than count rows it never read). A row is at most
:data:`MAX_LINE_BYTES` (a longer JSONL line is one row, a dead letter; the feeder caps encoded
Parquet rows the same), and Parquet values Python gives as dates, times or decimals are fed as
plain values (:func:`_plain`).
"""

from __future__ import annotations

import bisect
import datetime
import decimal
import glob
import hashlib
import json
import os
import random
import re
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

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


class Shard(Protocol):
    path: str
    pick_rows: int
    """Rows of a full permutation :meth:`pick` reads at a time."""
    units: list[int]
    """Rows per unit."""

    def read(self, unit: int, start: int) -> Iterator[Any]:
        """The unit's raw rows from row ``start`` on, streamed (fewer when the file shrank)."""
        ...

    def pick(self, unit: int, rows: list[int]) -> Iterator[Any]:
        """The unit's raw rows at the ascending offsets ``rows`` (a full permutation's reads)."""
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
    """A JSONL file; a row is a line (blank lines keep their number and are skipped).

    A line longer than :data:`MAX_LINE_BYTES` is still one row (a dead letter): the scan and the
    reads skip its rest without holding it, so the rows after it keep their numbers."""

    pick_rows = 1024
    """Rows of a full permutation read at a time (each one found by a seek: see :meth:`pick`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offsets: list[int] = []
        self.units: list[int] = []
        try:
            with open(path, "rb") as handle:
                start = 0
                while data := handle.read(UNIT_BYTES):
                    size = len(data)
                    if size == UNIT_BYTES and not data.endswith(b"\n"):
                        while tail := handle.readline(UNIT_BYTES):  # to the end of the line, however long
                            size += len(tail)
                            if tail.endswith(b"\n"):
                                break
                    self.offsets.append(start)
                    self.units.append(data.count(b"\n") + (0 if data.endswith(b"\n") else 1))
                    start += size
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read the dataset: {exc}") from None
        self.size = start
        self._firsts = [0]
        for count in self.units:
            self._firsts.append(self._firsts[-1] + count)
        self._starts: list[array[int]] = []

    def _open(self) -> Any:
        try:
            return open(self.path, "rb")
        except OSError as exc:
            raise _vanished(self.path, exc) from None

    def read(self, unit: int, start: int) -> Iterator[Any]:
        with self._open() as handle:
            handle.seek(self.offsets[unit])
            for number in range(self.units[unit]):
                line = _line(handle)
                if not line:  # the file ends before the rows counted at start: Dataset.read says so
                    return
                if number >= start:
                    yield line

    def pick(self, unit: int, rows: list[int]) -> Iterator[Any]:
        """The unit's raw rows at the (ascending) offsets ``rows``, each found by a seek: the row
        starts are indexed once, 4 bytes a row (:meth:`_row_starts`)."""
        starts = self._row_starts(unit)
        with self._open() as handle:
            for row in rows:
                handle.seek(self.offsets[unit] + starts[row])
                line = _line(handle)
                if not line:
                    raise _changed(self.path, f"it ends before row {self._firsts[unit] + row + 1}")
                yield line

    def _row_starts(self, unit: int) -> array[int]:
        """Where each row of ``unit`` starts, from the unit's start (every row starts in its first
        :data:`UNIT_BYTES`); indexed for every unit at the first call."""
        if not self._starts:
            with self._open() as handle:
                for index, offset in enumerate(self.offsets):
                    handle.seek(offset)
                    head = handle.read(UNIT_BYTES)
                    starts = array("I", [0])
                    starts.extend(m.end() for m in _NEWLINE.finditer(head, 0, len(head) - 1))
                    if len(starts) != self.units[index]:
                        found = f"unit {index} holds {len(starts)} rows, {self.units[index]} at start"
                        raise _changed(self.path, found)
                    self._starts.append(starts)
        return self._starts[unit]

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
        with self._open() as handle:
            head = handle.read(65536)
        return f"{os.path.basename(self.path)}:{self.size}:{len(self.units)}:{hashlib.sha1(head).hexdigest()[:12]}"


_NEWLINE = re.compile(b"\n")


def _line(handle: Any) -> bytes:
    """The next line; one longer than :data:`MAX_LINE_BYTES` is cut there (a dead letter) and
    its rest skipped, so it stays one row. b"" at the end of the file."""
    line: bytes = handle.readline(MAX_LINE_BYTES + 1)
    if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
        while (rest := handle.readline(UNIT_BYTES)) and not rest.endswith(b"\n"):
            pass
    return line


def _changed(path: str, what: str) -> ConfigError:
    return ConfigError(
        f"{path}: the dataset file changed while it was fed ({what}): the feed stops rather than lose rows. "
        "Restore the file, or feed the new one into a new namespace"
    )


def _vanished(path: str, exc: BaseException) -> ConfigError:
    return ConfigError(
        f"{path}: the dataset file cannot be read any more ({type(exc).__name__}: {exc}): was it deleted or "
        "replaced while it was fed? Restore it and restart the feed (it resumes where it stopped)"
    )


_TEMPORAL = (datetime.datetime, datetime.date, datetime.time)


def _plain(value: Any, where: str) -> Any:
    """A Parquet value as one msgpack carries: timestamps, dates and times as ISO 8601 text,
    durations as seconds, decimals as their exact text; RowError for anything else."""
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v, where) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v, where) for v in value]
    if isinstance(value, _TEMPORAL):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return str(value)
    raise RowError(f"{where}: a {type(value).__name__} value cannot be fed (no plain JSON-like form)")


def _needs_plain(arrow_type: Any) -> bool:
    """Whether a column of this Arrow type reads as values msgpack cannot carry (dates, decimals...)."""
    import pyarrow as pa

    t = arrow_type
    if pa.types.is_temporal(t) or pa.types.is_decimal(t) or pa.types.is_interval(t):
        return True
    if pa.types.is_struct(t):
        return any(_needs_plain(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_map(t):
        return _needs_plain(t.key_type) or _needs_plain(t.item_type)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _needs_plain(t.value_type)
    return pa.types.is_dictionary(t) and _needs_plain(t.value_type)


@dataclass(frozen=True, slots=True)
class _Unreadable:
    """A Parquet row pyarrow cannot give as Python values (its reason): decoded as a RowError."""

    reason: str


def _to_micros(arrow_type: Any) -> Any:
    """The microsecond type a top-level nanosecond timestamp, time or duration column is read as, or None."""
    import pyarrow as pa

    t = arrow_type
    if getattr(t, "unit", None) != "ns":
        return None
    if pa.types.is_timestamp(t):
        return pa.timestamp("us", tz=t.tz)
    if pa.types.is_time64(t):
        return pa.time64("us")
    if pa.types.is_duration(t):
        return pa.duration("us")
    return None


def _cast_schema(schema: Any, casts: dict[int, Any]) -> Any:
    for i, arrow_type in casts.items():
        schema = schema.set(i, schema.field(i).with_type(arrow_type))
    return schema


class ParquetShard:
    """A Parquet file; a unit is a row group, read in batches of :data:`PARQUET_BATCH` rows.
    Timestamp, date, time, duration and decimal values are fed as plain values (:func:`_plain`)."""

    pick_rows = 16384
    """Rows of a full permutation read at a time: each block decodes the row groups it touches
    (a Parquet row cannot be read alone), so a block is larger than JSONL's."""

    def __init__(self, path: str) -> None:
        pq = _pyarrow_parquet()
        self.path = path
        try:
            metadata = pq.ParquetFile(path).metadata
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise ConfigError(f"{path}: cannot read the Parquet file: {exc}") from None
        self.units = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
        arrow_schema = metadata.schema.to_arrow_schema()
        self._schema = arrow_schema.to_string(show_schema_metadata=False)
        self._plain = any(_needs_plain(field.type) for field in arrow_schema)
        self._casts = {i: t for i, field in enumerate(arrow_schema) if (t := _to_micros(field.type)) is not None}
        self._firsts = [0]
        for count in self.units:
            self._firsts.append(self._firsts[-1] + count)

    def _batches(self, unit: int) -> Iterator[Any]:
        """The row group's record batches; a file gone or changed under the feed is a ConfigError."""
        pq = _pyarrow_parquet()
        try:
            with pq.ParquetFile(self.path) as reader:
                # one thread: arrow's pool threads each keep an arena (25 MB more RSS, bench/data.py)
                yield from reader.iter_batches(batch_size=PARQUET_BATCH, row_groups=[unit], use_threads=False)
        except (OSError, ValueError, IndexError) as exc:  # ArrowInvalid is a ValueError; a lost row group, IndexError
            raise _vanished(self.path, exc) from None

    def read(self, unit: int, start: int) -> Iterator[Any]:
        skip = start
        for batch in self._batches(unit):
            if skip >= batch.num_rows:
                skip -= batch.num_rows
                continue
            rows = self._pylist(batch.slice(skip))
            skip = 0
            yield from rows

    def pick(self, unit: int, rows: list[int]) -> Iterator[Any]:
        """The row group's rows at the (ascending) offsets ``rows``: its batches are decoded, and
        only those rows converted to Python."""
        base, at = 0, 0
        for batch in self._batches(unit):
            end = base + batch.num_rows
            upto = bisect.bisect_left(rows, end, at)
            if upto > at:
                yield from self._pylist(batch.take([r - base for r in rows[at:upto]]))
                at = upto
            base = end
            if at == len(rows):
                return
        raise _changed(self.path, f"row group {unit} holds {base} rows, {self.units[unit]} at start")

    def _pylist(self, batch: Any) -> list[Any]:
        """The batch's rows as Python; nanosecond times cut to the microsecond (Python's datetime
        holds no more); a row Python cannot hold is an :class:`_Unreadable` (a dead letter)."""
        if self._casts:
            import pyarrow as pa

            columns = [
                batch.column(i).cast(self._casts[i], safe=False) if i in self._casts else batch.column(i)
                for i in range(batch.num_columns)
            ]
            batch = pa.RecordBatch.from_arrays(columns, schema=_cast_schema(batch.schema, self._casts))
        try:
            rows: list[Any] = batch.to_pylist()
        except (ValueError, OverflowError):  # a nested nanosecond time, say: row by row, to name the bad ones
            rows = []
            for i in range(batch.num_rows):
                try:
                    rows.append(batch.slice(i, 1).to_pylist()[0])
                except (ValueError, OverflowError) as exc:
                    rows.append(_Unreadable(str(exc)))
        return rows

    def decode(self, raw: Any, row: int) -> Any:
        if isinstance(raw, _Unreadable):
            raise RowError(f"{self.path} row {row}: cannot be read as Python values: {raw.reason}")
        return _plain(raw, f"{self.path} row {row}") if self._plain else raw

    def row_of(self, unit: int, offset: int) -> int:
        return self._firsts[unit] + offset

    def fingerprint(self) -> str:
        digest = hashlib.sha1(self._schema.encode()).hexdigest()[:12]
        try:
            size = os.path.getsize(self.path)
        except OSError as exc:
            raise _vanished(self.path, exc) from None
        return f"{os.path.basename(self.path)}:{size}:{self.units}:{digest}"


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
            raw = next(rows, _END)
            if raw is _END:
                row = shard.row_of(unit.unit, unit.start + rid - unit.first_id)
                raise _changed(shard.path, f"it ends before row {row + 1}, {sum(shard.units)} rows counted at start")
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

    def record(self, row_id: int, raw: Any) -> Record | None:
        """The row's record, None for a blank line; RowError naming file and row."""
        unit = self.units[self.unit_of(row_id)]
        shard = self.shards[unit.shard]
        row = shard.row_of(unit.unit, unit.start + row_id - unit.first_id)
        obj = shard.decode(raw, row)
        if obj is None:
            return None
        return self.row_format.record(obj, self.where(row_id))

    def where(self, row_id: int) -> str:
        """The row's file and row, as errors name it (``file:line`` for JSONL, 1-based)."""
        unit = self.units[self.unit_of(row_id)]
        shard = self.shards[unit.shard]
        row = shard.row_of(unit.unit, unit.start + row_id - unit.first_id)
        return f"{shard.path}:{row + 1}" if isinstance(shard, JsonlShard) else f"{shard.path} row {row}"

    def records(self) -> Iterator[Record]:
        """Every row's record in the dataset's own order, read a unit at a time (blank lines
        skipped); a row that does not fit is a ``ConfigError`` naming its file and row (an eval
        set, read whole, is refused rather than dead-lettered row by row)."""
        for unit in range(len(self.units)):
            for row_id, raw in self.read(unit):
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
