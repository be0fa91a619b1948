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
import re
from pathlib import Path
from typing import Any

from rollstream.common.archive_schema import one_namespace, read_part, scan_parts
from rollstream.common.errors import ArchiveUnusable

MAX_TOKENS_SHOWN = 256
"""Response token ids per sample kept on the page (the counts are always exact)."""
MAX_TEXT_SHOWN = 2000
"""Characters of a prompt, response, reward or error kept on the page (the archive has them whole)."""

_COLUMNS = (
    "archive_id", "fate", "reason", "actor", "step", "trainer_version", "ts_ms", "index", "attempt", "source",
    "status", "reward_mean", "min_version", "max_version", "prompt", "prompt_is_chat", "label", "history",
    "samples", "decode_error", "producer",
)
_SLOTS = re.compile(r"__(TITLE|DATA)__")
_JSON_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"})


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
    """A number JSON can carry: NaN and infinities become null (``_number_text`` says which)."""
    return None if value is None or (isinstance(value, float) and not math.isfinite(value)) else value


def _number_text(value: Any) -> str | None:
    return str(value) if isinstance(value, float) and not math.isfinite(value) else None


NOT_READ = "(the text was in the payload store and could not be read when archived: see decode_error)"
"""What the page shows for a sample whose row has no text (its objects were not read)."""


def clip(text: str | None, limit: int = MAX_TEXT_SHOWN) -> str | None:
    """``text`` cut to ``limit`` characters, saying how many more the archive holds."""
    if text is None or len(text) <= limit:
        return text
    return f"{text[:limit]} [... {len(text) - limit:,} more characters, in the archive]"


def _prompt(row: dict[str, Any]) -> Any:
    prompt = row["prompt"]
    if row["prompt_is_chat"] and prompt:
        try:
            messages = json.loads(prompt)
        except ValueError:
            return clip(prompt)
        if isinstance(messages, list):
            return [_message(m) for m in messages]
        return clip(prompt)
    return clip(prompt)


def _message(message: Any) -> Any:
    """A chat message with its content clipped (a non-text content as its JSON)."""
    if not isinstance(message, dict):
        return clip(json.dumps(message))
    content = message.get("content")
    return {**message, "content": clip(content if isinstance(content, str) else json.dumps(content))}


def page_record(row: dict[str, Any]) -> dict[str, Any]:
    """One archive row shaped for the page: long text clipped, non-finite numbers as text."""
    samples = []
    for s in row["samples"] or []:
        prompt_length = max(0, s["prompt_length"] or 0)
        response_ids = (s["tokens"] or [])[prompt_length:]
        samples.append({
            "response": NOT_READ if s["response"] is None else clip(s["response"]),
            "reward": _number(s["reward"]), "reward_text": _number_text(s["reward"]),
            "reward_json": clip(s["reward_json"]), "status": s["status"], "finish_reason": s["finish_reason"],
            "error": clip(s["error"]), "versions": s["weight_versions"] or [], "response_length": s["response_length"],
            "turns": _turns(s["loss_mask"], response_ids),
        })
    return {
        "id": row["archive_id"], "fate": row["fate"], "reason": clip(row["reason"]), "actor": row["actor"],
        "step": row["step"], "trainer_version": row["trainer_version"], "ts_ms": row["ts_ms"],
        "index": row["index"], "attempt": row["attempt"], "source": row["source"] or "",
        "status": row["status"], "reward": _number(row["reward_mean"]), "reward_text": _number_text(row["reward_mean"]),
        "min_version": row["min_version"], "max_version": row["max_version"], "prompt": _prompt(row),
        "label": clip(row["label"]), "history": [clip(h) for h in row["history"] or []], "producer": row["producer"],
        "decode_error": clip(row["decode_error"]), "samples": samples,
    }


def page_records(root: str | Path, limit: int) -> list[dict[str, Any]]:
    """The newest ``limit`` records of the archive, shaped for the page. Only the files that hold
    them are read (row counts come from the footers), only the page's columns, a slice at a time."""
    if limit <= 0:
        return []
    parts = scan_parts(root)
    one_namespace(parts, root)
    chosen = []
    need = limit
    for part in reversed(parts):
        if need <= 0:
            break
        take = min(need, part.rows)
        chosen.append((part, part.rows - take))
        need -= take
    out: list[dict[str, Any]] = []
    for part, skip in reversed(chosen):
        table = read_part(part.path, _COLUMNS, rows=slice(skip, None))
        for batch in table.to_batches(max_chunksize=64):
            out.extend(page_record(row) for row in batch.to_pylist())
        del table
    return out


def render(records: list[dict[str, Any]], title: str) -> str:
    """The page (``archive_view.html`` beside this module) with the records embedded as JSON.

    One pass puts in the title and the data, so neither can bring a slot name into the other, and
    the JSON has ``<``, ``>`` and ``&`` as escapes: no text of a record can close or comment out
    its ``<script>`` block."""
    data = json.dumps(records, ensure_ascii=False, allow_nan=False).translate(_JSON_ESCAPES)
    values = {"TITLE": html.escape(title), "DATA": data}
    page = (Path(__file__).with_name("archive_view.html")).read_text(encoding="utf-8")
    return _SLOTS.sub(lambda match: values[match.group(1)], page)


def write_page(root: Path, out: Path, limit: int = 5000) -> int:
    """Write the page of the archive ``root`` to ``out``; the number of groups on it."""
    if not out.parent.is_dir():
        raise ArchiveUnusable(
            f"{out}: its folder {out.parent} does not exist: create it (mkdir -p {out.parent}) or give --html a path "
            "in an existing folder"
        )
    records = page_records(root, limit)
    text = render(records, f"rollstream archive: {root.resolve().name}")
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ArchiveUnusable(f"{out}: the page could not be written ({exc.strerror or exc}): give --html a "
                              "writable path with room for it") from exc
    return len(records)
