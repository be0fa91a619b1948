"""The feeder: a JSONL dataset into the prompt stream, epoch after epoch, within a window.

At most ``window`` prompts are queued (``XLEN prompts``, in-flight ones included). Every prompt
gets a global increasing ``index`` and its ``epoch``. The XADDs and the cursor (next index,
epoch, position in the epoch's order) move together in one Lua script that first checks the
cursor it started from, so a restarted feeder resumes exactly where it stopped and a re-sent
call after a dropped connection adds nothing twice. Shuffling is a seeded permutation per
epoch, so the order survives restarts too.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from rollstream.common.codec import prompt_fields
from rollstream.common.connection import Outage, connect
from rollstream.common.errors import ConfigError
from rollstream.common.keys import Keys
from rollstream.common.models import Prompt, as_prompt_content, multimodal_of
from rollstream.common.namespace import load_config
from rollstream.common.protocol import Feed
from rollstream.common.watchdog import LoopWatchdog, default_stall_after

logger = logging.getLogger(__name__)

MAX_LINE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Record:
    prompt: Any
    label: Any
    metadata: dict[str, Any]


_SLICE = re.compile(r"^(?P<path>.*)@\[(?P<start>-?\d*):(?P<stop>-?\d*)\]$")


def split_row_slice(path: str | Path) -> tuple[str, slice | None]:
    """slime's and miles' ``--prompt-data path@[start:stop]``: the path and the row slice."""
    match = _SLICE.match(str(path))
    if match is None:
        return str(path), None
    start, stop = match.group("start"), match.group("stop")
    return match.group("path"), slice(int(start) if start else None, int(stop) if stop else None)


def load_jsonl(
    path: str | Path,
    prompt_key: str = "prompt",
    label_key: str | None = "label",
    *,
    metadata_key: str | None = None,
    tool_key: str | None = None,
    as_chat: bool = False,
) -> list[Record]:
    """Read and validate a JSONL dataset; ConfigError names the first bad line.

    By default a record's metadata is every other field. With ``metadata_key`` it is that field's
    object (missing or null: empty), plus ``tools`` from ``tool_key`` (a list, or a JSON string of
    one), and ``as_chat`` makes a text prompt one user message: what slime's and miles' ``Dataset``
    build from ``--metadata-key``, ``--tool-key`` and ``--apply-chat-template`` (the chat template
    itself is rendered by the producer's ``--tokenizer``). ``label_key=None``: no label, as there.
    A ``path@[start:stop]`` keeps those rows, as their ``--prompt-data`` does.
    """
    real_path, rows = split_row_slice(path)
    if real_path.endswith(".parquet"):
        raise ConfigError(f"{real_path}: only JSONL datasets can be fed (convert the parquet file to JSONL)")
    records = []
    with open(real_path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            if len(line) > MAX_LINE_BYTES:
                raise ConfigError(f"{real_path}:{number}: line longer than {MAX_LINE_BYTES} bytes")
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{real_path}:{number}: not JSON: {exc}") from None
            if not isinstance(obj, dict) or prompt_key not in obj:
                raise ConfigError(f"{real_path}:{number}: expected an object with a {prompt_key!r} field")
            raw_prompt = obj[prompt_key]
            if as_chat and isinstance(raw_prompt, str):
                raw_prompt = [{"role": "user", "content": raw_prompt}]
            try:
                prompt = as_prompt_content(raw_prompt)
            except ValueError as exc:
                raise ConfigError(f"{real_path}:{number}: {exc}") from None
            label = obj.get(label_key) if label_key is not None else None
            if metadata_key is None:
                metadata = {k: v for k, v in obj.items() if k not in (prompt_key, label_key)}
            else:
                metadata = _record_metadata(obj, metadata_key, tool_key, f"{real_path}:{number}")
            records.append(Record(prompt, label, metadata))
    if rows is not None:
        records = records[rows]
    if not records:
        raise ConfigError(f"{path}: no records")
    return records


def _record_metadata(obj: dict[str, Any], metadata_key: str, tool_key: str | None, where: str) -> dict[str, Any]:
    metadata = obj.get(metadata_key) or {}
    if not isinstance(metadata, dict):
        raise ConfigError(f"{where}: field {metadata_key!r} must be an object, got {type(metadata).__name__}")
    metadata = dict(metadata)
    if tool_key is not None and tool_key in obj:
        tools = obj[tool_key]
        if isinstance(tools, str):
            try:
                tools = json.loads(tools)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{where}: field {tool_key!r} is a string but not JSON: {exc}") from None
        if not isinstance(tools, list):
            raise ConfigError(f"{where}: field {tool_key!r} must be a list of tools, got {type(tools).__name__}")
        metadata["tools"] = tools
    return metadata


SHUFFLE_SCHEMES = ("rollstream", "slime")


@dataclass(frozen=True, slots=True)
class FeedSettings:
    namespace: str
    epochs: int | None = 1
    """None feeds forever."""
    shuffle: bool = False
    seed: int = 0
    window: int = 256
    poll_interval: float = 0.1
    chunk: int = 128
    shuffle_scheme: str = "rollstream"
    """``rollstream``: a permutation seeded by ``"{seed}:{epoch}"``; ``slime``: the one slime's and
    miles' ``Dataset.shuffle`` makes (``random.seed(seed + epoch)``), so a run switched to
    rollstream sees its prompts in the order it saw them before."""

    def __post_init__(self) -> None:
        if self.epochs is not None and (isinstance(self.epochs, bool) or self.epochs < 1):
            raise ConfigError("epochs must be at least 1 (or None to feed forever)")
        if self.window < 1:
            raise ConfigError("window must be at least 1")
        if self.chunk < 1 or self.poll_interval <= 0:
            raise ConfigError("chunk and poll_interval must be positive")
        if self.shuffle_scheme not in SHUFFLE_SCHEMES:
            raise ConfigError(
                f"shuffle scheme must be one of {', '.join(SHUFFLE_SCHEMES)}, got {self.shuffle_scheme!r}"
            )


def dataset_id(records: list[Record], settings: FeedSettings) -> str:
    digest = hashlib.sha1(usedforsecurity=False)
    for record in records:
        digest.update(json.dumps([record.prompt, record.label], sort_keys=True, default=str).encode())
    order = "o"
    if settings.shuffle:
        order = ("s" if settings.shuffle_scheme == "rollstream" else "slime") + str(settings.seed)
    return f"{digest.hexdigest()[:12]}:{len(records)}:{order}"


class Feeder:
    """Feeds ``records`` into a namespace; ``await feeder.run()`` returns when the epochs are done."""

    def __init__(self, redis: Redis, records: list[Record], settings: FeedSettings) -> None:
        self.redis = redis
        self.records = records
        self.settings = settings
        self.keys = Keys(settings.namespace)
        self.feed = Feed(redis, self.keys)
        self.dataset = dataset_id(records, settings)
        self.fed = 0
        self._outage = Outage(logger, f"feeder (ns {settings.namespace})")
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.records)))
        if self.settings.shuffle and self.settings.shuffle_scheme == "slime":
            random.Random(self.settings.seed + epoch).shuffle(order)  # = random.seed(seed + epoch); shuffle
        elif self.settings.shuffle:
            random.Random(f"{self.settings.seed}:{epoch}").shuffle(order)
        return order

    def _walk(self, epoch: int, position: int) -> Iterator[tuple[int, int, int]]:
        """(epoch, position after, record index) from a cursor onwards."""
        while self.settings.epochs is None or epoch < self.settings.epochs:
            order = self._order(epoch)
            for pos in range(position, len(order)):
                yield epoch, pos + 1, order[pos]
            epoch, position = epoch + 1, 0

    async def _cursor(self) -> tuple[int, int, int]:
        cursor = await self._outage.run(self.feed.cursor)
        next_index, epoch, position, fed_dataset = cursor.next_index, cursor.epoch, cursor.position, cursor.dataset
        if fed_dataset is not None and fed_dataset != self.dataset:
            raise ConfigError(
                f"namespace {self.keys.namespace!r} was fed from another dataset or order ({fed_dataset}, "
                f"this one is {self.dataset}); use a new namespace to feed a different dataset"
            )
        if fed_dataset is not None and position >= len(self.records):
            epoch, position = epoch + 1, 0
        return next_index, epoch, position

    async def run(self) -> int:
        """Feed until the epochs are done (or :meth:`stop`); returns the prompts fed by this call.
        A loop-lag watchdog runs meanwhile (a stall is logged with the code that held the loop)."""
        config = await load_config(self.redis, self.keys)
        watchdog = LoopWatchdog(
            f"feeder (ns {self.keys.namespace})", default_stall_after(config.lease_seconds), logger
        )
        watching = asyncio.create_task(watchdog.run(), name="watchdog")
        try:
            return await self._feed()
        finally:
            watching.cancel()
            await asyncio.wait([watching], timeout=5)

    async def _feed(self) -> int:
        next_index, epoch, position = await self._cursor()
        logger.info(
            "feeder (ns %s): starting at index %d, epoch %d, position %d of %d (window %d)",
            self.keys.namespace, next_index, epoch, position, len(self.records), self.settings.window,
        )
        walk = self._walk(epoch, position)
        pending: list[tuple[int, int, int]] = []
        while not self._stop.is_set():
            queued = await self._outage.run(self.feed.queued)
            room = min(self.settings.window - queued, self.settings.chunk)
            if room <= 0:
                await self._sleep()
                continue
            while len(pending) < room:
                item = next(walk, None)
                if item is None:
                    break
                pending.append(item)
            if not pending:
                break
            chunk = pending[:room]
            entries = []
            for offset, (ep, _, record_index) in enumerate(chunk):
                record = self.records[record_index]
                prompt = Prompt(
                    index=next_index + offset, prompt=record.prompt, label=record.label, epoch=ep,
                    metadata={**record.metadata, "dataset_index": record_index},
                    multimodal_inputs=multimodal_of(record.prompt, record.metadata.get("images")),
                )
                entries.append(prompt_fields(prompt))
            last_epoch, last_position, _ = chunk[-1]
            added = await self._outage.run(
                lambda e=entries, le=last_epoch, lp=last_position, ni=next_index: self.feed.add(
                    expected_next=ni, next_after=ni + len(e), epoch=le, position=lp,
                    dataset=self.dataset, entries=e,
                )
            )
            if added is None:
                # The cursor moved under us: a re-sent call that had gone through, or another feeder.
                logger.warning("feeder (ns %s): cursor moved concurrently; re-reading it", self.keys.namespace)
                next_index, epoch, position = await self._cursor()
                walk = self._walk(epoch, position)
                pending = []
                continue
            next_index += added
            self.fed += added
            pending = pending[room:]
        logger.info("feeder (ns %s): fed %d prompts; next index %d", self.keys.namespace, self.fed, next_index)
        return self.fed

    async def _sleep(self) -> None:
        try:
            async with asyncio.timeout(self.settings.poll_interval):
                await self._stop.wait()
        except TimeoutError:
            pass


async def feed(
    url: str,
    path: str | Path,
    settings: FeedSettings,
    *,
    prompt_key: str = "prompt",
    label_key: str | None = "label",
) -> int:
    """Library entry point: feed a JSONL file into a namespace; returns the prompts fed."""
    records = load_jsonl(path, prompt_key, label_key)
    redis = connect(url, name="rollstream-feeder")
    try:
        return await Feeder(redis, records, settings).run()
    finally:
        await redis.aclose()
