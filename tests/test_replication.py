"""``wait_replicas``: every script is followed by ``WAIT n timeout`` on the same connection.

A primary and a replica of the suite's redis-server: with the replica up, scripts return once
it has the write; with it stopped, each script waits the timeout, still succeeds on the primary
(WAIT rolls nothing back), and the shortfall is counted and logged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from conftest import redis_binary_under_test
from rollstream.common.connection import connect
from rollstream.runtime.redis_server import EmbeddedRedis


@pytest.fixture
def primary_and_replica() -> Iterator[tuple[EmbeddedRedis, EmbeddedRedis]]:
    binary = redis_binary_under_test()
    with EmbeddedRedis(binary=binary) as primary:
        replica = EmbeddedRedis(binary=binary, extra_args=["--replicaof", "127.0.0.1", str(primary.port)])
        with replica:
            yield primary, replica


async def test_scripts_wait_for_the_replica(
    primary_and_replica: tuple[EmbeddedRedis, EmbeddedRedis], caplog: pytest.LogCaptureFixture
) -> None:
    primary, replica = primary_and_replica
    client = connect(primary.url + "?wait_replicas=1&wait_timeout_ms=300")
    follower = connect(replica.url)
    try:
        deadline = time.monotonic() + 10
        while (await follower.info("replication")).get("master_link_status") != "up":
            assert time.monotonic() < deadline, "replica never connected"
            await asyncio.sleep(0.05)
        script = client.register_script("return redis.call('INCR', KEYS[1])")
        for expected in (1, 2, 3):
            assert await script(keys=["rollstream:{wait}:n"]) == expected
            assert await follower.get("rollstream:{wait}:n") == str(expected).encode()  # already there
        assert client.unreplicated == 0
        replica.stop()
        started = time.monotonic()
        assert await script(keys=["rollstream:{wait}:n"]) == 4  # applied on the primary all the same
        assert time.monotonic() - started >= 0.25  # waited out the timeout
        assert client.unreplicated == 1
        assert "WAIT: 0 of 1 replicas acknowledged within 300 ms" in caplog.text
        await client.set("rollstream:{wait}:plain", 1)  # plain commands do not wait
    finally:
        await client.aclose()
        await follower.aclose()


async def test_wait_replicas_keyword_and_off_by_default(primary_and_replica: tuple[EmbeddedRedis, EmbeddedRedis]) -> None:
    primary, _ = primary_and_replica
    plain = connect(primary.url)
    waiting = connect(primary.url, wait_replicas=1, wait_timeout_ms=50)
    assert not hasattr(plain, "unreplicated")
    assert (waiting.wait_replicas, waiting.wait_timeout_ms) == (1, 50)
    await plain.aclose()
    await waiting.aclose()
