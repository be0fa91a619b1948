"""The curriculum's row statistics and the mix's carry, saved with a framework checkpoint.

``save(k)`` writes ``<--save>/rollout/rollstream_stats_<k>.jsonl.gz`` beside the framework's own
``rollout/`` state: a header line (format, namespace, rollout id, the mix's carry) and then one
``[field, statistics]`` line per row, read from Redis by HSCAN in chunks and written as they come,
so neither side holds the whole hash. ``load(k)`` reads ``<--load>/rollout/...`` back in chunks and
replaces the rows hash (written aside, then renamed over); a run restored from checkpoint k then
sees the statistics as they were at k. Rollouts after k that the journal replays are not counted
again (their commits happened once, before the crash), so a statistic is missing at most for those.

The carry is saved as each live source's groups committed since the mix's baseline; load moves the
baseline so the same counts hold against today's committed counters, which gives back the carry of
checkpoint k exactly (each in (-1, 1): the long-run ratio stays exact to the group).
"""

from __future__ import annotations

import gzip
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from rollstream.common.errors import ConfigError
from rollstream.common.keys import Keys, SourceField
from rollstream.common.protocol import Sources
from rollstream.common.redis_values import int_or

logger = logging.getLogger(__name__)

FORMAT = "rollstream-stats/1"
CHUNK = 1000
"""Rows per HSCAN call and per HSET on restore."""


def stats_path(directory: str | os.PathLike[str], rollout_id: int) -> Path:
    return Path(directory) / "rollout" / f"rollstream_stats_{rollout_id}.jsonl.gz"


def _carry_counts(state: dict[str, str]) -> dict[str, Any]:
    """The mix's baseline: the live set and each of its sources' groups committed since."""
    live = state.get(SourceField.BASE_SET) or ""
    since = {
        name: int_or(state.get(SourceField.of(name, "committed")), 0) - int_or(state.get(SourceField.base(name)), 0)
        for name in live.split(",") if name
    }
    return {"base_set": live, "since": since}


async def save_stats(redis: Redis, namespace: str, rollout_id: int, directory: str | os.PathLike[str]) -> Path:
    """Write checkpoint ``rollout_id``'s statistics file under ``directory``; returns its path."""
    sources = Sources(redis, Keys(namespace))
    path = stats_path(directory, rollout_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    header = {"format": FORMAT, "namespace": namespace, "rollout_id": rollout_id,
              "mix": _carry_counts(await sources.state())}
    rows = 0
    with gzip.open(partial, "wt", encoding="utf-8") as out:
        out.write(json.dumps(header) + "\n")
        async for chunk in sources.scan_rows(CHUNK):
            out.writelines(json.dumps([field, value]) + "\n" for field, value in chunk)
            rows += len(chunk)
    partial.replace(path)
    logger.info("checkpoint %d: %d rows' statistics and the mix's carry saved to %s", rollout_id, rows, path)
    return path


def _read(path: Path, namespace: str) -> tuple[dict[str, Any], Iterator[list[tuple[str, str]]]]:
    handle = gzip.open(path, "rt", encoding="utf-8")
    try:
        header = json.loads(handle.readline())
    except (OSError, ValueError, EOFError) as exc:
        handle.close()
        raise ConfigError(f"{path}: not a rollstream statistics file ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        handle.close()
        raise ConfigError(f"{path}: not a rollstream statistics file (format {FORMAT} expected)")
    if header.get("namespace") != namespace:
        logger.warning("%s was saved from namespace %r, restoring into %r", path, header.get("namespace"), namespace)

    def chunks() -> Iterator[list[tuple[str, str]]]:
        with handle:
            chunk: list[tuple[str, str]] = []
            for number, line in enumerate(handle, start=2):
                try:
                    field, value = json.loads(line)
                except (ValueError, TypeError):
                    raise ConfigError(f"{path}: line {number} is not a [field, statistics] pair") from None
                chunk.append((str(field), str(value)))
                if len(chunk) >= CHUNK:
                    yield chunk
                    chunk = []
            if chunk:
                yield chunk

    return header, chunks()


async def load_stats(redis: Redis, namespace: str, rollout_id: int, directory: str | os.PathLike[str]) -> bool:
    """Restore checkpoint ``rollout_id``'s statistics from ``directory``; False when it has no file
    (a checkpoint written before this existed, or by a run without rollstream)."""
    path = stats_path(directory, rollout_id)
    if not path.exists():
        logger.warning("checkpoint %d has no %s: the row statistics and the mix's carry stay as Redis has them",
                       rollout_id, path)
        return False
    sources = Sources(redis, Keys(namespace))
    header, chunks = _read(path, namespace)
    rows = await sources.restore_rows(chunks)
    mix = header.get("mix") or {}
    live, since = str(mix.get("base_set") or ""), mix.get("since") or {}
    if live and isinstance(since, dict):
        state = await sources.state()
        mapping: dict[str, str | int] = {SourceField.BASE_SET: live}
        for name, count in since.items():
            mapping[SourceField.base(name)] = int_or(state.get(SourceField.of(name, "committed")), 0) - int(count)
        await sources.set(mapping)
    logger.info("checkpoint %d: %d rows' statistics and the mix's carry restored from %s", rollout_id, rows, path)
    return True
