"""The eval lane, the trainer's side: submit an eval set, fold the finished ones into results
(``GroupConsumer.evaluate`` / ``eval_results``; the data is :mod:`rollstream.common.eval_lane`)."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollstream.common.cancellation import raise_if_cancelled
from rollstream.common.codec import decode_group_entry, prompt_fields
from rollstream.common.connection import Outage
from rollstream.common.datasets import RowFormat, open_dataset
from rollstream.common.errors import ConfigError
from rollstream.common.eval_lane import EvalResult, EvalSettings, eval_prompt, eval_row, summarize
from rollstream.common.events import now_ms
from rollstream.common.logs import Prefixed
from rollstream.common.models import Group
from rollstream.common.protocol import EvalLane

logger = logging.getLogger(__name__)


SUBMIT_CHUNK = 1000
"""Eval prompts written per script: what the trainer holds at once while it submits an eval."""


async def submit_eval(
    lane: EvalLane, outage: Outage, consumer: str, name: str, source: str | Path | Iterable[Any],
    n_samples: int, max_new_tokens: int | None, temperature: float | None = None, top_p: float | None = None,
    row_format: RowFormat | None = None,
) -> str:
    """Write the eval set's prompts to the eval lane and record it; its name.

    The set is streamed: read, encoded and written :data:`SUBMIT_CHUNK` prompts at a time (the
    reading and encoding in a worker thread), each chunk with the submission's progress in one
    script, so the trainer's memory does not grow with the set and its event loop is not held. A
    submission cut short (the trainer killed, the call cancelled, an outage) resumes when the same
    name is submitted again with the same set: the prompts already written are read and checked
    (a digest), not written again. A name whose submission finished is refused (``ConfigError``)."""
    settings = EvalSettings(name, n_samples, max_new_tokens, temperature, top_p)
    log = Prefixed(logger, "consumer", consumer)
    reader = _EvalReader(settings, source, row_format)
    chunk = await asyncio.to_thread(reader.read, 1)  # an empty or unreadable set records nothing
    if not chunk.count:
        raise ConfigError(f"eval {name!r} has no prompts")
    step = await outage.run(lane.trained_steps)
    meta = {**settings.as_metadata(), "submitting": True, "submitted_step": step, "submitted_ms": now_ms()}
    status, stored, progress = await outage.run(lambda: lane.begin(name, meta))
    if status == "taken":
        raise ConfigError(f"an eval named {name!r} was already submitted to namespace {lane.keys.namespace!r}")
    written, digest = _progress(progress)
    if status == "resume":
        _same_settings(settings, stored)
        meta = stored
        log.info("eval %s: resuming its submission after the %d prompts already written", name, written)
    before = progress
    while chunk.count:
        raise_if_cancelled()  # a cancellation the Redis client lost: the submission stops, resumable
        if reader.count <= written:  # written by the submission cut short: checked, not written again
            if reader.count == written and reader.digest() != digest:
                raise ConfigError(
                    f"eval {name!r} was partly submitted ({written} prompts) from another set: submit it under a "
                    "new name, or the same set again"
                )
        else:
            after = reader.progress()
            reply = await outage.run(functools.partial(lane.write, name, before, after, chunk.packed))
            if reply != "ok":
                raise ConfigError(f"eval {name!r} is being submitted by another caller (progress {reply!r})")
            before = after
        size = SUBMIT_CHUNK if reader.count >= written else min(SUBMIT_CHUNK, written - reader.count)
        raise_if_cancelled()
        chunk = await asyncio.to_thread(reader.read, size)
    if reader.count < written:
        raise ConfigError(f"eval {name!r} was partly submitted with {written} prompts, more than this set's "
                          f"{reader.count}: submit the same set again")
    final = {k: v for k, v in meta.items() if k != "submitting"} | {"prompts": reader.count}
    if not await outage.run(lambda: lane.finish(name, before, final)):
        raise ConfigError(f"eval {name!r} is being submitted by another caller")
    log.info("eval %s submitted (%d prompts x %d samples) at step %s", name, reader.count, n_samples,
             final.get("submitted_step"))
    return name


@dataclass(frozen=True, slots=True)
class _Chunk:
    count: int
    packed: bytes


class _EvalReader:
    """An eval set read a chunk at a time (in a worker thread): its prompt entries packed for the
    eval lane, and a running digest of them (what a resumed submission checks the prompts already
    written by)."""

    def __init__(
        self, settings: EvalSettings, source: str | Path | Iterable[Any], row_format: RowFormat | None = None
    ) -> None:
        self.settings = settings
        self.items: Iterator[Any] = (
            iter_eval_source(source, row_format) if isinstance(source, str | Path) else iter(source)
        )
        self.count = 0
        self._hash = hashlib.blake2b(digest_size=16)

    def read(self, size: int) -> _Chunk:
        out = []
        for item in itertools.islice(self.items, size):
            fields = prompt_fields(eval_prompt(self.settings, self.count, item))
            data = fields["data"]
            self._hash.update(data if isinstance(data, bytes) else str(data).encode())
            self.count += 1
            out.append(fields)
        return _Chunk(len(out), EvalLane.pack(self.settings.name, out) if out else b"")

    def digest(self) -> str:
        return self._hash.hexdigest()

    def progress(self) -> str:
        return f"{self.count}:{self.digest()}"


def _progress(progress: str) -> tuple[int, str]:
    written, _, digest = progress.partition(":")
    return (int(written) if written.isdigit() else 0), digest


def _same_settings(settings: EvalSettings, stored: dict[str, Any]) -> None:
    """A resumed submission must ask for what the first one did (``ConfigError`` otherwise)."""
    wanted = settings.as_metadata()
    fields = ("n_samples", "max_new_tokens", "temperature", "top_p")
    if any(wanted.get(k) != stored.get(k) for k in fields):
        raise ConfigError(
            f"eval {settings.name!r} was partly submitted with other settings "
            f"({ {k: stored.get(k) for k in fields} }): submit it with those, or under a new name"
        )


async def finished_evals(
    lane: EvalLane, outage: Outage, consumer: str, collected: dict[str, list[Group]] | None = None
) -> list[EvalResult]:
    """Every finished eval, oldest first. The groups of a running eval are folded into its rows as
    they come (``eval_rows``; archived and deleted in the same script, so ``eval_groups`` stays
    under the eval lane's bound while an eval larger than it runs); an eval whose prompts all came
    back is summarized from its rows now. ``collected``: the groups this process collected, by eval
    (the finishing call's result carries them)."""
    collected = collected if collected is not None else {}
    submitted = {
        name: meta for name, meta in (await outage.run(lane.submitted)).items()
        if "prompts" in meta or "result" in meta  # not one whose prompts are still being written
    }
    waiting = {name for name, meta in submitted.items() if "result" not in meta}
    found: dict[str, list[tuple[bytes, Group, int, int]]] = {}
    after = "-"
    while waiting and (rows := await outage.run(functools.partial(lane.groups, after))):
        for entry_id, fields in rows:
            eval_name = fields.get(b"eval", b"").decode("utf-8", "replace")
            if eval_name in waiting:
                step = fields.get(b"step", b"0")
                found.setdefault(eval_name, []).append(
                    (entry_id, decode_group_entry(fields), int(step) if step.isdigit() else 0,
                     len(fields.get(b"data", b"")))
                )
        after = rows[-1][0].decode()
    just_finished: dict[str, EvalResult] = {}
    for eval_name in sorted(waiting):
        meta = submitted[eval_name]
        got = found.get(eval_name, [])
        if got:
            held = await outage.run(functools.partial(
                lane.collect, eval_name, consumer, [eid for eid, _, _, _ in got],
                {g.index: eval_row(g, step) for _, g, step, _ in got}, sum(size for *_, size in got), now_ms(),
            ))
            collected.setdefault(eval_name, []).extend(g for _, g, _, _ in got)
        else:
            held = await outage.run(functools.partial(lane.held_rows, eval_name))
        if held < int(meta["prompts"]):
            continue
        rows_of = await outage.run(functools.partial(lane.rows, eval_name))
        result = summarize(
            eval_name, rows_of, submitted_step=int(meta.get("submitted_step", 0)),
            submitted_ms=int(meta.get("submitted_ms", 0)), finished_ms=now_ms(), groups=collected.pop(eval_name, []),
        )
        stored = {**meta, "result": result.as_json()}
        await outage.run(functools.partial(lane.store_result, eval_name, stored))
        submitted[eval_name] = stored
        just_finished[eval_name] = result
        Prefixed(logger, "consumer", consumer).info("eval %s finished: %s", eval_name, json.dumps(result.as_json()))
    finished = [
        just_finished.get(name) or EvalResult.from_json(meta["result"])
        for name, meta in submitted.items() if "result" in meta
    ]
    return sorted(finished, key=lambda r: r.submitted_ms)


EVAL_ROWS = RowFormat(metadata_key="metadata")
"""How an eval set's rows read by default: ``prompt``, optional ``label`` and ``metadata`` (an object)."""


def iter_eval_source(path: str | Path, row_format: RowFormat | None = None) -> Iterator[Any]:
    """The items of an eval set on disk, one at a time, read as the feeder reads a dataset
    (:func:`~rollstream.common.datasets.open_dataset`: JSONL or Parquet, a folder or glob of shards,
    ``path@[a:b]``, ``row_format``'s keys); ``ConfigError`` naming the first bad row."""
    for record in open_dataset(path, row_format or EVAL_ROWS).records():
        yield {"prompt": record.prompt, "label": record.label, "metadata": record.metadata}


def read_eval_source(path: str | Path, row_format: RowFormat | None = None) -> list[Any]:
    """The items of an eval set on disk (see :func:`iter_eval_source`)."""
    return list(iter_eval_source(path, row_format))
