"""The eval lane of one namespace: submitted eval sets (``evals`` hash), their prompts
(``eval_prompts``, admitted before training prompts) and finished groups (``eval_groups``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis

from .. import lua
from ..codec import prompt_fields
from ..keys import Keys, StateField
from ..models import Prompt
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

    async def trained_steps(self) -> int:
        raw = await self.redis.hget(self.keys.state, StateField.TRAINED_STEPS)
        return int(raw) if raw is not None and raw.isdigit() else 0

    async def submit(self, name: str, meta: dict[str, Any], prompts: Sequence[Prompt]) -> bool:
        """Record the eval (False when the name is taken) and add its prompts to the eval lane, each
        with a plain ``eval`` field (its name: the key space of its episode journal)."""
        if not await self.redis.hsetnx(self.keys.evals, name, json.dumps(meta)):
            return False
        async with self.redis.pipeline(transaction=False) as pipe:
            for prompt in prompts:
                pipe.xadd(self.keys.eval_prompts, {**prompt_fields(prompt), "eval": name})
            await pipe.execute()
        await self.redis.publish(self.keys.control, EVAL_MESSAGE)  # producers napping on a full backlog wake
        return True

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

    async def collect(self, name: str, result: dict[str, Any], actor: str, ids: Sequence[bytes], now: int) -> int:
        """Archive and delete a finished eval's groups, and store its result, in one script."""
        return int(await self._eval_collect(name=name, result=json.dumps(result), actor=actor, now_ms=now, ids=ids))
