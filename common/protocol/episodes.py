"""Episode journals (durable episodes): one hash per prompt, read whole when a producer takes the
prompt over, appended one step at a time under the prompt attempt's lease (JOURNAL_APPEND)."""

from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from .. import lua
from ..keys import Keys, StateField
from .guard import Guarded, Server


class EpisodeJournals(Guarded):
    """One producer's reads and appends of its prompts' episode journals."""

    def __init__(self, redis: Redis, keys: Keys, consumer: str) -> None:
        self.redis = redis
        self.keys = keys
        self.consumer = consumer
        self._journal_append = lua.JOURNAL_APPEND.bind(redis, keys)
        self._sweep = lua.SWEEP_JOURNALS.bind(redis, keys)

    async def load(self, index: int, epoch: int, eval_name: str | None = None) -> dict[int, list[bytes]]:
        """Member -> its journaled steps in order (a gap ends a member's steps); {} when none.
        ``eval_name``: an eval-lane prompt's (:meth:`Keys.episode`)."""
        raw = await self.redis.hgetall(self.keys.episode(index, epoch, eval_name))
        steps: dict[int, dict[int, bytes]] = {}
        for name, value in raw.items():
            member, sep, seq = name.decode("ascii", "replace").partition(":")
            if sep and member.isdigit() and seq.isdigit():
                steps.setdefault(int(member), {})[int(seq)] = value
        out: dict[int, list[bytes]] = {}
        for member, by_seq in steps.items():
            ordered: list[bytes] = []
            while len(ordered) in by_seq:
                ordered.append(by_seq[len(ordered)])
            out[member] = ordered
        return out

    async def append(
        self, *, stream: str, entry_id: bytes, index: int, epoch: int, member: int, seq: int, budget: int,
        step: bytes, eval_name: str | None = None, objects: str = "",
    ) -> str:
        """Journal step ``seq`` of ``member`` while this producer holds the entry: 'ok', 'lost', 'full'.
        ``objects``: 'key:bytes' when ``step`` is a reference to a payload store object (claimed
        when written, released otherwise)."""
        journal = self.keys.episode(index, epoch, eval_name)
        appended = await self._journal_append(
            source=stream, consumer=self.consumer, entry_id=entry_id, journal=journal, member=member, seq=seq,
            budget=budget, step=step, objects=objects,
        )
        return lua.status(appended)

    async def sweep(self, count: int) -> int:
        """One bounded step of the orphan-journal sweep: SCAN ``count`` keys on from the cursor
        kept in the state hash, delete the journals whose prompt is in no prompt stream (an eval
        lane's: not in ``eval_prompts``) (SWEEP_JOURNALS); how many went."""
        raw = await self.redis.hget(self.keys.state, StateField.JOURNAL_SWEEP_CURSOR)
        cursor = int(raw) if raw is not None and raw.isdigit() else 0
        # in a Cluster the namespace's keys share one slot: SCAN that slot's node alone
        node = {"target_nodes": self.redis.get_node_from_key(self.keys.state)} if isinstance(
            self.redis, RedisCluster) else {}
        cursor, found = await self.redis.scan(cursor, match=self.keys.episode_pattern, count=count, **node)
        if isinstance(cursor, dict):  # a Cluster answers {node name: cursor}
            cursor = next(iter(cursor.values()))
        swept = int(await self._sweep(journals=found)) if found else 0
        await self.redis.hset(self.keys.state, StateField.JOURNAL_SWEEP_CURSOR, int(cursor))
        return swept

    async def count_diverged(self) -> None:
        await self.redis.hincrby(self.keys.state, StateField.RESUME_DIVERGED, 1)

    async def count(self) -> int:
        """How many episode journals the namespace holds (a SCAN: for inspect, not hot paths)."""
        return len(await Server(self.redis).scan(self.keys.episode_pattern))
