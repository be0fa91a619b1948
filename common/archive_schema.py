"""The archive's Parquet schema (versioned) and its files: one row per fate record.

A record is what a fate script added to the archive stream (:mod:`.protocol.archive_stream`): the fate
(``trained``, ``filtered``, ``recycled``, ``dead_lettered``), who decided it (``actor``: the
trainer consumer, or the producer for a prompt it dead-lettered), the trainer's ``step`` and
``position`` in the batch for a trained group, the trainer version at the time, and a copy of
the entry. A row keeps readable columns (samples with prompt, response, tokens, loss mask,
log-probs, reward, versions; history) beside ``data``, the entry's wire-format payload, from which
:mod:`rollstream.consumer.archive_replay` rebuilds the exact group.

Files are named ``part_<first id>_<last id>.parquet`` (ids with ``-`` as in Redis) under a
partition folder (``version=N`` or ``hour=YYYYMMDDHH``) and each holds a contiguous run of the
archive stream, written in id order: the highest last id over the files is where a restarted
archiver resumes (:func:`written_cursor`), so a record is in the files exactly once.

A folder belongs to one namespace (``OWNER_FILE``, :func:`claim_folder`); each file's metadata
names it and ``after``, the id its run follows, so a missing file shows as a break in the chain
(:func:`missing_runs`). Readers read only the columns and files they need (:func:`read_part`).

Schema versions (``SCHEMA_VERSION``, also in each file's metadata under ``rollstream.archive``):
1 is the first. :func:`read_table` reads every version it knows and upgrades it to the newest;
a column added by a later version is filled with nulls for older files.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .arrays import Unfetched, UnfetchedText
from .codec import decode_group, decode_prompt, encode_group
from .errors import ArchiveUnusable, ConfigError, DecodeError
from .imports import require_extra
from .models import Group, Prompt

if TYPE_CHECKING:
    import pyarrow as pa

SCHEMA_VERSION = 1
"""The Parquet schema written now; every version up to it is readable."""
READABLE_SCHEMAS = (1,)
METADATA_KEY = b"rollstream.archive"
FATES = ("trained", "filtered", "recycled", "dead_lettered", "evaluated")
BIG_ARRAYS = (
    "routed_experts", "indexer_topk", "top_p_token_ids", "top_p_token_offsets", "teacher_log_probs", "opd_reverse_kl",
)
"""Per-token arrays kept in ``data`` only with ``--keep-arrays`` (routing replay, teacher log-probs)."""
_PART = re.compile(r"^part_(\d+-\d+)_(\d+-\d+)\.parquet$")
ROW_GROUP_ROWS = 64
"""Rows per Parquet row group: a reader of a few rows (``archive view --limit 1``, one replayed
step) reads the row groups that hold them, not the whole file."""
OWNER_FILE = "rollstream-archive.json"
"""In an archive folder: ``{"namespace": NAME}``, the one namespace whose archiver writes there."""


def pyarrow() -> Any:
    """pyarrow, or ExtraNotInstalled naming the extra that installs it."""
    return require_extra("pyarrow", "parquet", "the archive's Parquet files")


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _int(value: bytes | str | None) -> int | None:
    text = _text(value)
    return int(text) if re.fullmatch(r"-?\d+", text) else None


def id_key(entry_id: str) -> tuple[int, int]:
    """A stream id as a sortable pair."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass(frozen=True, slots=True)
class ArchiveRecord:
    """One fate record as read from the archive stream."""

    archive_id: str
    fate: str
    reason: str
    actor: str
    step: int | None
    position: int | None
    stream: str
    ts_ms: int
    trainer_version: int
    entry_id: str
    record_bytes: int
    fields: Mapping[bytes, bytes]

    @classmethod
    def parse(cls, archive_id: bytes | str, raw: Mapping[bytes, bytes]) -> ArchiveRecord:
        meta = {"fate", "reason", "actor", "step", "position", "kind", "ts_ms", "trainer_version", "entry_id",
                "record_bytes"}
        own: dict[str, bytes] = {}
        fields: dict[bytes, bytes] = {}
        for name, value in raw.items():
            key = _text(name)
            if key in meta and key not in own:  # the record's own fields come first
                own[key] = value
            else:
                fields[name if isinstance(name, bytes) else str(name).encode()] = value
        return cls(
            archive_id=_text(archive_id), fate=_text(own.get("fate")), reason=_text(own.get("reason")),
            actor=_text(own.get("actor")), step=_int(own.get("step")), position=_int(own.get("position")),
            stream=_text(own.get("kind")), ts_ms=_int(own.get("ts_ms")) or 0,
            trainer_version=_int(own.get("trainer_version")) or 0, entry_id=_text(own.get("entry_id")),
            record_bytes=_int(own.get("record_bytes")) or 0, fields=fields,
        )


