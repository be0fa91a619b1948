"""The eval lane of one namespace: submitted eval sets (``evals`` hash), their prompts
(``eval_prompts``, admitted before training prompts) and finished groups (``eval_groups``)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
from redis.asyncio import Redis

from .. import lua
from ..keys import Keys, StateField
from .guard import Entry, Guarded, flat_entries

EVAL_MESSAGE = "eval"
"""The control message of a submitted eval: producers refused for a full backlog run ADMIT at once
(the eval lane is read before the backlog is checked)."""


class EvalLane(Guarded):
    """Submit an eval set, read its finished groups, store its result."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._eval_collect = lua.EVAL_COLLECT.bind(redis, keys)
        self._eval_begin = lua.EVAL_BEGIN.bind(redis, keys)
        self._eval_chunk = lua.EVAL_CHUNK.bind(redis, keys)
        self._eval_submitted = lua.EVAL_SUBMITTED.bind(redis, keys)

    async def trained_steps(self) -> int:
        raw = await self.redis.hget(self.keys.state, StateField.TRAINED_STEPS)
        return int(raw) if raw is not None and raw.isdigit() else 0

    async def begin(self, name: str, meta: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
        """Record a submission (``meta``: no ``prompts`` yet) unless its name is taken: ('new',
        meta, progress), ('resume', its meta, progress) while an earlier submission of the name is
        still writing prompts, or ('taken', its meta, '')."""
        reply = await self._eval_begin(name=name, meta=json.dumps(meta))
        status = lua.status(reply[0])
        try:
            stored = json.loads(reply[1])
        except ValueError:
            stored = {}
        progress = lua.status(reply[2]) if len(reply) > 2 else ""
        return status, stored if isinstance(stored, dict) else {}, progress

    @staticmethod
    def pack(name: str, prompts: Sequence[Mapping[str, Any]]) -> bytes:
        """A chunk of prompt entries as :meth:`write` sends it (pure: a worker thread may run it),
        each with a plain ``eval`` field: its name, the key space of its episode journal."""
        entries = [lua.flatten({**fields, "eval": name}) for fields in prompts]  # str, bytes and int values
        packed: bytes = msgpack.packb(entries, use_bin_type=False)  # the old raw types: Lua's cmsgpack reads them
        return packed

    async def write(self, name: str, before: str, after: str, chunk: bytes) -> str:
        """Add a chunk of prompt entries (:meth:`pack`) and move the progress from ``before`` to
        ``after``, in one script: 'ok', else the progress found (another caller moved it; nothing
        written)."""
        reply = lua.status(await self._eval_chunk(name=name, before=before, after=after, entries=chunk))
        if reply == "ok":
            await self.redis.publish(self.keys.control, EVAL_MESSAGE)  # producers napping on a full backlog wake
        return reply

    async def finish(self, name: str, progress: str, meta: dict[str, Any]) -> bool:
        """Store the complete submission (``meta`` with ``prompts``) if the progress is still
        ``progress``; False when another caller moved it."""
        return lua.status(await self._eval_submitted(name=name, progress=progress, meta=json.dumps(meta))) == "ok"

    async def submitted(self) -> dict[str, dict[str, Any]]:
        """Every eval of the namespace: its submission, with ``result`` once finished."""
        out = {}
        for name, raw in (await self.redis.hgetall(self.keys.evals)).items():
            try:
                value = json.loads(raw)
            except ValueError:
                continue
            if isinstance(value, dict):
                out[name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)] = value
        return out

    async def groups(self, after: str = "-", count: int = 1000) -> list[Entry]:
        """Finished eval groups in arrival order, after ``after`` (exclusive unless ``-``)."""
        start = after if after == "-" else f"({after}"
        return flat_entries(await self.redis.xrange(self.keys.eval_groups, min=start, count=count))

    async def collect(
        self, name: str, actor: str, ids: Sequence[bytes], rows: Mapping[int, str], freed: int, now: int
    ) -> int:
        """Fold a running eval's groups (entries ``ids`` of ``eval_groups``, ``freed`` bytes of
        data) into its rows (prompt index -> compact row JSON), archive and delete them, in one
        script; how many rows the eval now holds."""
        return int(await self._eval_collect(
            rows=self.keys.eval_rows(name), name=name, actor=actor, now_ms=now, freed=freed,
            rows_json=json.dumps({str(index): row for index, row in rows.items()}), ids=ids,
        ))

    async def held_rows(self, name: str) -> int:
        """How many rows a running eval holds (prompts whose groups were collected)."""
        return int(await self.redis.hlen(self.keys.eval_rows(name)))

    async def rows(self, name: str) -> dict[int, str]:
        """A running eval's rows, read a page at a time (HSCAN)."""
        out: dict[int, str] = {}
        async for field, value in self.redis.hscan_iter(self.keys.eval_rows(name), count=1000):
            key = field.decode() if isinstance(field, bytes) else str(field)
            if key.isdigit():
                out[int(key)] = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
        return out

    async def store_result(self, name: str, result: dict[str, Any]) -> None:
        """Store a finished eval's result and drop its rows, in one transaction."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.evals, name, json.dumps(result))
            pipe.delete(self.keys.eval_rows(name))
            await pipe.execute()
