"""``rollstream archive view DIR``: one static HTML page to look at an archive's groups.

The page needs no server (it opens from a file) and loads nothing from the network: the records
are embedded as JSON, and a few lines of JavaScript filter the table (fate, source, reward,
version) and open a group (every sample's prompt and response, its turns by loss mask: model
tokens trained, tool or observation tokens not, the reward, versions, the history of earlier
attempts). Text is put on the page with ``textContent`` only, so a response cannot inject markup.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

from rollstream.common.archive_schema import read_table

MAX_TOKENS_SHOWN = 4096
"""Response token ids per sample kept on the page (the counts are always exact)."""

_COLUMNS = (
    "archive_id", "fate", "reason", "actor", "step", "trainer_version", "ts_ms", "index", "attempt", "source",
    "status", "reward_mean", "min_version", "max_version", "prompt", "prompt_is_chat", "label", "history",
    "samples", "decode_error", "producer",
)


def _turns(mask: list[int] | None, ids: list[int]) -> list[dict[str, Any]]:
    """Runs of equal loss mask over the response: model turns (1) and tool / observation turns (0)."""
    if mask is None:
        return [{"trained": 1, "n": len(ids), "ids": ids[:MAX_TOKENS_SHOWN]}]
    runs: list[dict[str, Any]] = []
    for position, value in enumerate(mask):
        if not runs or runs[-1]["trained"] != value:
            runs.append({"trained": int(value), "n": 0, "ids": []})
        runs[-1]["n"] += 1
        if position < MAX_TOKENS_SHOWN and position < len(ids):
            runs[-1]["ids"].append(ids[position])
    return runs


def _number(value: Any) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def page_records(root: str | Path, limit: int) -> list[dict[str, Any]]:
    """The newest ``limit`` records of the archive, shaped for the page."""
    rows = read_table(root, _COLUMNS).to_pylist()[-limit:] if limit > 0 else []
    out = []
    for row in rows:
        samples = []
        for s in row["samples"] or []:
            prompt_length = max(0, s["prompt_length"] or 0)
            response_ids = (s["tokens"] or [])[prompt_length:]
            samples.append({
                "response": s["response"], "reward": _number(s["reward"]), "reward_json": s["reward_json"],
                "status": s["status"], "finish_reason": s["finish_reason"], "error": s["error"],
                "versions": s["weight_versions"] or [], "response_length": s["response_length"],
                "turns": _turns(s["loss_mask"], response_ids),
            })
        prompt = row["prompt"]
        if row["prompt_is_chat"] and prompt:
            try:
                prompt = json.loads(prompt)
            except ValueError:
                pass
        out.append({
            "id": row["archive_id"], "fate": row["fate"], "reason": row["reason"], "actor": row["actor"],
            "step": row["step"], "trainer_version": row["trainer_version"], "ts_ms": row["ts_ms"],
            "index": row["index"], "attempt": row["attempt"], "source": row["source"] or "",
            "status": row["status"], "reward": _number(row["reward_mean"]), "min_version": row["min_version"],
            "max_version": row["max_version"], "prompt": prompt, "label": row["label"],
            "history": row["history"] or [], "producer": row["producer"], "decode_error": row["decode_error"],
            "samples": samples,
        })
    return out


def render(records: list[dict[str, Any]], title: str) -> str:
    """The page (``archive_view.html`` beside this module) with the records embedded as JSON."""
    data = json.dumps(records, ensure_ascii=False, allow_nan=False).replace("</", "<\\/")
    page = (Path(__file__).with_name("archive_view.html")).read_text(encoding="utf-8")
    return page.replace("__TITLE__", html.escape(title)).replace("__DATA__", data)


def write_page(root: Path, out: Path, limit: int = 5000) -> int:
    """Write the page of the archive ``root`` to ``out``; the number of groups on it."""
    records = page_records(root, limit)
    out.write_text(render(records, f"rollstream archive: {root.resolve().name}"), encoding="utf-8")
    return len(records)
