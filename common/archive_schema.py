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

from .codec import decode_group, decode_prompt, encode_group
from .errors import ConfigError, DecodeError
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


def _sample_rows(group: Group) -> list[dict[str, Any]]:
    rows = []
    for s in group.samples:
        reward = s.scalar_reward
        rows.append({
            "index": s.index,
            "response": s.response,
            "status": s.status.value,
            "reward": _finite(reward),
            "reward_json": _json(s.reward),
            "finish_reason": s.finish_reason,
            "error": s.error,
            "weight_versions": list(s.weight_versions),
            "prompt_length": s.prompt_length,
            "response_length": s.response_length,
            "tokens": list(s.tokens),
            "loss_mask": None if s.loss_mask is None else list(s.loss_mask),
            "rollout_log_probs": None if s.rollout_log_probs is None else list(s.rollout_log_probs),
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
        if not keep_arrays and any(getattr(s, name) is not None for s in item.samples for name in BIG_ARRAYS):
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


def write_part(root: str | Path, partition: str, rows: list[dict[str, Any]]) -> Path:
    """Write ``rows`` (a contiguous run, in id order) as one zstd Parquet file, atomically: a
    temporary name, fsync, rename, fsync of the folder. A killed writer leaves a ``.tmp`` only."""
    pa = pyarrow()
    import pyarrow.parquet as pq

    folder = Path(root) / partition
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / part_name(rows[0]["archive_id"], rows[-1]["archive_id"])
    tmp = final.with_suffix(".parquet.tmp")
    table = pa.Table.from_pylist(rows, schema=arrow_schema())
    pq.write_table(table, tmp, compression="zstd")
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, final)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return final


def remove_partial(root: str | Path) -> int:
    """Delete the ``.tmp`` files a killed writer left; how many."""
    gone = 0
    for path in Path(root).rglob("part_*.parquet.tmp"):
        path.unlink(missing_ok=True)
        gone += 1
    return gone


def file_schema_version(path: str | Path) -> int:
    pyarrow()
    import pyarrow.parquet as pq

    meta = pq.read_schema(path).metadata or {}
    raw = meta.get(METADATA_KEY)
    if raw is None:
        raise ConfigError(f"{path}: not a rollstream archive file (no {METADATA_KEY.decode()} metadata)")
    version = int(json.loads(raw)["schema_version"])
    if version not in READABLE_SCHEMAS:
        raise ConfigError(f"{path}: archive schema {version} is newer than this rollstream reads {READABLE_SCHEMAS}")
    return version


def read_table(root: str | Path, columns: Iterable[str] | None = None) -> pa.Table:
    """Every record under ``root`` in archive order, upgraded to ``SCHEMA_VERSION``."""
    pa = pyarrow()
    import pyarrow.parquet as pq

    schema = arrow_schema()
    wanted = list(columns) if columns is not None else schema.names
    tables = []
    for path in archive_files(root):
        file_schema_version(path)  # every readable version has the columns of version 1
        table = pq.read_table(path)
        missing = [name for name in wanted if name not in table.schema.names]
        for name in missing:  # a column of a later version: null for older files
            table = table.append_column(schema.field(name), pa.nulls(len(table), schema.field(name).type))
        tables.append(table.select(wanted))
    if not tables:
        return schema.empty_table().select(wanted)
    return pa.concat_tables(tables)
