"""A client opens at most ``MAX_CONNECTIONS`` connections to Redis, and more commands at once than
that still all complete (they wait for a free connection): a producer with hundreds of episodes
in flight opened one connection per command in flight (65 at 256, ~220 at 1024), and a few dozen
such producers would have reached Redis' ``maxclients``."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis
from rollstream.common.connection import MAX_CONNECTIONS, connect


async def test_commands_beyond_the_bound_wait_for_a_connection_and_all_complete(redis_url: str, redis: Redis) -> None:
    name = "rollstream-pool-test"
    client = connect(redis_url, name=name)
    commands = 3 * MAX_CONNECTIONS
    try:
        # each BLPOP holds its connection for 0.2 s: all of them are in flight at once
        results = await asyncio.gather(*(client.blpop([f"pool-test-{i}"], timeout=0.2) for i in range(commands)))
        assert results == [None] * commands
        opened = [c for c in await redis.client_list() if c.get("name") == name]
        assert len(opened) == MAX_CONNECTIONS, f"{len(opened)} connections for {commands} commands at once"
    finally:
        await client.aclose()