def partition_of(record: ArchiveRecord, by: str) -> str:
    """The partition folder of a record: ``version=N`` (trainer version) or ``hour=YYYYMMDDHH`` (UTC)."""
    if by == "version":
        return f"version={record.trainer_version}"
    import time

    return "hour=" + time.strftime("%Y%m%d%H", time.gmtime(record.ts_ms / 1000))


def _json(value: object) -> str | None:
    if value is None:
        return None
    return json.dumps(value, default=repr, ensure_ascii=False)


def _finite(value: float) -> float | None:
    return None if math.isnan(value) else value


def _strip(group: Group) -> Group:
    cleared: dict[str, Any] = dict.fromkeys(BIG_ARRAYS)
    samples = [replace(s, **cleared) for s in group.samples]
    return replace(group, samples=samples)


def _list(values: Any) -> list[Any] | None:
    """An array's values; None when absent or still in the payload store (not fetched)."""
    return None if values is None or isinstance(values, Unfetched) else list(values)


def _sample_rows(group: Group) -> list[dict[str, Any]]:
    rows = []
    for s in group.samples:
        reward = s.scalar_reward
        rows.append({
            "index": s.index,
            "response": None if isinstance(s.response, UnfetchedText) else s.response,  # not read: None
            "status": s.status.value,
            "reward": _finite(reward),
            "reward_json": _json(s.reward),
            "finish_reason": s.finish_reason,
            "error": s.error,
            "weight_versions": list(s.weight_versions),
            "prompt_length": s.prompt_length,
            "response_length": s.response_length,
            "tokens": _list(s.tokens),
            "loss_mask": _list(s.loss_mask),
            "rollout_log_probs": _list(s.rollout_log_probs),
            "metadata": _json(s.metadata),
        })
    return rows


def _prompt_text(prompt: object) -> tuple[str, bool]:
    return (prompt, False) if isinstance(prompt, str) else (json.dumps(prompt, ensure_ascii=False, default=repr), True)


def record_row(record: ArchiveRecord, *, keep_arrays: bool = False) -> dict[str, Any]:
    """The Parquet row of a record (an undecodable payload keeps its raw bytes and the error)."""
    data = record.fields.get(b"data", b"")
    row: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION, "archive_id": record.archive_id, "fate": record.fate,
        "reason": record.reason, "actor": record.actor, "step": record.step, "position": record.position,
        "trainer_version": record.trainer_version, "ts_ms": record.ts_ms, "stream": record.stream,
        "entry_id": record.entry_id, "payload": "group" if record.stream in ("groups", "eval_groups") else "prompt",
        "index": _int(record.fields.get(b"index")), "epoch": _int(record.fields.get(b"epoch")),
        "attempt": _int(record.fields.get(b"attempt")), "producer": None, "source": None, "status": None,
        "reward_mean": None, "min_version": None, "max_version": None, "prompt": None, "prompt_is_chat": None,
        "label": None, "history": [], "metadata": None, "samples": [], "data": data, "arrays_kept": keep_arrays,
        "decode_error": None,
    }
    try:
        item: Group | Prompt = decode_group(data) if row["payload"] == "group" else decode_prompt(data)
    except DecodeError as exc:
        row["decode_error"] = f"{exc.reason}: {exc.detail}"
        return row
    row["prompt"], row["prompt_is_chat"] = _prompt_text(item.prompt)
    row.update(index=item.index, epoch=item.epoch, attempt=item.attempt, label=_json(item.label),
               history=list(item.history), metadata=_json(item.metadata), source=_source(item))
    if isinstance(item, Group):
        if item.payload is not None and not item.payload.attached:
            # its arrays were not read from the payload store (the archiver logged why): the row
            # keeps the entry as it came, refs included, and the samples without their arrays
            row["decode_error"] = "payload: the offloaded arrays were not read from the payload store"
        elif not keep_arrays and (item.payload is not None or any(
            getattr(s, name) is not None for s in item.samples for name in BIG_ARRAYS
        )):  # a version-4 group's refs go too: its objects are freed once the record is confirmed
            item = _strip(item)
            row["data"] = encode_group(item)
        row.update(producer=item.producer, status=item.status.value, reward_mean=_finite(item.reward_mean),
                   min_version=item.min_version, max_version=item.max_version, samples=_sample_rows(item))
    return row


