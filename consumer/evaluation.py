"""The eval lane, the trainer's side: submit an eval set, fold the finished ones into results
(``GroupConsumer.evaluate`` / ``eval_results``; the data is :mod:`rollstream.common.eval_lane`)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rollstream.common.codec import decode_group_entry
from rollstream.common.connection import Outage
from rollstream.common.errors import ConfigError
from rollstream.common.eval_lane import EvalResult, EvalSettings, eval_prompts, summarize
from rollstream.common.events import now_ms
from rollstream.common.logs import Prefixed
from rollstream.common.models import Group
from rollstream.common.protocol import EvalLane

logger = logging.getLogger(__name__)


async def submit_eval(
    lane: EvalLane, outage: Outage, consumer: str, name: str, source: str | Path | Iterable[Any],
    n_samples: int, max_new_tokens: int | None, temperature: float | None = None, top_p: float | None = None,
) -> str:
    """Write the eval set's prompts to the eval lane and record it; its name."""
    settings = EvalSettings(name, n_samples, max_new_tokens, temperature, top_p)
    items = await asyncio.to_thread(read_eval_source, source) if isinstance(source, str | Path) else source
    prompts = eval_prompts(settings, items)
    step = await outage.run(lane.trained_steps)
    meta = {**settings.as_metadata(), "prompts": len(prompts), "submitted_step": step, "submitted_ms": now_ms()}
    if not await outage.run(lambda: lane.submit(name, meta, prompts)):
        raise ConfigError(f"an eval named {name!r} was already submitted to namespace {lane.keys.namespace!r}")
    Prefixed(logger, "consumer", consumer).info(
        "eval %s submitted (%d prompts x %d samples) at step %d", name, len(prompts), n_samples, step
    )
    return name


async def _collect(
    lane: EvalLane, outage: Outage, name: str, stored: dict[str, Any], consumer: str, ids: list[bytes]
) -> None:
    await outage.run(lambda: lane.collect(name, stored, consumer, ids, now_ms()))


async def finished_evals(lane: EvalLane, outage: Outage, consumer: str) -> list[EvalResult]:
    """Every finished eval, oldest first; an eval whose prompts all came back is summarized now,
    its groups archived and deleted (one script)."""
    submitted = await outage.run(lane.submitted)
    waiting = {name for name, meta in submitted.items() if "result" not in meta}
    found: dict[str, list[tuple[bytes, Group, int]]] = {}
    after = "-"
    while waiting and (rows := await outage.run(functools.partial(lane.groups, after))):
        for entry_id, fields in rows:
            eval_name = fields.get(b"eval", b"").decode("utf-8", "replace")
            if eval_name in waiting:
                step = fields.get(b"step", b"0")
                found.setdefault(eval_name, []).append(
                    (entry_id, decode_group_entry(fields), int(step) if step.isdigit() else 0)
                )
        after = rows[-1][0].decode()
    just_finished: dict[str, EvalResult] = {}
    for eval_name, got in found.items():
        meta = submitted[eval_name]
        if len({g.index for _, g, _ in got}) < int(meta["prompts"]):
            continue
        result = summarize(
            eval_name, [(g, step) for _, g, step in got], submitted_step=int(meta.get("submitted_step", 0)),
            submitted_ms=int(meta.get("submitted_ms", 0)), finished_ms=now_ms(),
        )
        stored = {**meta, "result": result.as_json()}
        ids = [eid for eid, _, _ in got]
        await _collect(lane, outage, eval_name, stored, consumer, ids)
        submitted[eval_name] = stored
        just_finished[eval_name] = result
        Prefixed(logger, "consumer", consumer).info("eval %s finished: %s", eval_name, json.dumps(result.as_json()))
    finished = [
        just_finished.get(name) or EvalResult.from_json(meta["result"])
        for name, meta in submitted.items() if "result" in meta
    ]
    return sorted(finished, key=lambda r: r.submitted_ms)


def read_eval_source(path: str | Path) -> list[Any]:
    """The records of a JSONL eval set (``ConfigError`` naming the first bad line)."""
    items = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                items.append(json.loads(line))
            except ValueError as exc:
                raise ConfigError(f"{path}:{number}: not JSON: {exc}") from None
    return items
