"""A reply that reaches the socket while the process's event loop stands still (user code blocking
it) is read when the loop runs again, never timed out and sent again (issue 43, finding 9).

redis-py timed its socket timeout on the loop: a command in flight across a stall longer than
the timeout was timed out although Redis had answered, and its retry ran the script a second
time. An ADMIT run twice left the first run's prompts pending under the producer but never
worked on or renewed: another producer took them over after the lease. Here the window is
forced: the ADMIT is held in Redis by ``CLIENT PAUSE WRITE`` until the loop has stopped, released
during the stall, and the loop stands still until well past the (shortened) socket timeout.
Real Redis, the real ADMIT script."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis as sync_redis
from conftest import make_namespace, wait_until
from redis.asyncio import Redis
from redis.exceptions import TimeoutError as RedisTimeoutError
from rollstream.common import lua
from rollstream.common.codec import prompt_fields
from rollstream.common.connection import connect
from rollstream.common.keys import PRODUCERS_GROUP, Keys, StateField
from rollstream.common.models import Prompt
from rollstream.common.protocol import PromptQueue

SOCKET_TIMEOUT = 0.5
"""The client's socket timeout here (10 s in production): the stall outlasts it."""
STALL = 4 * SOCKET_TIMEOUT
NAME = "rollstream-stalled-replies"


@pytest.fixture
async def client(redis_url: str, redis: Redis) -> AsyncIterator[Redis]:
    """A client as the producer's, with a short socket timeout; no write is left paused."""
    client = connect(redis_url, name=NAME)
    client.connection_pool.connection_kwargs["socket_timeout"] = SOCKET_TIMEOUT
    await client.ping()
    try:
        yield client
    finally:
        await redis.execute_command("CLIENT", "UNPAUSE")
        await client.aclose()


async def _held_by_the_pause(redis: Redis) -> bool:
    """The client's script reached Redis and waits there (blocked by the pause)."""
    return any(
        c.get("name") == NAME and "b" in c.get("flags", "") and c.get("cmd", "").startswith("eval")
        for c in await redis.client_list()
    )


def _stand_still(redis_url: str, ran: Any, seconds: float) -> None:
    """Block the event loop (a synchronous call, as a blocking reward does) for ``seconds``: lift
    the pause at once, so Redis runs the held script and replies into the stalled client's
    socket, and wait (still blocking) until ``ran()`` says it ran."""
    start = time.monotonic()
    sync = sync_redis.Redis.from_url(redis_url)
    try:
        sync.execute_command("CLIENT", "UNPAUSE")
        while not ran(sync):
            assert time.monotonic() - start < 30, "the held script never ran"
            time.sleep(0.01)
        time.sleep(max(0.0, start + seconds - time.monotonic()))
    finally:
        sync.close()


async def test_an_admit_answered_during_a_stall_hands_over_every_prompt_it_claimed(
    redis_url: str, redis: Redis, client: Redis, ns: str,
) -> None:
    keys = Keys(ns)
    config = await make_namespace(redis, ns, lease_seconds=5.0)
    for index in range(3):
        await redis.xadd(keys.prompts, prompt_fields(Prompt(index=index, prompt=f"p{index}")))
    queue = PromptQueue(client, keys, "stalled")
    await redis.script_load(lua.ADMIT.source)  # its EVALSHA is the call held, not a NOSCRIPT reply
    await redis.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
    admit = asyncio.create_task(queue.admit(config, 1))
    await wait_until(lambda: _held_by_the_pause(redis), message="the ADMIT held in Redis by the pause")

    def admitted(sync: sync_redis.Redis) -> bool:
        return bool(sync.xpending(keys.prompts, PRODUCERS_GROUP)["pending"])

    _stand_still(redis_url, admitted, STALL)
    admission = await admit
    pending = await redis.xpending_range(keys.prompts, PRODUCERS_GROUP, min="-", max="+", count=10)
    # Run once: the one prompt it claimed is the one it answered (a second run claimed another,
    # left pending under "stalled" and held by no one).
    assert [e.entry_id for e in admission.entries] == [p["message_id"] for p in pending], pending
    assert int(await redis.hget(keys.state, StateField.ADMITTED) or 0) == 1


async def test_a_script_answered_during_a_stall_runs_once(redis_url: str, redis: Redis, client: Redis) -> None:
    key = f"{NAME}-counter"
    await redis.delete(key)
    await redis.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
    call = asyncio.create_task(client.eval("return redis.call('INCR', KEYS[1])", 1, key))
    await wait_until(lambda: _held_by_the_pause(redis), message="the script held in Redis by the pause")
    _stand_still(redis_url, lambda sync: sync.get(key) is not None, STALL)
    assert await call == 1
    assert await redis.get(key) == b"1"


async def test_a_server_that_does_not_answer_still_times_out(redis: Redis, client: Redis) -> None:
    """The stall allowance never turns the socket timeout off: a reply that does not come (the
    write held by a pause the whole time, the loop running) times out, retries included."""
    await redis.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
    async with asyncio.timeout(30):
        with pytest.raises(RedisTimeoutError):
            await client.eval("return redis.call('INCR', KEYS[1])", 1, f"{NAME}-unanswered")