def _source(item: Group | Prompt) -> str | None:
    """The named dataset source (``Group.source``), else a ``source`` in the metadata, else None."""
    if item.source:
        return item.source
    source = item.metadata.get("source") if isinstance(item.metadata, Mapping) else None
    return None if source is None else str(source)


def arrow_schema() -> pa.Schema:
    """The schema of ``SCHEMA_VERSION`` (docs/operations.md lists every column)."""
    pa = pyarrow()
    sample = pa.struct([
        ("index", pa.int64()), ("response", pa.string()), ("status", pa.string()), ("reward", pa.float64()),
        ("reward_json", pa.string()), ("finish_reason", pa.string()), ("error", pa.string()),
        ("weight_versions", pa.list_(pa.int64())), ("prompt_length", pa.int64()), ("response_length", pa.int64()),
        ("tokens", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8())),
        ("rollout_log_probs", pa.list_(pa.float32())), ("metadata", pa.string()),
    ])
    return pa.schema([
        ("schema_version", pa.int16()), ("archive_id", pa.string()), ("fate", pa.string()), ("reason", pa.string()),
        ("actor", pa.string()), ("step", pa.int64()), ("position", pa.int32()), ("trainer_version", pa.int64()),
        ("ts_ms", pa.int64()), ("stream", pa.string()), ("entry_id", pa.string()), ("payload", pa.string()),
        ("index", pa.int64()), ("epoch", pa.int64()), ("attempt", pa.int64()), ("producer", pa.string()),
        ("source", pa.string()), ("status", pa.string()), ("reward_mean", pa.float64()),
        ("min_version", pa.int64()), ("max_version", pa.int64()), ("prompt", pa.string()),
        ("prompt_is_chat", pa.bool_()), ("label", pa.string()), ("history", pa.list_(pa.string())),
        ("metadata", pa.string()), ("samples", pa.list_(sample)), ("data", pa.binary()),
        ("arrays_kept", pa.bool_()), ("decode_error", pa.string()),
    ], metadata={METADATA_KEY: json.dumps({"schema_version": SCHEMA_VERSION}).encode()})


def part_name(first: str, last: str) -> str:
    return f"part_{first}_{last}.parquet"


def archive_files(root: str | Path) -> list[Path]:
    """Every finished part file under ``root``, in archive order (by first id)."""
    found = []
    for path in Path(root).rglob("part_*.parquet"):
        match = _PART.match(path.name)
        if match:
            found.append((id_key(match.group(1)), path))
    return [path for _, path in sorted(found)]


def written_cursor(root: str | Path) -> str:
    """The last archive id in the files under ``root`` (``0-0`` when none): where to resume."""
    best = (0, 0)
    for path in archive_files(root):
        match = _PART.match(path.name)
        if match:
            best = max(best, id_key(match.group(2)))
    return f"{best[0]}-{best[1]}"


def _unreadable(path: Path | str, exc: BaseException) -> ArchiveUnusable:
    said = " ".join(str(exc).split())[:300]  # one line: the CLI prints the first
    return ArchiveUnusable(
        f"{path}: not a readable archive file ({type(exc).__name__}: {said}); it is damaged or was cut short: "
        "restore it from a copy, or move it out of the archive folder (its records are then missing) and re-run"
    )


def _arrow_errors() -> tuple[type[BaseException], ...]:
    pa = pyarrow()
    return (OSError, pa.ArrowException)


