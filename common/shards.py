"""The dataset file formats, each read as a :class:`Shard`: a JSONL file, a Parquet file.

A shard is cut into *units* without reading its rows (about 1 MiB of lines of a JSONL file, found
by one sequential scan; a row group of a Parquet file, from its footer), which it reads from any
row on (:meth:`Shard.read`) or at chosen rows (:meth:`Shard.pick`, a full permutation's reads), and
decodes a row at a time into a JSON-like object. :mod:`~rollstream.common.datasets` puts shards
together into a dataset.

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
import hashlib
import json
import os
import re
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from rollstream.common.errors import ConfigError, RowError

MAX_LINE_BYTES = 16 * 1024 * 1024
UNIT_BYTES = 1024 * 1024
"""A JSONL unit: this many bytes, then to the end of the line."""
PARQUET_BATCH = 1024
"""Rows decoded at a time from a Parquet row group (memory per read, not per row group)."""


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

    def where(self, row: int) -> str:
        """Row ``row`` (0-based in the shard) as errors name it: ``file:line`` (1-based) for JSONL."""
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
                    raise file_changed(self.path, f"it ends before row {self._firsts[unit] + row + 1}")
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
                        raise file_changed(self.path, found)
                    self._starts.append(starts)
        return self._starts[unit]

    def decode(self, raw: Any, row: int) -> Any:
        where = self.where(row)
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

    def where(self, row: int) -> str:
        return f"{self.path}:{row + 1}"

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


def file_changed(path: str, what: str) -> ConfigError:
    """The error of a dataset file that is not what it was at start (the feed stops)."""
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
        raise file_changed(self.path, f"row group {unit} holds {base} rows, {self.units[unit]} at start")

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
            raise RowError(f"{self.where(row)}: cannot be read as Python values: {raw.reason}")
        return _plain(raw, self.where(row)) if self._plain else raw

    def row_of(self, unit: int, offset: int) -> int:
        return self._firsts[unit] + offset

    def where(self, row: int) -> str:
        return f"{self.path} row {row}"

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


def open_shard(path: str) -> JsonlShard | ParquetShard:
    return ParquetShard(path) if path.endswith(".parquet") else JsonlShard(path)
