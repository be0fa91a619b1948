"""A cancelled Redis call is never retried and its ``CancelledError`` reaches the caller.

Two ways a cancellation went missing under :meth:`Outage.run` (the one retry mechanism of the
long-running loops), both against a real redis-server and a Lua script that counts its runs:

* redis-py sends every command through ``asyncio.wait_for``, which on Python 3.11 loses a
  cancellation landing as the write finishes: the reply was read and returned as if nothing
  happened (in a loop of random cancellations, 1006 of 2167 accepted ones never arrived); the
  same held for the loops that retry Redis calls on their own (shared limits, the name lease);
* redis-py versions that drop the connection when cancelled mid-reply raise a connection error
  instead (redis/redis-py#2665 shows 4.5's ``ConnectionError('Connection closed by server.')``):
  ``Outage.run`` took it for an outage and sent the step again, and the caller's cancellation
  never arrived. (The installed redis-py re-raises ``CancelledError`` there; the test's step
  raises what the older one did.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest
from conftest import wait_until
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from rollstream.common.connection import Outage, connect
from rollstream.common.keys import Keys
from rollstream.common.protocol import NamespaceLimits
from rollstream.consumer.lease import NameHold
from rollstream.producer.shared_limits import SharedLimits

logger = logging.getLogger(__name__)

# Counts its runs, then holds the server ARGV[1] microseconds (a command still in flight).
COUNTED = """
redis.call('INCR', KEYS[1])
local t = redis.call('TIME')
local until_us = t[1] * 1000000 + t[2] + tonumber(ARGV[1])
repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] >= until_us
return 1
"""


async def _runs(redis: Redis, key: str) -> int:
    return int(await redis.get(key) or 0)


class CancelAtWrite:
    """Cancels ``caller`` the moment redis-py's first write of a command for it finishes (a done
    callback on the task ``asyncio.wait_for`` writes it in, installed by a task factory): the
    window in which Python 3.11's ``wait_for`` returns the write's result and drops the
    cancellation. Counts the caller's writes (every command it sends)."""

    def __init__(self) -> None:
        self.caller: asyncio.Task[Any] | None = None
        self.writes = 0

    def factory(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any],
                **kwargs: Any) -> asyncio.Task[Any]:
        task = asyncio.Task(coro, loop=loop, **kwargs)
        caller = self.caller
        if caller is not None and asyncio.current_task() is caller and "_send_packed_command" in coro.__qualname__:
            self.writes += 1
            if self.writes == 1:
                task.add_done_callback(lambda _: caller.cancel())
        return task

    @contextlib.contextmanager
    def around(self, call: Coroutine[Any, Any, Any]) -> Iterator[asyncio.Task[Any]]:
        loop = asyncio.get_running_loop()
        loop.set_task_factory(self.factory)
        try:
            self.caller = asyncio.create_task(call)
            yield self.caller
        finally:
            loop.set_task_factory(None)
            if self.caller is not None:  # a test that failed leaves no task behind
                self.caller.cancel()


async def test_a_cancellation_lost_as_the_command_is_written_still_reaches_the_caller(
    redis_url: str, redis: Redis, ns: str
) -> None:
    """Deterministic (:class:`CancelAtWrite`): the script runs once (it was sent) and the caller
    gets ``CancelledError`` (it got the script's result)."""
    key = f"{ns}:runs"
    client = connect(redis_url, name=f"{ns}-lost")
    hook = CancelAtWrite()
    try:
        await client.ping()  # the connection and its handshake first: the next write is the script's
        with hook.around(Outage(logger, "lost-cancel test").run(lambda: client.eval(COUNTED, 1, key, 0))) as caller:
            with pytest.raises(asyncio.CancelledError):
                await caller
        assert hook.writes == 1 and caller.cancelled()
        await wait_until(lambda: _runs(redis, key), message="the script sent before the cancellation ran")
        assert await _runs(redis, key) == 1
    finally:
        await client.aclose()


async def test_a_shared_rate_wait_whose_cancellation_was_lost_ends_and_asks_no_more(
    redis_url: str, redis: Redis, ns: str
) -> None:
    """SharedLimits.take polls Redis for a rate token in its own loop (and hold() for a unit):
    a cancellation lost in one TAKE left it polling until a token came (here a minute away)."""
    client = connect(redis_url, name=f"{ns}-rate")
    limits = NamespaceLimits(client, Keys(ns))
    await limits.set({}, {"judge": 1 / 60})
    assert (await limits.take("judge", 1 / 60, 0))[0] == "ok"  # the next token is a minute away
    shared = SharedLimits(limits, "p", 30.0)
    await shared.refresh()
    hook = CancelAtWrite()

    async def ended_or_asked_again() -> bool:
        return caller.done() or hook.writes > 1

    try:
        with hook.around(shared.take("judge")) as caller:
            await wait_until(ended_or_asked_again, interval=0.01, message="the cancelled wait ended or asked again")
            assert caller.done() and caller.cancelled(), f"asked {hook.writes} times, not cancelled"
        assert hook.writes == 1
    finally:
        await client.aclose()


async def test_a_cancellation_that_comes_out_as_a_connection_error_is_not_retried(
    redis_url: str, redis: Redis, ns: str
) -> None:
    """The step (an INCR counting its runs, then a BLPOP) is cancelled while its BLPOP is blocked
    in Redis (CLIENT LIST shows it), and reports the cancellation as the connection error older
    redis-py raised. Outage.run took it for an outage: the step ran again and the caller's
    cancellation never arrived."""
    key = f"{ns}:runs"
    name = f"{ns}-converted"
    client = connect(redis_url, name=name, block_ms=20_000)
    converting = True

    async def step() -> Any:
        await client.incr(key)
        try:
            return await client.blpop([f"{ns}:never"], timeout=20)
        except asyncio.CancelledError as exc:  # what redis-py 4.5 raised here (redis/redis-py#2665)
            if converting:
                raise RedisConnectionError("Connection closed by server.") from exc
            raise

    async def blocked() -> bool:
        return any(c.get("name") == name and c.get("cmd") == "blpop" for c in await redis.client_list())

    async def ended_or_sent_again() -> bool:
        return caller.done() or await _runs(redis, key) > 1

    caller = asyncio.create_task(Outage(logger, "converted-cancel test").run(step))
    try:
        await wait_until(blocked, interval=0.01, message="the step's BLPOP blocked in Redis")
        caller.cancel()
        await wait_until(ended_or_sent_again, interval=0.01, message="the cancelled call ended or was sent again")
        assert caller.done() and caller.cancelled(), f"sent again ({await _runs(redis, key)} runs), not cancelled"
        assert await _runs(redis, key) == 1
    finally:
        converting = False
        caller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await caller
        await client.aclose()


async def test_a_name_lease_renewal_whose_cancellation_was_lost_ends(redis_url: str, ns: str) -> None:
    """The trainer's name-lease loop retries Redis on its own: a cancellation lost in one renewal
    left it renewing (every 2.5 s) after its trainer closed."""
    client = connect(redis_url, name=f"{ns}-lease")
    hold = NameHold(client, Keys(ns), "trainer-cancel")
    hook = CancelAtWrite()

    async def ended_or_renewed_again() -> bool:
        return caller.done() or hook.writes > 1

    try:
        await hold.take(1)
        with hook.around(hold._renew()) as caller:  # the loop keep() runs
            await wait_until(ended_or_renewed_again, interval=0.01, message="the cancelled loop ended or renewed again")
            assert caller.done() and caller.cancelled(), f"renewed {hook.writes} times, not cancelled"
        assert hook.writes == 1
    finally:
        await client.aclose()