def _file_info(path: str | Path, raw_metadata: Mapping[bytes, bytes] | None) -> dict[str, Any]:
    raw = (raw_metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise ConfigError(f"{path}: not a rollstream archive file (no {METADATA_KEY.decode()} metadata)")
    try:
        info = json.loads(raw)
        version = int(info["schema_version"])
    except (ValueError, KeyError, TypeError) as exc:
        raise _unreadable(path, exc) from exc
    if version not in READABLE_SCHEMAS:
        raise ConfigError(f"{path}: archive schema {version} is newer than this rollstream reads {READABLE_SCHEMAS}")
    return dict(info)


def file_metadata(path: str | Path) -> dict[str, Any]:
    """A part file's ``rollstream.archive`` metadata: ``schema_version``, and in files written since
    issue 49 the ``namespace`` that wrote it and ``after``, the archive id its run follows."""
    pyarrow()
    import pyarrow.parquet as pq

    try:
        meta = pq.read_schema(path).metadata
    except _arrow_errors() as exc:
        raise _unreadable(path, exc) from exc
    return _file_info(path, meta)


def file_schema_version(path: str | Path) -> int:
    return int(file_metadata(path)["schema_version"])


@dataclass(frozen=True, slots=True)
class ArchivePart:
    """One part file, from its name and footer (no row is read)."""

    path: Path
    first: str
    last: str
    rows: int
    namespace: str | None
    """The namespace whose archiver wrote it (None: a file of an older rollstream)."""
    after: str | None
    """The archive id its run follows (the previous file's last; None: an older file)."""
    row_groups: tuple[int, ...] = ()
    """The rows of each of its row groups, in order."""

    def row_group_of(self, row: int) -> tuple[int, int]:
        """(first row, end) of the row group that holds ``row``."""
        start = 0
        for size in self.row_groups:
            if row < start + size:
                return start, start + size
            start += size
        return 0, self.rows


def scan_parts(root: str | Path) -> list[ArchivePart]:
    """The part files under ``root`` in archive order, their footers read (``ArchiveUnusable``
    names a damaged one)."""
    pyarrow()
    import pyarrow.parquet as pq

    parts = []
    for path in archive_files(root):
        match = _PART.match(path.name)
        if match is None:  # archive_files lists matching names only
            continue
        try:
            with pq.ParquetFile(path) as handle:
                meta, rows = handle.schema_arrow.metadata, handle.metadata.num_rows
                groups = tuple(handle.metadata.row_group(i).num_rows for i in range(handle.metadata.num_row_groups))
        except _arrow_errors() as exc:
            raise _unreadable(path, exc) from exc
        info = _file_info(path, meta)
        parts.append(ArchivePart(
            path=path, first=match.group(1), last=match.group(2), rows=rows,
            namespace=info.get("namespace"), after=info.get("after"), row_groups=groups,
        ))
    return parts


def one_namespace(parts: Iterable[ArchivePart], root: str | Path) -> str | None:
    """The namespace the files were written by; ``ConfigError`` when they name several."""
    names = sorted({p.namespace for p in parts if p.namespace is not None})
    if len(names) > 1:
        raise ConfigError(
            f"{root}: the archive folder holds files of several namespaces {names}: an archive folder "
            "belongs to one namespace (read each namespace's own folder)"
        )
    return names[0] if names else None


def missing_runs(parts: list[ArchivePart]) -> list[tuple[int, str, str]]:
    """Where a part file is missing: (number of the file after the gap, last id before it, that
    file's ``after`` id) for each break in the chain of files (a file's ``after`` is the last id of
    the one before it; the first file's is ``0-0``)."""
    gaps = []
    previous = "0-0"
    for number, part in enumerate(parts):
        if part.after is not None and id_key(part.after) != id_key(previous):
            gaps.append((number, previous, part.after))
        previous = part.last
    return gaps


def read_part(path: str | Path, columns: Iterable[str] | None = None, *, rows: slice | None = None) -> pa.Table:
    """One part file's ``columns`` (only those are read), upgraded to ``SCHEMA_VERSION``; ``rows``:
    just those rows (the others of their row groups are read and dropped)."""
    pa = pyarrow()
    import pyarrow.parquet as pq

    schema = arrow_schema()
    wanted = list(columns) if columns is not None else schema.names
    try:
        with pq.ParquetFile(path) as handle:
            _file_info(path, handle.schema_arrow.metadata)
            present = set(handle.schema_arrow.names)
            read = [name for name in wanted if name in present]
            if rows is None:
                table = handle.read(columns=read)
            else:
                start, stop, _ = rows.indices(handle.metadata.num_rows)
                table = _read_rows(handle, read, start, stop)
    except _arrow_errors() as exc:
        raise _unreadable(path, exc) from exc
    for name in wanted:
        if name not in present:  # a column of a later version: null for older files
            table = table.append_column(schema.field(name), pa.nulls(len(table), schema.field(name).type))
    return table.select(wanted)


def _read_rows(handle: Any, columns: list[str], start: int, stop: int) -> pa.Table:
    """Rows ``start:stop`` of an open ParquetFile, reading only the row groups that hold them."""
    pa = pyarrow()
    meta = handle.metadata
    tables = []
    offset = 0
    for group in range(meta.num_row_groups):
        size = meta.row_group(group).num_rows
        lo, hi = max(start, offset), min(stop, offset + size)
        if lo < hi:
            tables.append(handle.read_row_group(group, columns=columns).slice(lo - offset, hi - lo))
        offset += size
    if not tables:
        return handle.schema_arrow.empty_table().select(columns)
    return pa.concat_tables(tables)


def read_table(root: str | Path, columns: Iterable[str] | None = None) -> pa.Table:
    """Every record under ``root`` in archive order, upgraded to ``SCHEMA_VERSION``; only
    ``columns`` are read from the files (``data``, the payloads, is most of an archive's bytes)."""
    pa = pyarrow()
    schema = arrow_schema()
    wanted = list(columns) if columns is not None else schema.names
    parts = scan_parts(root)
    one_namespace(parts, root)
    tables = [read_part(part.path, wanted) for part in parts]
    if not tables:
        return schema.empty_table().select(wanted)
    return pa.concat_tables(tables)


def claim_folder(root: Path, namespace: str) -> None:
    """Make ``root`` the archive folder of ``namespace`` (its ``OWNER_FILE``), or refuse it with
    ``ConfigError`` naming the namespace that owns it. A folder without the file is claimed when
    none of its part files names another namespace (files of an older rollstream name none)."""
    marker = root / OWNER_FILE
    if not marker.exists():
        if (other := one_namespace(scan_parts(root), root)) not in (None, namespace):
            _refuse_foreign(root, other, namespace)
        tmp = root / f".{OWNER_FILE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"namespace": namespace}) + "\n", encoding="utf-8")
        try:
            os.link(tmp, marker)  # atomic: of two archivers claiming a new folder, one wins
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    try:
        owner = json.loads(marker.read_text(encoding="utf-8"))["namespace"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ArchiveUnusable(
            f"{marker}: unreadable ({exc}); it names the namespace this archive folder belongs to: "
            f'restore it, or write {{"namespace": "{namespace}"}} into it if the folder is {namespace!r}\'s'
        ) from exc
    if owner != namespace:
        _refuse_foreign(root, str(owner), namespace)


def _refuse_foreign(root: Path, owner: str, namespace: str) -> None:
    raise ConfigError(
        f"{root} is the archive folder of namespace {owner!r}, not {namespace!r}: an archive folder belongs to "
        f"one namespace (its cursor and its steps are that namespace's); give --out a folder of its own, "
        f"e.g. {root.parent / namespace}"
    )


def part_metadata(namespace: str, after: str) -> dict[bytes, bytes]:
    """The ``rollstream.archive`` metadata of a file written now."""
    info = {"schema_version": SCHEMA_VERSION, "namespace": namespace, "after": after}
    return {METADATA_KEY: json.dumps(info).encode()}


def write_tmp(root: str | Path, partition: str, rows: list[dict[str, Any]], metadata: Mapping[bytes, bytes],
              tag: str = "") -> tuple[Path, Path]:
    """Write ``rows`` (a contiguous run, in id order) as one zstd Parquet file under a temporary
    name, fsynced; (temporary, final) paths. ``tag`` makes the temporary name the writer's own."""
    pa = pyarrow()
    import pyarrow.parquet as pq

    folder = Path(root) / partition
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / part_name(rows[0]["archive_id"], rows[-1]["archive_id"])
    tmp = final.with_name(f"{final.name}{'.' + tag if tag else ''}.tmp")
    table = pa.Table.from_pylist(rows, schema=arrow_schema()).replace_schema_metadata(dict(metadata))
    try:
        pq.write_table(table, tmp, compression="zstd", row_group_size=ROW_GROUP_ROWS)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
    except BaseException:  # a full disk: no half file left behind
        tmp.unlink(missing_ok=True)
        raise
    return tmp, final


def publish_part(tmp: Path, final: Path) -> None:
    """Rename a temporary file to its final name and fsync the folder."""
    os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_part(root: str | Path, partition: str, rows: list[dict[str, Any]],
               metadata: Mapping[bytes, bytes] | None = None) -> Path:
    """Write ``rows`` as one part file, atomically: a temporary name, fsync, rename, fsync of the
    folder. A killed writer leaves a ``.tmp`` only."""
    tmp, final = write_tmp(root, partition, rows, metadata or arrow_schema().metadata)
    publish_part(tmp, final)
    return final


def remove_partial(root: str | Path) -> int:
    """Delete the ``.tmp`` files a killed writer left; how many."""
    gone = 0
    for path in Path(root).rglob("part_*.parquet*.tmp"):
        path.unlink(missing_ok=True)
        gone += 1
    return gone
